// Whole-model tests: a finite-difference check through every layer and the
// loss, gradient accumulation equivalence, layout-independent init, the LR
// schedule, clipping, and the safetensors round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "cli_util.h"
#include "engine/export.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/safetensors.h"
#include "grad_check.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 37;
  m.hidden_size = 32;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden_size = 48;
  m.init_std = 0.2;  // large enough that every term of the gradient matters
  return m;
}

TEST(Model, FiniteDifferenceThroughEveryParameter) {
  std::mt19937 rng(testing::test_seed(11));
  Model model(ctx, tiny_model(), 5);
  Tensor tokens = testing::random_tokens(2, 11, 37, rng);
  const float scale = 1.0f / 20.0f;  // mean over 2·10 tokens
  auto objective = [&] {
    ModelSaved saved;
    return scale * model.forward(tokens, saved);
  };
  model.params().zero_grads(ctx);
  ModelSaved saved;
  model.forward(tokens, saved);
  model.backward(saved, scale);
  for (ParamUnit& u : model.params().units())
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor p = u.param_view(i), g = u.grad_view(i);
      testing::expect_directional_grad(u.params[i].name.c_str(), p, g, rng, objective);
    }
}

TEST(Model, GradientAccumulationMatchesOneBigMicroBatch) {
  std::mt19937 rng(testing::test_seed(12));
  Model a(ctx, tiny_model(), 9), b(ctx, tiny_model(), 9);
  Tensor tokens = testing::random_tokens(4, 9, 37, rng);
  const float scale = 1.0f / 32.0f;
  a.params().zero_grads(ctx);
  b.params().zero_grads(ctx);
  ModelSaved s;
  const double la = a.forward(tokens, s);
  a.backward(s, scale);
  double lb = 0;
  for (int64_t half = 0; half < 2; ++half) {
    Tensor part = tokens.slice(half * 2, 2);
    ModelSaved sb;
    lb += b.forward(part, sb);
    b.backward(sb, scale);
  }
  EXPECT_NEAR(la, lb, 1e-5 * std::abs(la));  // fp32 sums of 32 token losses in another order
  for (size_t u = 0; u < a.params().units().size(); ++u) {
    const Tensor& ga = a.params().units()[u].grad;
    const Tensor& gb = b.params().units()[u].grad;
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < ga.numel(); ++i) {
      diff += std::pow(ga.f32()[i] - gb.f32()[i], 2);
      norm += std::pow(ga.f32()[i], 2);
    }
    EXPECT_GT(norm, 0.0);
    // Same math, different GEMM row counts: only fp32 rounding differs.
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << a.params().units()[u].name;
  }
}

TEST(Model, InitIsAPureFunctionOfSeedAndName) {
  Model a(ctx, tiny_model(), 3), b(ctx, tiny_model(), 3), c(ctx, tiny_model(), 4);
  const Tensor pa = a.params().param("model.layers.1.self_attn.k_proj.weight");
  const Tensor pb = b.params().param("model.layers.1.self_attn.k_proj.weight");
  const Tensor pc = c.params().param("model.layers.1.self_attn.k_proj.weight");
  int same_seed_diffs = 0, other_seed_diffs = 0;
  for (int64_t i = 0; i < pa.numel(); ++i) {
    same_seed_diffs += pa.f32()[i] != pb.f32()[i];
    other_seed_diffs += pa.f32()[i] != pc.f32()[i];
  }
  EXPECT_EQ(same_seed_diffs, 0);
  EXPECT_GT(other_seed_diffs, pa.numel() * 9 / 10);
  // Norms start at one; output projections are scaled by 1/sqrt(2L). At
  // L = 8 that is 0.25, apart from 1/L (0.125) and 1/sqrt(L) (0.354); each
  // rms is over 1,024 draws (2.2% standard error), so the ratio's is ~3%:
  // 0.008, and ±0.03 is ~4 of those.
  EXPECT_EQ(a.params().param("model.norm.weight").f32()[5], 1.0f);
  ModelConfig eight = tiny_model();
  eight.num_layers = 8;
  Model deep(ctx, eight, 3);
  auto rms = [](const Tensor& t) {
    double s = 0;
    for (int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(t.f32()[i]) * t.f32()[i];
    return std::sqrt(s / static_cast<double>(t.numel()));
  };
  const double q = rms(deep.params().param("model.layers.0.self_attn.q_proj.weight"));
  const double o = rms(deep.params().param("model.layers.0.self_attn.o_proj.weight"));
  EXPECT_NEAR(q, 0.2, 0.02);
  EXPECT_NEAR(o / q, 1.0 / std::sqrt(16.0), 0.03);
}

TEST(Optimizer, LearningRateScheduleWarmupThenCosine) {
  OptimizerConfig opt;
  opt.lr = 1.0;
  LrScheduleConfig s;
  s.warmup_steps = 10;
  s.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(opt, s, 110, 1), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(opt, s, 110, 10), 1.0);
  EXPECT_NEAR(learning_rate(opt, s, 110, 60), 0.1 + 0.9 * 0.5, 1e-12);  // halfway through the cosine
  EXPECT_NEAR(learning_rate(opt, s, 110, 110), 0.1, 1e-12);
  EXPECT_NEAR(learning_rate(opt, s, 110, 500), 0.1, 1e-12);  // clamped after the end
  s.warmup_steps = 0;
  EXPECT_NEAR(learning_rate(opt, s, 4, 1), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-12);
}

