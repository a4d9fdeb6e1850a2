// Router (see router.h): z = x·Wrᵀ through the gemm kernel, per-token scores,
// top-k and weights in kernels/moe_ops, then the load-balancing and z losses
// from one reduced statistics buffer. Backward turns the loss terms into
// per-(segment, expert) coefficients on s' and a scalar on lse², lets the
// per-token kernel apply the chain rule to dz, and finishes with two GEMMs.
//
// Aux loss (Megatron switch_load_balancing_loss_func), per segment b (the
// whole micro-batch, or one sequence for seq_aux_loss), over the group's
// tokens after the reduction:
//   aux = coeff · E / S · Σ_b Σ_e f_be · P_be,  f_be = count_be / (T_b · k),
//   P_be = Σ_{t∈b} s'_te / T_b,  T_b = T_group / S.
// f is a constant (counts do not differentiate), so ∂aux/∂s'_te = coeff·E·f_be
// / (S·T_b) for the local tokens t of b; summed over the group's ranks those
// gradients are exactly the gradient of the group's aux value.
#include "moe/router.h"

#include <cmath>

#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/moe_ops.h"

namespace origami::moe {

namespace {

// Segments the aux statistics are kept per: sequences for seq_aux_loss.
int64_t aux_segments(const RouterOptions& opt, int64_t T, int64_t seq_len) {
  if (opt.load_balancing != LoadBalancing::seq_aux_loss) return 1;
  // Every rank of the group must reduce the same S·E counts, so a rank
  // without tokens has no sequence to contribute and cannot take part.
  ORIGAMI_CHECK(T > 0 && seq_len > 0 && T % seq_len == 0, "seq_aux_loss: ", T, " router tokens are not whole sequences of ",
                seq_len);
  return T / seq_len;
}

Tensor activation(const ExecContext& ctx, Shape shape, DType dt = DType::f32) {
  return ctx.empty(std::move(shape), dt, MemCategory::activation);
}

}  // namespace

Routing router_forward(const ExecContext& ctx, const RouterOptions& opt, const Tensor& x_TD, const Tensor& gate_ED,
                       const Tensor& bias_E, int64_t seq_len, RouterSaved& saved, const StatsReducer& reduce) {
  ORIGAMI_CHECK(x_TD.defined() && gate_ED.defined(), "router_forward on an undefined tensor");
  const int64_t T = x_TD.rows(), D = x_TD.cols(), E = opt.num_experts, K = opt.top_k;
  check_shape(gate_ED, {E, D}, "router gate_ED (num_experts, hidden)");
  const MoeTopkParams& params = opt;  // the kernels read the router's options as they are
  check_moe_topk_params(params, E);

  Tensor logits = activation(ctx, {T, E});
  gemm(ctx, x_TD, Trans::no, gate_ED, Trans::yes, logits);  // (T, E)
  Tensor scores = activation(ctx, {T, E});
  Routing routing{activation(ctx, {T, K}, DType::i32), activation(ctx, {T, K})};
  const bool want_aux = opt.aux_active(), want_z = opt.z_active();
  Tensor lse = want_z ? ctx.empty({T}, DType::f32, MemCategory::workspace) : Tensor();
  moe_topk_forward(ctx, logits, bias_E, params, scores, routing.expert_TK, routing.weight_TK, lse);

  saved.x_TD = x_TD;
  saved.logits_TE = logits;
  saved.scores_TE = scores;
  saved.expert_TK = routing.expert_TK;
  saved.seq_len = seq_len;
  saved.stats_N = Tensor();
  saved.aux_segments = 0;
  saved.aux_tokens = 0;
  saved.totals = HostRead();
  if (!want_aux && !want_z) return routing;

  // One buffer, one reduction: [counts S·E | score sums S·E | tokens | Σ lse²].
  // A rank with no tokens adds zeros (its group's statistics still reduce).
  const int64_t S = want_aux ? aux_segments(opt, T, seq_len) : 0, SE = S * E;
  Tensor stats = activation(ctx, {2 * SE + 2}, DType::f64);
  moe_routing_stats(ctx, scores, routing.expert_TK, lse, params.score_function, S, stats);
  if (reduce) reduce(stats);
  Tensor totals = ctx.empty({3}, DType::f64, MemCategory::workspace);
  moe_routing_totals(ctx, stats, S, E, K, totals);
  saved.totals = ctx.read_later(totals);
  if (want_aux) {
    saved.stats_N = stats;
    saved.aux_segments = S;
  }
  return routing;
}

RouterLosses router_losses(const RouterOptions& opt, RouterSaved& saved) {
  RouterLosses losses;
  if (!saved.totals.defined()) return losses;  // neither loss active
  const MoeRoutingTotals totals = MoeRoutingTotals::of(saved.totals.get());
  ORIGAMI_CHECK(totals.tokens > 0, "router statistics cover no tokens after the reduction");
  saved.aux_tokens = totals.tokens;
  const double E = static_cast<double>(opt.num_experts);
  if (opt.aux_active())
    losses.aux_loss = static_cast<double>(opt.aux_loss_coeff_f32()) * E / static_cast<double>(saved.aux_segments) *
                      totals.balance;
  if (opt.z_active()) losses.z_loss = static_cast<double>(opt.z_loss_coeff_f32()) * totals.lse_sq_sum / totals.tokens;
  return losses;
}

Tensor router_backward(const ExecContext& ctx, const RouterOptions& opt, const RouterSaved& saved,
                       const Tensor& gate_ED, const Tensor& dweight_TK, float aux_scale, Tensor& dgate_ED,
                       WeightGradQueue* defer) {
  const Tensor& x = saved.x_TD;
  ORIGAMI_CHECK(x.defined() && saved.logits_TE.defined(), "router_backward without a saved forward");
  const int64_t T = x.rows(), D = x.cols(), E = opt.num_experts, K = opt.top_k;
  check_shape(gate_ED, {E, D}, "router gate_ED");
  if (!defer) check_shape(dgate_ED, {E, D}, "router dgate_ED");  // deferred: unbound until W (the gemm checks it)
  const MoeTopkParams& params = opt;
  if (T == 0) return ctx.empty_data({0, D});  // no tokens: no gradient (the group's reduction happened in forward)
  ORIGAMI_CHECK(!(opt.aux_active() || opt.z_active()) || saved.aux_tokens > 0,
                "router_backward: the forward's losses were never taken (router_losses)");

  // ∂(aux_scale · aux)/∂s'_te, one row per segment.
  Tensor aux_SE;
  int64_t seg_len = T;
  if (opt.aux_active()) {
    const int64_t S = saved.aux_segments;
    ORIGAMI_CHECK(S >= 1 && saved.stats_N.defined() && saved.stats_N.numel() == 2 * S * E + 2 &&
                      saved.aux_tokens > 0,
                  "router_backward: saved aux statistics of ", S, " segments over ", saved.aux_tokens,
                  " tokens; expected at least one segment of ", E, " experts");
    seg_len = T / S;
    const double Tb = saved.aux_tokens / static_cast<double>(S);
    const double c = static_cast<double>(aux_scale) * static_cast<double>(opt.aux_loss_coeff_f32()) *
                     static_cast<double>(E) / (static_cast<double>(S) * Tb * Tb * static_cast<double>(K));
    aux_SE = ctx.empty({S, E}, DType::f32, MemCategory::workspace);
    moe_aux_coefficients(ctx, saved.stats_N, c, aux_SE);
  }
  // ∂(aux_scale · z_coeff · Σ lse² / T_group)/∂(Σ lse²).
  const float z_coef =
      opt.z_active() ? static_cast<float>(aux_scale * static_cast<double>(opt.z_loss_coeff_f32()) / saved.aux_tokens)
                     : 0.0f;

  Tensor dlogits = activation(ctx, {T, E});
  moe_topk_backward(ctx, saved.logits_TE, saved.scores_TE, saved.expert_TK, dweight_TK, aux_SE, seg_len, z_coef, params,
                    dlogits);
  // The f32 logit gradient enters the GEMMs in the data dtype (the router
  // computes its logits and scores in f32, its weights are data).
  const Tensor dlogits_data = as_dtype(ctx, dlogits, gate_ED.dtype());
  Tensor dx = ctx.empty_data({T, D});
  gemm(ctx, dlogits_data, Trans::no, gate_ED, Trans::no, dx);  // (T, D)
  linear_weight_grad(ctx, defer, dlogits_data, x, dgate_ED);    // (E, D)
  return dx;
}

void update_expert_bias(const ExecContext& ctx, Tensor& bias_E, const std::vector<int64_t>& load_E, float rate) {
  moe_expert_bias_update(ctx, bias_E, load_E, rate);
}

}  // namespace origami::moe
