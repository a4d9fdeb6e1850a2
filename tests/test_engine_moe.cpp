// A model mixing dense and MoE layers: finite differences through every
// parameter (LM loss plus aux and z losses), the expert-bias update, and the
// export/import round trip with Mixtral names and the DeepSeek config fields.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "engine/export.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "grad_check.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 29;
  m.hidden_size = 16;
  m.num_layers = 3;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.ffn_hidden_size = 24;
  m.init_std = 0.3;
  return m;
}

MoeConfig tiny_moe() {
  MoeConfig m;
  m.router.num_experts = 4;
  m.router.top_k = 2;
  m.ffn_hidden_size = 12;
  m.first_dense_layers = 1;
  m.layer_freq = 1;
  m.shared_expert_hidden_size = 8;
  m.router.aux_loss_coeff = 0.1;
  m.router.z_loss_coeff = 0.01;
  return m;
}

TEST(MoeModel, LayerPatternAndNames) {
  Model model(ctx, tiny_model(), 1, tiny_moe());
  EXPECT_NO_THROW(model.params().param("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_NO_THROW(model.params().param("model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_NO_THROW(model.params().param("model.layers.2.block_sparse_moe.experts.3.w2.weight"));
  EXPECT_NO_THROW(model.params().param("model.layers.2.block_sparse_moe.shared_expert.down_proj.weight"));
  EXPECT_EQ(model.params().param("model.layers.1.block_sparse_moe.experts.0.w1.weight").shape(), (Shape{12, 16}));
}

TEST(MoeModel, FiniteDifferenceThroughEveryParameterWithAuxAndZLoss) {
  std::mt19937 rng(testing::test_seed(31));
  // top_k = E: every expert is selected, so no perturbation anywhere upstream
  // can flip a routing decision (a discontinuity finite differences cannot
  // see through). Selection with top_k < E and dropping is checked at the
  // layer level in test_moe_layer, where the router input is controlled.
  MoeConfig moe = tiny_moe();
  moe.router.top_k = moe.router.num_experts;
  Model model(ctx, tiny_model(), 3, moe);
  Tensor tokens = testing::random_tokens(2, 9, 29, rng);
  const float lm_scale = 1.0f / 16.0f, aux_scale = 0.5f;
  // Objective = lm_scale·Σ loss + aux_scale·Σ_layers (aux + z).
  auto objective = [&] {
    ModelSaved saved;
    ForwardStats stats;
    const double lm = model.forward(tokens, saved, &stats);
    return lm_scale * lm + aux_scale * (stats.aux_loss() + stats.z_loss());
  };
  model.params().zero_grads(ctx);
  ModelSaved saved;
  ForwardStats stats;
  model.forward(tokens, saved, &stats);
  EXPECT_GT(stats.aux_loss(), 0.0);
  EXPECT_GT(stats.z_loss(), 0.0);
  model.backward(saved, lm_scale, aux_scale);
  for (ParamUnit& u : model.params().units())
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor p = u.param_view(i), g = u.grad_view(i);
      // The default h = 1e-3 and the measured noise (grad_check.h) cover the
      // small expert-weight derivatives (~2e-4 for an expert few tokens
      // reach), retrying at 4h where the noise would dominate them.
      testing::expect_directional_grad(u.params[i].name.c_str(), p, g, rng, objective);
    }
}

TEST(MoeModel, ExpertBiasMovesTowardTheMeanLoad) {
  MoeConfig moe = tiny_moe();
  moe.expert_bias = true;
  moe.bias_update_rate = 0.25;
  Model model(ctx, tiny_model(), 1, moe);
  MoeLayerRecord r;
  r.layer = 1;
  r.routed_per_expert = {10, 2, 6, 6};  // mean 6
  r.kept_per_expert = r.routed_per_expert;
  model.update_expert_bias({r});
  const float* b = model.expert_bias()[1].f32();
  EXPECT_FLOAT_EQ(b[0], -0.25f);  // overloaded: less attractive
  EXPECT_FLOAT_EQ(b[1], 0.25f);   // underloaded: more attractive
  EXPECT_FLOAT_EQ(b[2], 0.0f);    // at the mean: unchanged
  EXPECT_FLOAT_EQ(model.expert_bias()[2].f32()[0], 0.0f);  // other layer untouched
}

TEST(MoeModel, ExportRoundTripWithBiasAndConfigFields) {
  testing::ScratchDir dir("moe-export");
  MoeConfig moe = tiny_moe();
  moe.expert_bias = true;
  moe.router.score_function = moe::ScoreFunction::sigmoid;
  moe.router.normalize_topk = true;
  moe.router.topk_scaling = 2.5;
  Model a(ctx, tiny_model(), 5, moe), b(ctx, tiny_model(), 6, moe);
  MoeLayerRecord r{2, {1, 9, 3, 3}, {1, 9, 3, 3}, {16}, 0, 0};
  a.update_expert_bias({r});
  export_hf(a, dir.str());
  load_hf_weights(b, dir.str());
  EXPECT_EQ(b.expert_bias()[2].f32()[1], a.expert_bias()[2].f32()[1]);
  EXPECT_NE(b.expert_bias()[2].f32()[1], 0.0f);
  for (size_t u = 0; u < a.params().units().size(); ++u) {
    const Tensor& pa = a.params().units()[u].param;
    const Tensor& pb = b.params().units()[u].param;
    for (int64_t i = 0; i < pa.numel(); ++i) ASSERT_EQ(pa.f32()[i], pb.f32()[i]);
  }
  auto tensors = read_safetensors(dir / "model.safetensors");
  EXPECT_EQ(tensors.at("model.layers.2.block_sparse_moe.expert_bias").shape(), (Shape{4}));
  EXPECT_EQ(tensors.at("model.layers.1.block_sparse_moe.experts.2.w3.weight").shape(), (Shape{12, 16}));
  auto cfg = nlohmann::json::parse(testing::read_file(dir / "config.json"));
  EXPECT_EQ(cfg["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(cfg["num_local_experts"], 4);
  EXPECT_EQ(cfg["num_experts_per_tok"], 2);
  EXPECT_EQ(cfg["moe_intermediate_size"], 12);
  EXPECT_EQ(cfg["scoring_func"], "sigmoid");
  EXPECT_EQ(cfg["norm_topk_prob"], true);
  EXPECT_EQ(cfg["routed_scaling_factor"], 2.5);
  EXPECT_EQ(cfg["first_k_dense_replace"], 1);
  EXPECT_EQ(cfg["moe_layer_freq"], 1);
  EXPECT_EQ(cfg["n_group"], 1);
  EXPECT_EQ(cfg["topk_group"], 1);
  EXPECT_EQ(cfg["shared_expert_intermediate_size"], 8);
}

TEST(MoeModel, FlopsCountOnlyActiveExperts) {
  Model model(ctx, tiny_model(), 1, tiny_moe());
  // Per MoE layer: router E·D + top_k experts + shared expert.
  const int64_t D = 16, attn = D * 8 * (2 * 2 + 2 * 1);
  const int64_t expected = 29 * D + 3 * attn + 3 * D * 24 + 2 * (4 * D + 2 * 3 * D * 12 + 3 * D * 8);
  EXPECT_EQ(model.active_matmul_params(), expected);
}

}  // namespace
}  // namespace origami
