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

// The block's stages either side of the attention kernel, shared with the
// context-parallel block (attention_cp.h), which puts its K, V exchange
// between them. Shapes as in AttentionSaved, T = B·S rows.
//
// q, k, v = x·Wqᵀ, x·Wkᵀ, x·Wvᵀ written into the given [B, S, H, hd] buffers,
// then RoPE on q and k at pos_S.
void attention_qkv_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                           const Tensor& x_TD, const Tensor& pos_S, Tensor& q_BSHd, Tensor& k_BSHd, Tensor& v_BSHd);
// y = o·Woᵀ's backward: returns do [B, S, Hq, hd]; dWo (from dy, o) into grad.wo.
Tensor attention_output_backward(const ExecContext& ctx, const AttentionWeights& w, const Tensor& dy_TD,
                                 const Tensor& o_BSHd, AttentionWeights& grad, WeightGradQueue* defer);
// attention_qkv_forward's backward from the kernel's dq, dk, dv (RoPE's
// backward runs in place on dq and dk): dWq, dWk, dWv into grad; returns dx.
Tensor attention_qkv_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                              const Tensor& x_TD, const Tensor& pos_S, Tensor& dq_BSHd, Tensor& dk_BSHd,
                              const Tensor& dv_BSHd, AttentionWeights& grad, WeightGradQueue* defer);

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
