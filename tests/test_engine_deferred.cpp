// The model's split backward on one rank (engine/model.h WeightPass): for a
// model of dense and MoE layers with a shared expert, aux and z losses, and
// each recompute mode, two micro-batches run as B, B, then W, W (the
// zero-bubble order) accumulate bitwise the gradients of the fused backward
// run micro-batch by micro-batch, while B alone leaves every gradient
// untouched. The hooks see B with WeightGrads::deferred and W open the same
// units in the same order, and an emptied pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <tuple>

#include "deferred_check.h"
#include "engine/model.h"
#include "grad_check.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

ModelConfig model_config() {
  ModelConfig m;
  m.vocab_size = 37;
  m.hidden_size = 32;
  m.num_layers = 3;  // dense, MoE, MoE
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden_size = 48;
  m.init_std = 0.2;
  return m;
}

MoeConfig moe_config() {
  MoeConfig e;
  e.router.num_experts = 4;
  e.router.top_k = 2;
  e.router.aux_loss_coeff = 0.01;
  e.router.z_loss_coeff = 0.001;
  e.ffn_hidden_size = 16;
  e.first_dense_layers = 1;
  e.shared_expert_hidden_size = 24;
  return e;
}

bool all_zero(const Tensor& t) {
  return std::all_of(t.f32(), t.f32() + t.numel(), [](float v) { return v == 0.0f; });
}

// Records every hook call: (what, unit, deferred).
struct Recorder final : UnitHooks {
  std::vector<std::tuple<std::string, size_t, bool>> calls;
  void before_forward(size_t u) override { calls.emplace_back("before_forward", u, false); }
  void after_forward(size_t u) override { calls.emplace_back("after_forward", u, false); }
  void before_backward(size_t u, WeightGrads g) override {
    calls.emplace_back("before_backward", u, g == WeightGrads::deferred);
  }
  void after_backward(size_t u, WeightGrads g) override {
    calls.emplace_back("after_backward", u, g == WeightGrads::deferred);
  }
  void before_weight(size_t u) override { calls.emplace_back("before_weight", u, true); }
  void after_weight(size_t u) override { calls.emplace_back("after_weight", u, true); }
  std::vector<size_t> units_of(const std::string& what) const {
    std::vector<size_t> out;
    for (const auto& [w, u, d] : calls)
      if (w == what) out.push_back(u);
    return out;
  }
};

TEST(ModelDeferred, BThenWIsBitwiseTheFusedBackwardInEveryRecomputeMode) {
  for (Recompute mode : {Recompute::none, Recompute::moe, Recompute::full}) {
    SCOPED_TRACE("recompute " + std::to_string(static_cast<int>(mode)));
    Model fused(ctx, model_config(), 5, moe_config()), split(ctx, model_config(), 5, moe_config());
    fused.set_recompute(mode);
    split.set_recompute(mode);
    std::mt19937 rng(testing::test_seed(17 + static_cast<uint32_t>(mode)));
    const Tensor mb[2] = {testing::random_tokens(2, 13, 37, rng), testing::random_tokens(2, 13, 37, rng)};
    const float lm_scale = 1.0f / 48, aux_scale = 0.5f;
    fused.params().zero_grads(ctx);
    split.params().zero_grads(ctx);
    for (const Tensor& tokens : mb) {
      ModelSaved saved;
      fused.forward(tokens, saved);
      fused.backward(saved, lm_scale, aux_scale);
    }
    WeightPass pass[2];
    for (int i = 0; i < 2; ++i) {
      ModelSaved saved;
      split.forward(mb[i], saved);
      StageGradIO io;
      io.lm_grad_scale = lm_scale;
      io.aux_scale = aux_scale;
      io.defer = &pass[i];
      split.backward(io, saved);
      EXPECT_FALSE(pass[i].empty());
    }
    for (const ParamUnit& u : split.params().units()) EXPECT_TRUE(all_zero(u.grad)) << u.name << ": B wrote it";
    for (WeightPass& p : pass) {
      split.weight_backward(p, nullptr);
      EXPECT_TRUE(p.empty());
    }
    for (size_t u = 0; u < fused.params().units().size(); ++u) {
      const ParamUnit& a = fused.params().units()[u];
      EXPECT_FALSE(all_zero(a.grad)) << a.name;
      EXPECT_TRUE(testing::bitwise_equal(split.params().units()[u].grad, a.grad)) << a.name;
    }
  }
}

TEST(ModelDeferred, HooksSeeADeferredBackwardAndAWeightPassOverTheSameUnits) {
  Model model(ctx, model_config(), 5, moe_config());
  std::mt19937 rng(testing::test_seed(3));
  const Tensor tokens = testing::random_tokens(2, 9, 37, rng);
  Recorder hooks;
  ModelSaved saved;
  StageIO io;
  io.tokens_BS1 = tokens;
  io.hooks = &hooks;
  model.forward(io, saved);
  WeightPass pass;
  StageGradIO gio;
  gio.hooks = &hooks;
  gio.defer = &pass;
  model.backward(gio, saved);
  for (const auto& [what, unit, deferred] : hooks.calls) {
    if (what.find("backward") != std::string::npos) {
      EXPECT_TRUE(deferred) << what << " " << unit;
    }
  }
  const std::vector<size_t> b_order = hooks.units_of("before_backward");
  EXPECT_EQ(b_order.size(), model.params().units().size());  // 3 layers + 2 expert units + embedding + final
  EXPECT_EQ(pass.units(), b_order);
  EXPECT_TRUE(hooks.units_of("before_weight").empty());
  model.weight_backward(pass, &hooks);
  EXPECT_EQ(hooks.units_of("before_weight"), b_order);
  EXPECT_EQ(hooks.units_of("after_weight"), hooks.units_of("after_backward"));
  EXPECT_TRUE(pass.empty());
}

}  // namespace
}  // namespace origami
