// MoE routing ops (ARCHITECTURE.md §4): per-token scores and top-k selection
// with their backward, routing statistics, expert histograms, capacity masks,
// the permutation row maps, and the row gathers/scatters of permute/unpermute.
// moe/router.cpp and moe/permutation.cpp call these; they own the math's shape,
// these own the inner loops (and get CUDA twins later).
//
// Conventions: expert_TK / row maps are i32, kept_TK is u8 (1 = kept), counts
// are i64. A "slot" is (t, j), j < k; slots are ordered token-major (t, then j).
// Ops overwrite their outputs unless they say "accumulates".
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// Kernel-level mirrors of moe::ScoreFunction / moe::DropPolicy (kernels/ sits
// below moe/ and must not include it).
enum class MoeScore { softmax, sigmoid };
enum class MoeDrop { probs, position };

struct MoeTopkParams {
  MoeScore score = MoeScore::softmax;
  int64_t top_k = 1;
  int64_t num_groups = 1;  // > 1: group-limited selection
  int64_t group_topk = 1;  // groups kept per token
  bool normalize = false;  // p /= (Σ_j p_j + 1e-20)
  float scaling = 1.0f;    // then p *= scaling
};

// Checks E, k and the group parameters; fails with a message naming them.
void check_moe_topk_params(const MoeTopkParams& p, int64_t num_experts);

// Per token t of logits_TE [T, E]:
//   scores_TE = softmax(z) or σ(z);
//   selection value v = s + bias_E (bias undefined: 0). With num_groups > 1 a
//   group's score is the sum of its top (top_k / group_topk) values of v and
//   only the best group_topk groups (ties: lower group) are eligible;
//   expert_TK (i32 [T, k]) = top_k eligible experts by v, descending, ties to
//   the lower expert index;
//   weight_TK = s at those experts, normalized if p.normalize, times p.scaling.
// lse_T (f32 [T], optional: undefined skips it) = logsumexp_e z_te (z-loss).
void moe_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                      Tensor& scores_TE, Tensor& expert_TK, Tensor& weight_TK, Tensor& lse_T);

// Routing statistics per segment: segment b is tokens [b·seg_len, (b+1)·seg_len)
// (seg_len = T: one segment). Host outputs, overwritten, [S·E] row-major:
//   counts_SE[b·E + e] = slots of segment b that selected e;
//   scores_SE[b·E + e] = Σ_t s'_te, s' = s (softmax) or s / (Σ_e s + 1e-20)
//   (sigmoid: scores normalized per token, Megatron's aux-loss input).
// Sums run over fixed 256-token chunks, then chunks in order, so the result is
// bitwise independent of the thread count.
void moe_routing_stats(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& expert_TK, MoeScore score,
                       int64_t seg_len, double* counts_SE, double* scores_SE);

// dlogits_TE = ∂/∂z of   Σ_tj dweight_TK[t,j]·p_tj           (dweight undefined: no term)
//                     + Σ_te aux_SE[seg(t), e]·s'_te          (aux undefined: no term)
//                     + z_coef · Σ_t lse_t²
// with p, s, s' as in moe_topk_forward / moe_routing_stats and the selection
// held fixed (expert_TK). aux_SE: f32 [T / seg_len, E].
void moe_topk_backward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& scores_TE,
                       const Tensor& expert_TK, const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len,
                       float z_coef, const MoeTopkParams& p, Tensor& dlogits_TE);

// count_E (i64 [E]) = slots with expert_TK == e that are kept (kept_TK
// undefined: every slot).
void moe_expert_histogram(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, int64_t num_experts,
                          Tensor& count_E);

// kept_TK (u8 [T, k]) under capacity C >= 0 per expert. probs: each expert
// keeps its C slots of highest weight (ties: lower token, then lower slot);
// position: its first C slots in token-major order.
void moe_capacity_mask(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& weight_TK, int64_t num_experts,
                       int64_t capacity, MoeDrop policy, Tensor& kept_TK);

// Row maps of the permuted buffer. Expert e owns rows_E[e] rows (i64 [E], at
// least its kept count) starting at Σ_{e'<e} rows_E[e']; its kept slots fill
// them in token-major order, the rest are padding (token = slot = −1).
//   row_of_TK (i32 [T, k]): row of each slot, −1 when dropped;
//   row_token_N, row_slot_N (i32 [N], N = Σ rows_E): source token and slot.
void moe_permutation_maps(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, const Tensor& rows_E,
                          Tensor& row_of_TK, Tensor& row_token_N, Tensor& row_slot_N);

// x_ND[n] = x_TD[row_token_N[n]]; padding rows (token −1) are zero.
void moe_permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Tensor& row_token_N, Tensor& x_ND);
// Accumulates dx_TD[t] += Σ_j dx_ND[row_of_TK[t, j]] over kept slots.
void moe_permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Tensor& row_of_TK, Tensor& dx_TD);
// out_TD[t] = Σ_j weight_TK[t, j] · y_ND[row_of_TK[t, j]] over kept slots
// (a token with every slot dropped gets zeros).
void moe_unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Tensor& row_of_TK, const Tensor& weight_TK,
                        Tensor& out_TD);
// dy_ND[row(t, j)] = weight_TK[t, j] · dout_TD[t]; padding rows zero.
// dweight_TK[t, j] = <dout_TD[t], y_ND[row(t, j)]>, 0 for dropped slots.
void moe_unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND,
                                 const Tensor& row_of_TK, const Tensor& row_token_N, const Tensor& weight_TK,
                                 Tensor& dy_ND, Tensor& dweight_TK);

}  // namespace origami
