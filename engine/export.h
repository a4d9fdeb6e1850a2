// Hugging Face export: model.safetensors with §4 names ([out, in] weights,
// __metadata__ {"format": "pt"}) and a config.json. A model without MoE layers
// exports as LlamaForCausalLM (Mixtral's dense names and math); a MoE model as
// MixtralForCausalLM, with DeepSeek's config names for what Mixtral lacks
// (scoring_func, norm_topk_prob, routed_scaling_factor, first_k_dense_replace,
// moe_layer_freq, n_group, topk_group, shared_expert_intermediate_size) and
// the expert bias as model.layers.{l}.block_sparse_moe.expert_bias.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"

namespace origami {

// With `groups` and experts, tensor-parallel slices or pipeline stages spread
// over ranks, a collective (Model::gather_experts; tp slices over each stage
// root's tp group; stage roots send to world rank 0 over its pp group): world
// rank 0 writes the consolidated model, the other ranks write nothing. Without groups: this rank's model as it is.
void export_hf(const Model& model, const std::string& dir, const comm::Groups* groups = nullptr);
// The order of tensors in an exported file, whatever layout wrote it:
// the unit table's order, then each MoE layer's expert bias (when enabled).
// Exports of one model from any layout (or from a checkpoint) are then
// byte-identical files.
std::vector<std::string> export_tensor_order(const UnitTable& table, const ModelConfig& model, const MoeConfig& moe);

// Loads exported weights into `model` (names and shapes must match exactly,
// every value finite; UserError naming the file and tensor otherwise).
void load_hf_weights(Model& model, const std::string& dir);

// The config.json written beside the weights.
nlohmann::ordered_json hf_config(const ModelConfig& model, const MoeConfig& moe);
// Every key of dir/config.json that changes the forward pass agrees with
// `cfg` (its file and --set overrides): UserError naming the config key,
// where it came from and the file's value otherwise, or when config.json is
// missing or not an exported config.
void check_config_matches_export(const Config& cfg, const std::string& dir);
// The same comparison, every key that differs, one line each ("c.toml:
// model.norm_eps gives \"rms_norm_eps\": 1e-05, but DIR/config.json has
// 1e-06"); with `present_only`, only keys config.json has (a published
// Mixtral's lacks the DeepSeek-style keys an Origami export writes).
// UserError only for a config.json missing or not an object.
std::vector<std::string> config_differences(const Config& cfg, const std::string& dir, bool present_only);

}  // namespace origami
