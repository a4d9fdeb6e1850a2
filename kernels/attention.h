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

// Shared memory per block of the CUDA backend's SIMT attention kernels (any
// head_dim; bf16 at 64 and 128 takes tensor cores, in less), which hold fp32
// tiles of kAttentionCudaSimtRows rows (row stride hd + 1 when hd is even,
// against bank conflicts). A device's opt-in maximum per block (227 KiB on
// Hopper) bounds head_dim there: the config rules refuse a larger one for
// runtime.device = "cuda" (engine/config_rules.cpp), and the launches
// check it again (kernels/cuda/attention_tiles.cuh).
inline constexpr int64_t kAttentionCudaSimtRows = 32;
constexpr int64_t attention_cuda_simt_ld(int64_t hd) { return hd % 2 == 0 ? hd + 1 : hd; }
// Q and K tiles (row stride ld), a V tile and the O accumulator (stride
// hd), the score tile, 3 row statistics and 3 rows of positions.
constexpr size_t attention_cuda_forward_smem(int64_t hd) {
  constexpr int64_t r = kAttentionCudaSimtRows;
  return static_cast<size_t>((2 * r * attention_cuda_simt_ld(hd) + 2 * r * hd + r * (r + 1) + 3 * r) * 4 + 3 * r * 4);
}
// Four row tiles, two score tiles, two accumulators and 4 row statistics.
constexpr size_t attention_cuda_backward_smem(int64_t hd) {
  constexpr int64_t r = kAttentionCudaSimtRows;
  return static_cast<size_t>((4 * r * attention_cuda_simt_ld(hd) + 2 * r * (r + 1) + 2 * r * hd + 4 * r) * 4);
}
// What a run of the SIMT kernels needs: the forward's, and with `backward`
// (training) the larger of both passes'.
constexpr size_t attention_cuda_smem(int64_t hd, bool backward) {
  const size_t fwd = attention_cuda_forward_smem(hd), bwd = attention_cuda_backward_smem(hd);
  return backward && bwd > fwd ? bwd : fwd;
}
// The largest even head_dim that fits `smem_per_block` bytes (0 when none
// does): for training 290 at Hopper's 232448, 118 at the 101376 of sm_86/89.
constexpr int64_t attention_cuda_max_head_dim(size_t smem_per_block, bool backward = true) {
  int64_t hd = 0;
  while (attention_cuda_smem(hd + 2, backward) <= smem_per_block) hd += 2;
  return hd;
}
// bf16 at head_dim 64 and 128 takes the tensor-core kernels instead, whose
// tiles need under 100 KB a block at 128 (every GPU the build targets has
// 99 KiB or more).
constexpr bool attention_cuda_on_tensor_cores(bool bf16, int64_t hd) { return bf16 && (hd == 64 || hd == 128); }

// q_BSHd: [B, Sq, Hq, hd]; k, v: [B, Skv, Hkv, hd]; q_pos_S: i32 [Sq];
// kv_pos_S: i32 [Skv]; o: [B, Sq, Hq, hd]; lse_BHS: [B, Hq, Sq] (natural log
// of the softmax denominator of the scaled scores; saved for backward).
// A query that sees no key (q_pos[i] < every kv_pos) gets o = 0 and
// lse = −inf: the empty softmax, which attention_merge below folds into a
// result of other keys as nothing. Ring attention (dense/attention_ring.h)
// runs the kernel on one cp rank's block of keys at a time, where some query
// rows see none of them. Positions are below INT32_MAX: the kernels pad
// partial key tiles with keys at INT32_MAX, which a query there would see
// (unchecked: the positions live on the device, and a sequence that long
// is no training input).
// Workspace sizes are in bytes for this context; the caller allocates (CUB
// style: ctx.workspace(attention_forward_workspace_bytes(ctx, dims))).
size_t attention_forward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims);
void attention_forward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& o,
                       Tensor& lse_BHS, Tensor& workspace);

// dq, dk, dv are overwritten. o and lse may be those of a call over more
// keys than k and v (ring attention passes the merged result of every block):
// then dq is this block's share of the gradient and dk, dv are exact for its
// keys. A row whose lse is −inf (it saw no key) contributes nothing.
size_t attention_backward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims);
void attention_backward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                        const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                        Tensor& workspace);

// Folds one partial result (o_part, lse_part: attention of the same queries
// over another set of keys) into a running one, in place:
//   lse = log(exp(lse_acc) + exp(lse_part))
//   o   = exp(lse_acc − lse) · o_acc + exp(lse_part − lse) · o_part
// which is the attention over both key sets together. A row whose lse_part
// is −inf (no visible key in the part) is left bitwise unchanged; a running
// row at −inf takes the part's values. o: [B, Sq, Hq, hd]; lse: [B, Hq, Sq].
void attention_merge(const ExecContext& ctx, const Tensor& o_part, const Tensor& lse_part, Tensor& o_acc,
                     Tensor& lse_acc);

}  // namespace origami
