// MoE option structs (ARCHITECTURE.md §4), validated at config load; no module
// reads the config file.
#pragma once
#include <cstdint>
#include <optional>

namespace origami::moe {

enum class ScoreFunction { softmax, sigmoid };
enum class LoadBalancing { none, aux_loss, seq_aux_loss, global_aux_loss };
enum class DropPolicy { probs, position };

struct RouterOptions {
  int64_t num_experts = 0;
  int64_t top_k = 2;
  ScoreFunction score_function = ScoreFunction::softmax;
  bool normalize_topk = false;  // p /= Σ p over the selected experts
  float topk_scaling = 1.0f;    // then p *= topk_scaling
  // Group-limited routing when num_groups > 1: experts split into num_groups
  // contiguous groups of E / num_groups; a group's score is the sum of its
  // top (top_k / group_topk) selection scores (Megatron); only the best
  // group_topk groups may be selected.
  int64_t num_groups = 1;
  int64_t group_topk = 1;
  LoadBalancing load_balancing = LoadBalancing::aux_loss;
  float aux_loss_coeff = 0.0f;
  float z_loss_coeff = 0.0f;
};

struct CapacityOptions {
  std::optional<double> capacity_factor;  // absent: dropless
  DropPolicy drop_policy = DropPolicy::probs;
  bool pad_to_capacity = false;  // every expert gets exactly C rows (needs capacity_factor)
};

}  // namespace origami::moe
