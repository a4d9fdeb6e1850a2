// Hugging Face export and import (see export.h).
#include "engine/export.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/safetensors.h"

namespace origami {

void export_hf(const Model& model, const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::vector<NamedTensor> tensors;
  for (const ParamUnit& u : model.params().units())
    for (size_t i = 0; i < u.params.size(); ++i) tensors.push_back({u.params[i].name, u.param_view(i)});
  write_safetensors(dir + "/model.safetensors", tensors);

  const ModelConfig& c = model.config();
  nlohmann::ordered_json cfg = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.ffn_hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim()},
      {"hidden_act", "silu"},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"max_position_embeddings", 4096},
      {"tie_word_embeddings", false},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"initializer_range", c.init_std},
      {"torch_dtype", "float32"},
  };
  std::ofstream out(dir + "/config.json");
  out << cfg.dump(2) << "\n";
  if (!out) ORIGAMI_USER_ERROR(dir, "/config.json: write failed");
}

void load_hf_weights(Model& model, const std::string& dir) {
  const std::string path = dir + "/model.safetensors";
  auto tensors = read_safetensors(path);
  for (ParamUnit& u : model.params().units()) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      const ParamInfo& p = u.params[i];
      auto it = tensors.find(p.name);
      if (it == tensors.end()) ORIGAMI_USER_ERROR(path, ": missing tensor '", p.name, "'");
      if (it->second.shape() != p.shape)
        ORIGAMI_USER_ERROR(path, ": tensor '", p.name, "' has shape ", shape_string(it->second.shape()),
                           ", the config needs ", shape_string(p.shape));
      Tensor dst = u.param_view(i);
      dst.copy_from(it->second);
      tensors.erase(it);
    }
  }
  if (!tensors.empty())
    ORIGAMI_USER_ERROR(path, ": unexpected tensor '", tensors.begin()->first, "' for this model config");
}

}  // namespace origami
