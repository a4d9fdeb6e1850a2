// MoE layer (see moe_layer.h): a plain call sequence over the router,
// capacity, permutation, dispatcher and grouped experts. Backward replays it in
// reverse; the router's backward receives the gradient w.r.t. the routing
// weights p (from the combine step) plus the aux/z-loss terms.
#include "moe/moe_layer.h"

#include "kernels/elementwise.h"

namespace origami::moe {

namespace {

// The saved experts' activations, recomputed from their kept input when
// forward dropped them (recompute_experts).
ExpertsSaved rebuilt(const ExecContext& ctx, const ExpertWeights& w, const ExpertsSaved& saved) {
  if (saved.h_NF.defined() || !saved.x_ND.defined()) return saved;
  ExpertsSaved again;
  experts_forward(ctx, w, saved.x_ND, saved.segments, again);
  return again;
}

// Kept rows per destination EP rank: each expert's go to its placed owner.
std::vector<int64_t> per_ep_rank(const std::vector<int64_t>& kept, const ExpertPlacement& placement) {
  std::vector<int64_t> out(placement.ep(), 0);
  for (size_t e = 0; e < kept.size(); ++e) out[placement.owner(static_cast<int64_t>(e))] += kept[e];
  return out;
}

}  // namespace

Tensor moe_layer_forward(const ExecContext& ctx, const MoeLayerOptions& opt, const MoeLayerWeights& w,
                         const Tensor& x_TD, int64_t seq_len, MoeLayerSaved& saved, MoeLayerStats& stats,
                         const StatsReducer& reduce, const AllToAllDispatcher* dispatcher) {
  const int64_t E = opt.router.num_experts, k = opt.router.top_k;
  const AllToAllDispatcher local(ctx, E, nullptr, nullptr);
  const AllToAllDispatcher& disp = dispatcher ? *dispatcher : local;
  ORIGAMI_CHECK(x_TD.dim() == 2, "moe_layer_forward: x_TD should be [T, D], got ", shape_string(x_TD.shape()));
  const int64_t T = x_TD.size(0), D = x_TD.size(1);
  check_shape(w.gate_ED, {E, D}, "moe gate_ED");
  ORIGAMI_CHECK(disp.num_experts() == E, "dispatcher for ", disp.num_experts(), " experts, router has ", E);
  ORIGAMI_CHECK(w.experts.num_experts() == disp.num_local_experts(), "moe layer holds ", w.experts.num_experts(),
                " experts, this rank owns ", disp.num_local_experts(), " of ", E);
  ORIGAMI_CHECK(!opt.capacity.pad_to_capacity || opt.capacity.capacity_factor.has_value(),
                "pad_to_capacity needs a capacity_factor");

  // Route: p and the selected experts, [T, k] each; aux and z losses.
  saved.routing = router_forward(ctx, opt.router, x_TD, w.gate_ED, w.bias_E, seq_len, saved.router, reduce);
  const Routing& r = saved.routing;

  // Capacity and drop; C < 0 means dropless, where an undefined mask keeps
  // every slot.
  const int64_t C = expert_capacity(opt.capacity, T, k, E);
  const Tensor kept_TK = C < 0 ? Tensor() : apply_capacity(ctx, opt.capacity, r.expert_TK, r.weight_TK, E, C);
  saved.perm = make_permutation(ctx, r.expert_TK, kept_TK, E, C, opt.capacity.pad_to_capacity);
  stats.routed_per_expert = saved.perm.routed_per_expert;
  stats.kept_per_expert = saved.perm.kept_per_expert;
  stats.tokens_per_ep_rank = per_ep_rank(stats.kept_per_expert, disp.placement());
  // The counts' read above waited for the stream past the router's totals.
  stats.losses = router_losses(opt.router, saved.router);

  // Permute → dispatch → this rank's experts → combine → un-permute weighted by p.
  const Tensor x_ND = permute_rows(ctx, x_TD, saved.perm);  // (N, D), grouped by global expert
  PendingDispatch pending = disp.dispatch_start(x_ND, saved.perm.rows_per_expert);
  // The shared expert sees every token, unweighted; it needs no routed row,
  // so it runs while they are on the wire (Megatron's shared-expert overlap).
  Tensor y_shared;
  if (w.has_shared()) y_shared = experts_forward(ctx, w.shared, x_TD, ExpertSegments{{0, T}}, saved.shared);  // (T, D)
  Dispatched d = disp.dispatch_finish(std::move(pending));
  saved.dispatch = std::move(d.handle);
  const Tensor y_MD = experts_forward(ctx, w.experts, d.x_MD, saved.dispatch.segments, saved.experts);  // (M, D)
  saved.expert_out_ND = disp.combine(saved.dispatch, y_MD);                                        // (N, D)
  Tensor y_TD = unpermute_rows(ctx, saved.expert_out_ND, saved.perm, r.weight_TK, T);              // (T, D)
  if (w.has_shared()) add_inplace(ctx, y_TD, y_shared);
  if (opt.recompute_experts) {
    for (ExpertsSaved* e : {&saved.experts, &saved.shared}) e->gate_NF = e->up_NF = e->h_NF = Tensor();
  }
  return y_TD;
}

Tensor moe_layer_backward(const ExecContext& ctx, const MoeLayerOptions& opt, const MoeLayerWeights& w,
                          const MoeLayerSaved& saved, const Tensor& dy_TD, float aux_scale, MoeLayerWeights& grad,
                          const AllToAllDispatcher* dispatcher, WeightGradQueue* defer) {
  const AllToAllDispatcher local(ctx, opt.router.num_experts, nullptr, nullptr);
  const AllToAllDispatcher& disp = dispatcher ? *dispatcher : local;
  const Permutation& perm = saved.perm;
  const int64_t T = saved.routing.weight_TK.size(0), D = w.gate_ED.size(1);
  check_shape(dy_TD, {T, D}, "moe dy_TD");

  // Combine backward: dy per permuted row (p-weighted) and dL/dp per slot,
  // both allocated by the call.
  Tensor dy_ND, dweight_TK;  // (N, D), (T, k)
  unpermute_rows_backward(ctx, dy_TD, saved.expert_out_ND, perm, saved.routing.weight_TK, dy_ND, dweight_TK);

  // Back to the experts' owners, through the experts, home again; then
  // scatter-add each row's dx onto its token. The shared expert's backward
  // runs while the row gradients travel; its dx starts the accumulator
  // (zeros otherwise).
  PendingExchange to_owners = disp.combine_backward_start(saved.dispatch, dy_ND);
  Tensor dx_TD = w.has_shared()
                     ? experts_backward(ctx, w.shared, rebuilt(ctx, w.shared, saved.shared), dy_TD, grad.shared, defer)
                     : ctx.zeros({T, D}, ctx.data_dtype(), MemCategory::activation);
  const Tensor dy_MD = disp.finish(saved.dispatch, std::move(to_owners));                  // (M, D)
  const Tensor dx_MD = experts_backward(ctx, w.experts, rebuilt(ctx, w.experts, saved.experts), dy_MD, grad.experts,
                                        defer);  // (M, D)
  const Tensor dx_ND = disp.dispatch_backward(saved.dispatch, dx_MD);                    // (N, D)
  permute_rows_backward(ctx, dx_ND, perm, dx_TD);

  // Router: through p (dweight) and the aux/z losses, scaled by aux_scale.
  const Tensor dx_router =
      router_backward(ctx, opt.router, saved.router, w.gate_ED, dweight_TK, aux_scale, grad.gate_ED, defer);
  add_inplace(ctx, dx_TD, dx_router);
  return dx_TD;
}

}  // namespace origami::moe
