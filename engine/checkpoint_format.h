// The names a checkpoint's files and keys use, shared by the writer
// (checkpoint.cpp) and the reader (checkpoint_read.cpp) so they cannot
// drift apart. Internal to engine/.
#pragma once
#include <cstdio>
#include <map>
#include <string>

#include "engine/config.h"
#include "engine/units.h"

namespace origami::checkpoint_format {

constexpr int kFormatVersion = 1;
constexpr const char* kFormat = "origami-checkpoint";

inline std::string rank_file(int rank, bool optim) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-%s.safetensors", rank, optim ? "optim" : "model");
  return buf;
}

inline std::string moment_key(const std::string& name, const std::string& moment) {
  return moment.empty() ? name : name + "." + moment;
}

// The config keys that fix the model's tensors, with their values.
inline std::map<std::string, int64_t> shape_keys(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  return {{"model.vocab_size", m.vocab_size},
          {"model.hidden_size", m.hidden_size},
          {"model.num_layers", m.num_layers},
          {"model.num_heads", m.num_heads},
          {"model.num_kv_heads", m.num_kv_heads},
          {"model.ffn_hidden_size", m.ffn_hidden_size},
          {"moe.num_experts", e.router.num_experts},
          {"moe.ffn_hidden_size", e.router.num_experts > 0 ? e.expert_ffn(m.ffn_hidden_size) : 0},
          {"moe.first_dense_layers", e.first_dense_layers},
          {"moe.layer_freq", e.layer_freq},
          {"moe.shared_expert_hidden_size", e.shared_expert_hidden_size},
          {"moe.expert_bias", e.expert_bias ? 1 : 0}};
}

// The unit table's index of each unit by name.
inline std::map<std::string, size_t> unit_index(const UnitTable& table) {
  std::map<std::string, size_t> out;
  for (size_t u = 0; u < table.units().size(); ++u) out[table.units()[u].name] = u;
  return out;
}

}  // namespace origami::checkpoint_format
