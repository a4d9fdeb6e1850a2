// Hugging Face export: model.safetensors with §4 names ([out, in] weights,
// __metadata__ {"format": "pt"}) and a config.json. A model without MoE layers
// exports as LlamaForCausalLM (Mixtral's dense names and math); MoE models
// export as MixtralForCausalLM once MoE lands.
#pragma once
#include <string>

#include "engine/model.h"

namespace origami {

void export_hf(const Model& model, const std::string& dir);
// Loads exported weights into `model` (names and shapes must match exactly).
void load_hf_weights(Model& model, const std::string& dir);

}  // namespace origami
