// Self-attention block (ARCHITECTURE.md §4), without the residual and norm:
//   q,k,v = x·Wqᵀ, x·Wkᵀ, x·Wvᵀ ; q,k = RoPE(q,k) at global positions
//   o = softmax(q·kᵀ/√hd + causal)·v ; y = o·Woᵀ
// GQA: query head j reads kv head j / (Hq/Hkv). Weights are [out, in].
#pragma once
#include "kernels/attention.h"
#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::dense {

struct AttentionOptions {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  float rope_theta = 10000.0f;
};

// Views into the layer's parameter (or gradient) buffer.
struct AttentionWeights {
  Tensor wq;  // [Hq·hd, D]
  Tensor wk;  // [Hkv·hd, D]
  Tensor wv;  // [Hkv·hd, D]
  Tensor wo;  // [D, Hq·hd]
};

struct AttentionSaved {
  AttentionDims dims;
  Tensor x_TD;         // block input (the normed residual), [B·S, D]
  Tensor pos_S;        // global positions, i32 [S]
  Tensor q_BSHd;       // after RoPE, [B, S, Hq, hd]
  Tensor k_BSHd;       // after RoPE, [B, S, Hkv, hd]
  Tensor v_BSHd;       // [B, S, Hkv, hd]
  Tensor o_BSHd;       // attention output before Wo, [B, S, Hq, hd]
  Tensor lse_BHS;      // softmax log-sum-exp, [B, Hq, S]
};

// x_TD: [B·S, D]; pos_S: i32 [S]. Returns y_TD [B·S, D].
Tensor attention_module_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                                const Tensor& x_TD, int64_t batch, const Tensor& pos_S, AttentionSaved& saved);
// Returns dx_TD; accumulates into the gradient views `grad`. With defer
// (kernels/deferred.h) dx only now; the four weight GEMMs are pushed, keeping
// dy and o (dWo), dq, dk, dv after RoPE's backward and x (dWq, dWk, dWv), and
// `grad` is the binding they land in.
Tensor attention_module_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                                 const AttentionSaved& saved, const Tensor& dy_TD, AttentionWeights& grad,
                                 WeightGradQueue* defer = nullptr);

}  // namespace origami::dense