TEST(Optimizer, ClipsToTheGlobalNormAndDecaysOnlyMatrices) {
  ModelConfig cfg = tiny_model();
  cfg.num_layers = 1;
  Model model(ctx, cfg, 1);
  OptimizerConfig opt;
  opt.lr = 1e-2;
  opt.weight_decay = 0.5;
  opt.clip_grad = 0.5;
  LrScheduleConfig sched;
  sched.min_lr = opt.lr;  // constant LR
  std::mt19937 rng(testing::test_seed(2));
  for (ParamUnit& u : model.params().units()) testing::fill_normal(u.grad, rng);
  double expected_sq = 0;
  for (ParamUnit& u : model.params().units())
    for (int64_t i = 0; i < u.grad.numel(); ++i) expected_sq += std::pow(u.grad.f32()[i], 2);
  Tensor norm_w = model.params().param("model.norm.weight");
  std::vector<float> before(norm_w.f32(), norm_w.f32() + norm_w.numel());
  Tensor gnorm = model.params().grad("model.norm.weight");
  std::vector<float> g(gnorm.f32(), gnorm.f32() + gnorm.numel());
  Tensor q_w = model.params().param("model.layers.0.self_attn.q_proj.weight");
  std::vector<float> q_before(q_w.f32(), q_w.f32() + q_w.numel());
  Tensor q_grad = model.params().grad("model.layers.0.self_attn.q_proj.weight");
  std::vector<float> q_g(q_grad.f32(), q_grad.f32() + q_grad.numel());

  AdamW adamw(opt, sched, 10);
  StepStats st = adamw.step(ctx, model.params());
  // The norm sums squares in double: ~1e-15 off the double sum here, so
  // 1e-9. Clipping scales each fp32 gradient (one rounding, 6e-8): 1e-6.
  EXPECT_NEAR(st.grad_norm, std::sqrt(expected_sq), 1e-9 * std::sqrt(expected_sq));
  EXPECT_TRUE(st.clipped);
  double after_sq = 0;
  for (ParamUnit& u : model.params().units())
    for (int64_t i = 0; i < u.grad.numel(); ++i) after_sq += std::pow(u.grad.f32()[i], 2);
  EXPECT_NEAR(std::sqrt(after_sq), 0.5, 1e-6);
  // Norm weights: no decay, so the first (bias-corrected) Adam step moves
  // each by lr·ĝ/(|ĝ| + eps), ĝ the clipped gradient: lr·sign(g) unless a
  // fresh draw makes |ĝ| small enough for eps to count. 1e-6: fp32 rounding
  // of a weight near 1 (6e-8 per operation).
  const double clip_coef = opt.clip_grad / st.grad_norm;
  for (int64_t i = 0; i < norm_w.numel(); ++i) {
    const double clipped = g[i] * clip_coef;
    EXPECT_NEAR(norm_w.f32()[i], before[i] - opt.lr * clipped / (std::abs(clipped) + opt.eps), 1e-6) << i;
  }
  // Matrices decay (decoupled): p·(1 − lr·wd) − lr·ĝ/(|ĝ| + eps). Without
  // the decay each would be off by lr·wd·|p| ~ 1e-3 (p ~ 0.2), far past the
  // same 1e-6.
  for (int64_t i = 0; i < q_w.numel(); ++i) {
    const double clipped = q_g[i] * clip_coef;
    EXPECT_NEAR(q_w.f32()[i],
                q_before[i] * (1 - opt.lr * opt.weight_decay) - opt.lr * clipped / (std::abs(clipped) + opt.eps), 1e-6)
        << i;
  }
}

TEST(Export, SafetensorsRoundTripAndHfNames) {
  testing::ScratchDir dir("export");
  Model a(ctx, tiny_model(), 21), b(ctx, tiny_model(), 22);
  export_hf(a, dir.str());
  load_hf_weights(b, dir.str());
  for (size_t u = 0; u < a.params().units().size(); ++u) {
    const Tensor& pa = a.params().units()[u].param;
    const Tensor& pb = b.params().units()[u].param;
    for (int64_t i = 0; i < pa.numel(); ++i) ASSERT_EQ(pa.f32()[i], pb.f32()[i]);
  }
  auto tensors = read_safetensors(dir / "model.safetensors");
  EXPECT_EQ(tensors.at("model.layers.1.mlp.down_proj.weight").shape(), (Shape{32, 48}));
  EXPECT_EQ(tensors.at("model.layers.0.self_attn.k_proj.weight").shape(), (Shape{16, 32}));
  EXPECT_EQ(tensors.at("lm_head.weight").shape(), (Shape{37, 32}));
  const std::string raw = testing::read_file(dir / "model.safetensors");
  EXPECT_NE(raw.find("\"__metadata__\":{\"format\":\"pt\"}"), std::string::npos);
  const std::string cfg = testing::read_file(dir / "config.json");
  EXPECT_NE(cfg.find("\"num_key_value_heads\": 2"), std::string::npos) << cfg;
}

TEST(Export, LoadRejectsMismatchedShapes) {
  testing::ScratchDir dir("export-bad");
  Model a(ctx, tiny_model(), 1);
  export_hf(a, dir.str());
  ModelConfig other = tiny_model();
  other.ffn_hidden_size = 64;
  Model b(ctx, other, 1);
  try {
    load_hf_weights(b, dir.str());
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.gate_proj.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace origami
