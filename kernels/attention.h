// Causal grouped-query attention, tiled with an online softmax (FlashAttention
// style): memory is O(seq · tile) per head, never O(seq²). The backward pass
// recomputes probabilities tile by tile from the saved log-sum-exp.
//   o = softmax(q·kᵀ · scale + mask) · v,  mask(i, j) = 0 if kv_pos[j] <= q_pos[i] else −inf
// Query head h reads kv head h / (Hq / Hkv).
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

struct AttentionDims {
  int64_t batch = 0, q_len = 0, kv_len = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
};

// q_BSHd: [B, Sq, Hq, hd]; k, v: [B, Skv, Hkv, hd]; q_pos_S: i32 [Sq];
// kv_pos_S: i32 [Skv]; o: [B, Sq, Hq, hd]; lse_BHS: [B, Hq, Sq] (natural log
// of the softmax denominator of the scaled scores; saved for backward).
// Every query must see at least one key (kv_pos[j] <= q_pos[i] for some j).
// Workspace sizes are in bytes for this context; the caller allocates (CUB
// style: ctx.workspace(attention_forward_workspace_bytes(ctx, dims))).
size_t attention_forward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims);
void attention_forward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& o,
                       Tensor& lse_BHS, Tensor& workspace);

// dq, dk, dv are overwritten.
size_t attention_backward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims);
void attention_backward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                        const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                        Tensor& workspace);

}  // namespace origami
