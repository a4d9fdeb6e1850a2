// MoE layer on one rank (see moe_layer.h): a plain call sequence over the
// router, capacity, permutation and grouped experts. Backward replays it in
// reverse; the router's backward receives the gradient w.r.t. the routing
// weights p (from the combine step) plus the aux/z-loss terms.
#include "moe/moe_layer.h"

#include "kernels/elementwise.h"

namespace origami::moe {

namespace {

// Slots that survived capacity, per expert: the permutation's non-padding
// rows, so the count is whatever make_permutation actually placed.
std::vector<int64_t> count_kept(const Permutation& perm) {
  std::vector<int64_t> kept(perm.num_experts, 0);
  const int32_t* token = perm.row_token_N.i32();
  int64_t row = 0;
  for (int64_t e = 0; e < perm.num_experts; ++e)
    for (int64_t end = row + perm.rows_per_expert[e]; row < end; ++row) kept[e] += token[row] >= 0;
  return kept;
}

}  // namespace

Tensor moe_layer_forward(const MoeLayerOptions& opt, const MoeLayerWeights& w, const Tensor& x_TD, int64_t seq_len,
                         MoeLayerSaved& saved, MoeLayerStats& stats, const StatsReducer& reduce) {
  const int64_t E = opt.router.num_experts, k = opt.router.top_k;
  ORIGAMI_CHECK(x_TD.dim() == 2, "moe_layer_forward: x_TD should be [T, D], got ", shape_string(x_TD.shape()));
  const int64_t T = x_TD.size(0), D = x_TD.size(1);
  check_shape(w.gate_ED, {E, D}, "moe gate_ED");
  ORIGAMI_CHECK(w.experts.num_experts() == E, "moe layer has ", w.experts.num_experts(), " experts, router expects ",
                E);
  ORIGAMI_CHECK(!opt.capacity.pad_to_capacity || opt.capacity.capacity_factor.has_value(),
                "pad_to_capacity needs a capacity_factor");

  // Route: p and the selected experts, [T, k] each; aux and z losses.
  saved.routing = router_forward(opt.router, x_TD, w.gate_ED, w.bias_E, seq_len, saved.router, stats.losses, reduce);
  const Routing& r = saved.routing;

  // Capacity and drop; C < 0 means dropless, where an undefined mask keeps
  // every slot.
  const int64_t C = expert_capacity(opt.capacity, T, k, E);
  const Tensor kept_TK = C < 0 ? Tensor() : apply_capacity(opt.capacity, r.expert_TK, r.weight_TK, E, C);
  saved.perm = make_permutation(r.expert_TK, kept_TK, E, C, opt.capacity.pad_to_capacity);
  stats.routed_per_expert = saved.perm.routed_per_expert;
  stats.kept_per_expert = count_kept(saved.perm);

  // Permute → grouped experts → combine weighted by p.
  const Tensor x_ND = permute_rows(x_TD, saved.perm);  // (N, D), grouped by expert
  saved.expert_out_ND = experts_forward(w.experts, x_ND, saved.perm.rows_per_expert, saved.experts);  // (N, D)
  Tensor y_TD = unpermute_rows(saved.expert_out_ND, saved.perm, r.weight_TK, T);                       // (T, D)

  // The shared expert sees every token, unweighted.
  if (w.has_shared()) {
    const Tensor y_shared = experts_forward(w.shared, x_TD, {T}, saved.shared);  // (T, D)
    add_inplace(y_TD, y_shared);
  }
  return y_TD;
}

Tensor moe_layer_backward(const MoeLayerOptions& opt, const MoeLayerWeights& w, const MoeLayerSaved& saved,
                          const Tensor& dy_TD, float aux_scale, MoeLayerWeights& grad) {
  const Permutation& perm = saved.perm;
  const int64_t T = saved.routing.weight_TK.size(0), D = w.gate_ED.size(1);
  check_shape(dy_TD, {T, D}, "moe dy_TD");

  // Shared expert first: its dx starts the accumulator (zeros otherwise).
  Tensor dx_TD = w.has_shared() ? experts_backward(w.shared, saved.shared, dy_TD, grad.shared)
                                : Tensor::zeros({T, D}, DType::f32, MemCategory::activation);

  // Combine backward: dy per permuted row (p-weighted) and dL/dp per slot,
  // both allocated by the call.
  Tensor dy_ND, dweight_TK;  // (N, D), (T, k)
  unpermute_rows_backward(dy_TD, saved.expert_out_ND, perm, saved.routing.weight_TK, dy_ND, dweight_TK);

  // Experts, then scatter-add each row's dx back onto its token.
  const Tensor dx_ND = experts_backward(w.experts, saved.experts, dy_ND, grad.experts);  // (N, D)
  permute_rows_backward(dx_ND, perm, dx_TD);

  // Router: through p (dweight) and the aux/z losses, scaled by aux_scale.
  const Tensor dx_router = router_backward(opt.router, saved.router, w.gate_ED, dweight_TK, aux_scale, grad.gate_ED);
  add_inplace(dx_TD, dx_router);
  return dx_TD;
}

}  // namespace origami::moe
