// MoE routing ops (ARCHITECTURE.md §4): per-token scores and top-k selection
// with their backward, the router's statistics buffer and the scalars and
// coefficients taken from it, expert histograms, capacity masks, the rows per
// expert and the permutation row maps, the row gathers/scatters of
// permute/unpermute, and the expert-bias update of aux-loss-free balancing.
// moe/router.cpp and moe/permutation.cpp call these; they own the math's
// shape, these own the inner loops (and get CUDA twins later).
//
// Conventions: expert_TK / row maps are i32, kept_TK is u8 (1 = kept), counts
// are i64, statistics f64. A "slot" is (t, j), j < k; slots are ordered
// token-major (t, then j). Ops overwrite their outputs unless they say
// "accumulates".
#pragma once
#include <span>

#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// The router's score function and the capacity drop policy. Defined here,
// the lowest layer that reads them; moe/options.h names them
// moe::ScoreFunction and moe::DropPolicy.
enum class MoeScore { softmax, sigmoid };
enum class MoeDrop { probs, position };

// Selection and weights of the router: what moe_topk_forward and its
// backward read. moe::RouterOptions extends this struct and the config file
// fills it (moe.score_function, top_k, ...), so the values a config names
// reach the kernels through no copy.
struct MoeTopkParams {
  MoeScore score_function = MoeScore::softmax;
  int64_t top_k = 2;
  int64_t num_groups = 1;       // > 1: group-limited selection
  int64_t group_topk = 1;       // groups kept per token
  bool normalize_topk = false;  // p /= (Σ_j p_j + 1e-20)
  double topk_scaling = 1.0;    // then p *= scaling_f32(): kept as configured, applied in fp32
  float scaling_f32() const { return static_cast<float>(topk_scaling); }
};

// Checks E, k and the group parameters; fails with a message naming them.
void check_moe_topk_params(const MoeTopkParams& p, int64_t num_experts);

// The CUDA router keeps one token's scores, selection values, group scores
// and picks in a warp's slice of a block's 48 KiB of shared memory
// (kernels/cuda/moe_topk.cu): E experts in G groups with top-k K fit when
// 2E + 2G + K words do (about 6,000 experts). Config validation refuses
// the rest for CUDA runs, as a user error.
inline constexpr int64_t kMoeCudaRouterWords = 48 * 1024 / 4;
constexpr bool moe_router_fits_cuda(int64_t E, int64_t G, int64_t K) {
  return 2 * E + 2 * G + K <= kMoeCudaRouterWords;
}

// Per token t of logits_TE [T, E]:
//   scores_TE = softmax(z) or σ(z);
//   selection value v = s + bias_E (bias undefined: 0). With num_groups > 1 a
//   group's score is the sum of its top (top_k / group_topk) values of v and
//   only the best group_topk groups (ties: lower group) are eligible;
//   expert_TK (i32 [T, k]) = top_k eligible experts by v, descending, ties to
//   the lower expert index;
//   weight_TK = s at those experts, normalized if p.normalize, times p.scaling.
// lse_T (f32 [T], optional: undefined skips it) = logsumexp_e z_te (z-loss).
// Non-finite logits (a diverged run): a NaN value of v is never eligible, nor
// is a group with fewer than top_k / group_topk values that are not NaN.
// A token with fewer than top_k eligible experts takes the eligible ones in
// order, then the lowest experts not yet taken, and NaN weights: every index
// stays valid downstream and the loss reports the divergence. Any NaN or
// +inf logit makes the token's softmax scores and lse NaN.
void moe_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                      Tensor& scores_TE, Tensor& expert_TK, Tensor& weight_TK, Tensor& lse_T);

// The router's statistics buffer, overwritten: stats_N (f64 [2·S·E + 2]) =
//   [counts_SE | scores_SE | T | Σ_t lse_t²]  with, row-major per segment b
//   (tokens [b·T/S, (b+1)·T/S)):
//   counts_SE[b·E + e] = slots of segment b that selected e;
//   scores_SE[b·E + e] = Σ_t s'_te, s' = s (softmax) or s / (Σ_e s + 1e-20)
//   (sigmoid: scores normalized per token, Megatron's aux-loss input);
//   T = the token count; Σ lse² = sum_squares(lse_T) (lse_T undefined: 0).
// num_segments S = 0 leaves out the aux part (no aux loss): stats_N is [2].
// T = 0 gives zeros. The counts and score sums run over fixed 256-token
// chunks, then chunks in order, so they are bitwise independent of the
// thread count (Σ lse² is sum_squares's, elementwise.h).
void moe_routing_stats(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& lse_T,
                       MoeScore score, int64_t num_segments, Tensor& stats_N);

// The totals of a (reduced) statistics buffer of moe_routing_stats with S
// segments over E experts and k slots per token, written to totals_3 (f64
// [3], on the context's device; no host read: the router reads them later,
// ExecContext::read_later), in this order:
struct MoeRoutingTotals {
  double tokens = 0;      // T (of the whole group after the reduction)
  double balance = 0;     // Σ_b Σ_e f_be · P_be, f = count / (T_b · k), P = score sum / T_b, T_b = T / S (S > 0)
  double lse_sq_sum = 0;  // Σ_t lse_t²
  // The fields of a host totals_3.
  static MoeRoutingTotals of(const Tensor& host_totals_3) {
    ORIGAMI_CHECK(host_totals_3.defined() && host_totals_3.device().kind == DeviceKind::cpu &&
                      host_totals_3.dtype() == DType::f64 && host_totals_3.numel() == 3,
                  "router totals must be a host f64 [3]");
    const double* t = host_totals_3.data<double>();
    return {t[0], t[1], t[2]};
  }
};
void moe_routing_totals(const ExecContext& ctx, const Tensor& stats_N, int64_t num_segments, int64_t num_experts,
                        int64_t top_k, Tensor& totals_3);

// aux_SE (f32 [S, E]) = fp32(scale · counts_SE) from a statistics buffer
// stats_N (f64 [2·S·E + 2]): the aux loss's gradient coefficients on s'.
void moe_aux_coefficients(const ExecContext& ctx, const Tensor& stats_N, double scale, Tensor& aux_SE);

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

// kept_TK (u8 [T, k]) under capacity C per expert. probs: each expert keeps
// its C slots of highest weight (ties: lower token, then lower slot);
// position: its first C slots in token-major order. C < 0 (dropless): every
// slot is kept.
void moe_capacity_mask(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& weight_TK, int64_t num_experts,
                       int64_t capacity, MoeDrop policy, Tensor& kept_TK);

// rows_E (i64 [E]) = the rows each expert owns in the permuted buffer:
// pad_rows for every expert when pad_rows >= 0 (pad_to_capacity), else
// kept_E, its kept slots.
void moe_expert_rows(const ExecContext& ctx, const Tensor& kept_E, int64_t pad_rows, Tensor& rows_E);

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

// Aux-loss-free balancing (DeepSeek-V3), accumulates: bias_E[e] += rate ·
// sign(mean(load) − load_e), the sign taken exactly in integers
// (Σ load − E·load_e; sign(0) = 0). load_E: host counts (the global batch's,
// summed over ranks as host metadata), one per expert.
void moe_expert_bias_update(const ExecContext& ctx, Tensor& bias_E, std::span<const int64_t> load_E, float rate);

}  // namespace origami
