// Router (fp32, ARCHITECTURE.md §4): logits z = x·Wrᵀ, scores s = softmax(z)
// or σ(z); top-k by s + b (b = expert bias, selection only; ties go to the
// lower expert index); weights p = s at the selected experts, optionally
// normalized, then scaled. Load-balancing aux loss (aux_loss, seq_aux_loss,
// global_aux_loss) and z-loss, with gradients through the gate weights.
#pragma once
#include <functional>
#include <vector>

#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"
#include "moe/options.h"

namespace origami::moe {

// Sums statistics over the group the loss is defined on (tp-cp for aux_loss,
// tp-dp-cp for global_aux_loss). Identity on one rank.
// router_forward calls it at most once, with one f64 tensor of n = 2·S·E + 2
// elements (moe_routing_stats in kernels/moe_ops.h): [routed counts (S·E) |
// score sums Σ_t s'_te (S·E) | token count | Σ_t lse_t²], S = 1, or
// sequences per micro-batch for seq_aux_loss, and S·E = 0 when no aux loss
// is active. It is called iff an aux loss is active (load_balancing != none
// and aux_loss_coeff != 0) or z_loss_coeff != 0: a function of the options
// only, so every rank of the group calls it. The z-loss is thus the group's
// mean too (ARCHITECTURE.md §6), which is what Megatron's z_coeff / (tp·cp)
// amounts to.
using StatsReducer = std::function<void(const Tensor& stats_N)>;

struct Routing {
  Tensor expert_TK;  // i32 [T, k]: selected experts, in descending order of s + b
  Tensor weight_TK;  // f32 [T, k]: p (after normalization and scaling)
};

struct RouterLosses {
  double aux_loss = 0;  // includes aux_loss_coeff
  double z_loss = 0;    // includes z_loss_coeff
};

struct RouterSaved {
  Tensor x_TD;       // router input
  Tensor logits_TE;  // z
  Tensor scores_TE;  // s
  Tensor expert_TK;  // selection
  int64_t seq_len = 0;
  // Aux-loss statistics as used in forward (after any reduction), kept for
  // the gradient when an aux loss is active: the reduced statistics buffer
  // (its routed counts per expert, per sequence for seq_aux_loss) over
  // aux_segments segments. aux_tokens (the token count they are over) is
  // also the token count of the z-loss mean; router_losses sets it.
  Tensor stats_N;  // f64 [2·S·E + 2] or undefined
  int64_t aux_segments = 0;
  double aux_tokens = 0;
  // The statistics' totals (MoeRoutingTotals, kernels/moe_ops.h) on their way
  // to the host; defined iff an aux or z loss is active.
  HostRead totals;
};

// x_TD [T, D] with T = B·seq_len; gate_ED [E, D]; bias_E [E] or undefined.
// The loss values are not read here: router_losses takes them, which the
// caller does after its next host read of the stream (the MoE layer's, of
// the per-expert counts), so reading them costs no wait of its own.
Routing router_forward(const ExecContext& ctx, const RouterOptions& opt, const Tensor& x_TD, const Tensor& gate_ED,
                       const Tensor& bias_E, int64_t seq_len, RouterSaved& saved, const StatsReducer& reduce = nullptr);
// The aux and z losses of the forward that filled `saved` (zero when
// neither is active); sets saved.aux_tokens, which router_backward needs.
// Checks the statistics cover at least one token.
RouterLosses router_losses(const RouterOptions& opt, RouterSaved& saved);

// dweight_TK: gradient of the objective w.r.t. p. aux_scale: weight of the aux
// and z losses in the objective (1 / micro-batches per global batch).
// Returns dx_TD; accumulates dgate_ED. With defer (kernels/deferred.h) dx
// only now; dgate += dlogitsᵀ·x is pushed, keeping dlogits and x, and
// dgate_ED is the binding it lands in.
Tensor router_backward(const ExecContext& ctx, const RouterOptions& opt, const RouterSaved& saved,
                       const Tensor& gate_ED, const Tensor& dweight_TK, float aux_scale, Tensor& dgate_ED,
                       WeightGradQueue* defer = nullptr);

// Aux-loss-free balancing (DeepSeek-V3): b_e += rate · sign(mean(load) − load_e).
void update_expert_bias(const ExecContext& ctx, Tensor& bias_E, const std::vector<int64_t>& load_E, float rate);

}  // namespace origami::moe
