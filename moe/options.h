// MoE option structs (ARCHITECTURE.md §4): one definition from the config
// file to the kernels. engine/config.h holds a RouterOptions and a
// CapacityOptions that the parser fills and validates once; the MoE layer
// takes them as they are, and the router hands its RouterOptions to the
// kernels as their MoeTopkParams (its base). No module reads the config file.
#pragma once
#include <cstdint>
#include <optional>

#include "kernels/moe_ops.h"

namespace origami::moe {

using ScoreFunction = MoeScore;  // "softmax" | "sigmoid"
using DropPolicy = MoeDrop;      // "probs" | "position"
enum class LoadBalancing { none, aux_loss, seq_aux_loss, global_aux_loss };

// Selection and weights (MoeTopkParams: score_function, top_k, num_groups,
// group_topk, normalize_topk, topk_scaling) plus the losses. Group-limited
// routing when num_groups > 1: experts split into num_groups contiguous
// groups of E / num_groups; a group's score is the sum of its top
// (top_k / group_topk) selection scores (Megatron); only the best group_topk
// groups may be selected.
// The coefficients are kept as configured (double, so exports and messages
// show the file's values) and enter the math as fp32, through the *_f32()
// accessors: the one place each is rounded.
struct RouterOptions : MoeTopkParams {
  int64_t num_experts = 0;
  LoadBalancing load_balancing = LoadBalancing::aux_loss;
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;

  float aux_loss_coeff_f32() const { return static_cast<float>(aux_loss_coeff); }
  float z_loss_coeff_f32() const { return static_cast<float>(z_loss_coeff); }
  // Whether each loss is computed (and its statistics reduced): a function
  // of the options only, so every rank of a group agrees.
  bool aux_active() const { return load_balancing != LoadBalancing::none && aux_loss_coeff_f32() != 0.0f; }
  bool z_active() const { return z_loss_coeff_f32() != 0.0f; }
};

struct CapacityOptions {
  std::optional<double> capacity_factor;  // absent: dropless
  DropPolicy drop_policy = DropPolicy::probs;
  bool pad_to_capacity = false;  // every expert gets exactly C rows (needs capacity_factor)
};

}  // namespace origami::moe
