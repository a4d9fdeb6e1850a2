// MoE layer on one rank: route → capacity → permute → grouped experts →
// un-permute weighted by p (+ shared expert). Only these steps; the
// expert-parallel dispatcher later replaces permute/un-permute with the
// exchange while keeping this math exactly.
#pragma once
#include <vector>

#include "moe/dispatch.h"
#include "moe/experts.h"
#include "moe/router.h"

namespace origami::moe {

struct MoeLayerOptions {
  RouterOptions router;
  CapacityOptions capacity;
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
  ExpertsSaved experts;
  Tensor expert_out_ND;  // expert outputs, needed for dweight
  ExpertsSaved shared;
};

struct MoeLayerStats {
  std::vector<int64_t> routed_per_expert;  // before dropping
  std::vector<int64_t> kept_per_expert;
  RouterLosses losses;
};

// x_TD [T, D], T = B·seq_len. Returns y_TD.
Tensor moe_layer_forward(const MoeLayerOptions& opt, const MoeLayerWeights& w, const Tensor& x_TD, int64_t seq_len,
                         MoeLayerSaved& saved, MoeLayerStats& stats, const StatsReducer& reduce = nullptr);
// Returns dx_TD; accumulates into grad (gate_ED, experts, shared).
Tensor moe_layer_backward(const MoeLayerOptions& opt, const MoeLayerWeights& w, const MoeLayerSaved& saved,
                          const Tensor& dy_TD, float aux_scale, MoeLayerWeights& grad);

}  // namespace origami::moe
