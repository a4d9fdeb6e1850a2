// MoE layer: route → capacity → permute (local, by global expert) →
// dispatch → grouped experts (this rank's experts) → combine → un-permute
// weighted by p (+ shared expert). Routing, capacity and the permutation are
// always over the rank's local tokens; the dispatcher moves rows to the
// experts' owners and back (identity on one rank), so the math is the same on
// every layout.
#pragma once
#include <vector>

#include "moe/permutation.h"
#include "moe/experts.h"
#include "moe/router.h"
#include "moe/token_dispatcher.h"

namespace origami::moe {

struct MoeLayerOptions {
  RouterOptions router;
  CapacityOptions capacity;
  // Keep only the experts' inputs; backward re-runs the grouped SwiGLU
  // forward (no communication) to rebuild its [rows, F] activations.
  bool recompute_experts = false;
};

struct MoeLayerWeights {
  Tensor gate_ED;         // router [E, D]
  Tensor bias_E;          // expert bias (state, no gradient) or undefined
  ExpertWeights experts;  // [E, ...]
  ExpertWeights shared;   // one expert over all tokens, or undefined tensors
  bool has_shared() const { return shared.w1_EFD.defined(); }
};

struct MoeLayerSaved {
  RouterSaved router;
  Routing routing;
  Permutation perm;
  DispatchHandle dispatch;
  ExpertsSaved experts;
  Tensor expert_out_ND;  // expert outputs back in the permuted layout, needed for dweight
  ExpertsSaved shared;
};

struct MoeLayerStats {
  std::vector<int64_t> routed_per_expert;  // before dropping
  std::vector<int64_t> kept_per_expert;
  std::vector<int64_t> tokens_per_ep_rank;  // [EP] kept (non-padding) rows sent to each EP rank (its placed experts)
  RouterLosses losses;
};

// x_TD [T, D], T = B·seq_len. w.experts holds this rank's experts
// (dispatcher->local_experts() in that order, F-sliced under ETP); w.gate_ED all E.
// dispatcher null: one rank (all experts local). Returns y_TD.
Tensor moe_layer_forward(const ExecContext& ctx, const MoeLayerOptions& opt, const MoeLayerWeights& w,
                         const Tensor& x_TD, int64_t seq_len, MoeLayerSaved& saved, MoeLayerStats& stats,
                         const StatsReducer& reduce = nullptr, const AllToAllDispatcher* dispatcher = nullptr);
// Returns dx_TD; accumulates into grad (gate_ED, experts, shared). The same
// dispatcher as forward. With defer (kernels/deferred.h) dx only now — every
// exchange included, in forward's order — and the router's, experts' and
// shared expert's weight gradients pushed (see their backwards for what each
// keeps; under recompute_experts, the rebuilt activations); `grad` is the
// binding they land in: gate_ED and shared in the layer's dense unit, experts
// in its expert unit.
Tensor moe_layer_backward(const ExecContext& ctx, const MoeLayerOptions& opt, const MoeLayerWeights& w,
                          const MoeLayerSaved& saved, const Tensor& dy_TD, float aux_scale, MoeLayerWeights& grad,
                          const AllToAllDispatcher* dispatcher = nullptr, WeightGradQueue* defer = nullptr);

}  // namespace origami::moe
