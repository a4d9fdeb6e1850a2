// Finite-difference gradient checks for every dense module (ARCHITECTURE.md
// §9): attention with GQA and RoPE at non-zero positions, SwiGLU MLP, RMSNorm,
// embedding, and the LM head with its cross-entropy loss. Tolerances are
// explained in grad_check.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dense/attention.h"
#include "dense/embedding.h"
#include "dense/lm_head.h"
#include "dense/mlp.h"
#include "dense/norm.h"
#include "grad_check.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using testing::expect_directional_grad;
using testing::random_tensor;

Tensor zeros_like(const Tensor& t) { return Tensor::zeros(t.shape(), DType::f32, MemCategory::grad); }

TEST(DenseGrad, AttentionGqaRopeAtOffsetPositions) {
  std::mt19937 rng(testing::test_seed(101));
  const int64_t B = 2, S = 13, D = 32, Hq = 4, Hkv = 2, hd = 8;
  dense::AttentionOptions opt{Hq, Hkv, hd, 10000.0f};
  dense::AttentionWeights w{random_tensor({Hq * hd, D}, rng, 0.3f), random_tensor({Hkv * hd, D}, rng, 0.3f),
                            random_tensor({Hkv * hd, D}, rng, 0.3f), random_tensor({D, Hq * hd}, rng, 0.3f)};
  Tensor x = random_tensor({B * S, D}, rng);
  Tensor r = random_tensor({B * S, D}, rng);
  // Positions 37..49: RoPE angles far from zero, where a sign slip shows.
  Tensor pos = Tensor::empty({S}, DType::i32, MemCategory::activation);
  for (int64_t s = 0; s < S; ++s) pos.i32()[s] = static_cast<int32_t>(37 + s);

  auto objective = [&] {
    dense::AttentionSaved saved;
    return testing::dot(dense::attention_module_forward(ctx, opt, w, x, B, pos, saved), r);
  };
  dense::AttentionSaved saved;
  dense::attention_module_forward(ctx, opt, w, x, B, pos, saved);
  dense::AttentionWeights g{zeros_like(w.wq), zeros_like(w.wk), zeros_like(w.wv), zeros_like(w.wo)};
  Tensor dx = dense::attention_module_backward(ctx, opt, w, saved, r, g);

  expect_directional_grad("dx", x, dx, rng, objective);
  expect_directional_grad("dWq", w.wq, g.wq, rng, objective);
  expect_directional_grad("dWk", w.wk, g.wk, rng, objective);
  expect_directional_grad("dWv", w.wv, g.wv, rng, objective);
  expect_directional_grad("dWo", w.wo, g.wo, rng, objective);
}

TEST(DenseGrad, AttentionCausalityHoldsAtModuleLevel) {
  // Changing the last token must not change any earlier output.
  std::mt19937 rng(testing::test_seed(7));
  const int64_t B = 1, S = 9, D = 16, H = 2, hd = 8;
  dense::AttentionOptions opt{H, H, hd, 10000.0f};
  dense::AttentionWeights w{random_tensor({H * hd, D}, rng, 0.3f), random_tensor({H * hd, D}, rng, 0.3f),
                            random_tensor({H * hd, D}, rng, 0.3f), random_tensor({D, H * hd}, rng, 0.3f)};
  Tensor x = random_tensor({S, D}, rng);
  Tensor pos = Tensor::empty({S}, DType::i32, MemCategory::activation);
  for (int64_t s = 0; s < S; ++s) pos.i32()[s] = static_cast<int32_t>(s);
  dense::AttentionSaved s1, s2;
  Tensor y1 = dense::attention_module_forward(ctx, opt, w, x, B, pos, s1);
  for (int64_t d = 0; d < D; ++d) x.f32()[(S - 1) * D + d] += 1.0f;
  Tensor y2 = dense::attention_module_forward(ctx, opt, w, x, B, pos, s2);
  for (int64_t i = 0; i < (S - 1) * D; ++i) EXPECT_EQ(y1.f32()[i], y2.f32()[i]) << "element " << i;
  double last_diff = 0;
  for (int64_t d = 0; d < D; ++d) last_diff += std::abs(y1.f32()[(S - 1) * D + d] - y2.f32()[(S - 1) * D + d]);
  EXPECT_GT(last_diff, 1e-3);
}

TEST(DenseGrad, SwigluMlp) {
  std::mt19937 rng(testing::test_seed(202));
  const int64_t T = 10, D = 24, F = 40;
  dense::MlpWeights w{random_tensor({F, D}, rng, 0.3f), random_tensor({F, D}, rng, 0.3f),
                      random_tensor({D, F}, rng, 0.3f)};
  Tensor x = random_tensor({T, D}, rng), r = random_tensor({T, D}, rng);
  auto objective = [&] {
    dense::MlpSaved saved;
    return testing::dot(dense::mlp_module_forward(ctx, w, x, saved), r);
  };
  dense::MlpSaved saved;
  dense::mlp_module_forward(ctx, w, x, saved);
  dense::MlpWeights g{zeros_like(w.gate), zeros_like(w.up), zeros_like(w.down)};
  Tensor dx = dense::mlp_module_backward(ctx, w, saved, r, g);
  expect_directional_grad("dx", x, dx, rng, objective);
  expect_directional_grad("dWgate", w.gate, g.gate, rng, objective);
  expect_directional_grad("dWup", w.up, g.up, rng, objective);
  expect_directional_grad("dWdown", w.down, g.down, rng, objective);
}

TEST(DenseGrad, RmsNorm) {
  std::mt19937 rng(testing::test_seed(303));
  const int64_t T = 7, D = 33;
  Tensor x = random_tensor({T, D}, rng), w = random_tensor({D}, rng), r = random_tensor({T, D}, rng);
  auto objective = [&] {
    dense::RmsNormSaved saved;
    return testing::dot(dense::rmsnorm_module_forward(ctx, x, w, 1e-5f, saved), r);
  };
  dense::RmsNormSaved saved;
  dense::rmsnorm_module_forward(ctx, x, w, 1e-5f, saved);
  Tensor dw = zeros_like(w);
  Tensor dx = dense::rmsnorm_module_backward(ctx, r, w, saved, dw);
  expect_directional_grad("dx", x, dx, rng, objective);
  expect_directional_grad("dw", w, dw, rng, objective);
}

TEST(DenseGrad, EmbeddingWithRepeatedIds) {
  std::mt19937 rng(testing::test_seed(404));
  const int64_t V = 11, D = 6, T = 20;
  Tensor table = random_tensor({V, D}, rng), r = random_tensor({T, D}, rng);
  Tensor ids = Tensor::empty({T}, DType::i32, MemCategory::activation);
  for (int64_t t = 0; t < T; ++t) ids.i32()[t] = static_cast<int32_t>((t * 7) % 5);  // repeats, rows 5.. unused
  auto objective = [&] { return testing::dot(dense::embedding_module_forward(ctx, ids, table), r); };
  Tensor dtable = zeros_like(table);
  dense::embedding_module_backward(ctx, ids, r, dtable);
  expect_directional_grad("dtable", table, dtable, rng, objective);
  for (int64_t v = 5; v < V; ++v)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dtable.f32()[v * D + d], 0.0f) << "unused row " << v;
}

TEST(DenseGrad, LmHeadAndCrossEntropyLoss) {
  std::mt19937 rng(testing::test_seed(505));
  const int64_t T = 9, D = 16, V = 23;
  const float scale = 1.0f / static_cast<float>(T);  // mean token loss
  Tensor w = random_tensor({V, D}, rng, 0.5f), y = random_tensor({T, D}, rng);
  Tensor targets = Tensor::empty({T}, DType::i32, MemCategory::activation);
  std::uniform_int_distribution<int32_t> tok(0, V - 1);
  for (int64_t t = 0; t < T; ++t) targets.i32()[t] = tok(rng);
  auto objective = [&] {
    dense::LmHeadSaved saved;
    return scale * dense::lm_head_forward(ctx, w, y, targets, saved);
  };
  dense::LmHeadSaved saved;
  const double loss_sum = dense::lm_head_forward(ctx, w, y, targets, saved);
  // The forward itself, against Σ_t (lse_t − logit_t[target]) in fp64
  // (finite differences below only test the backward against it): fp32
  // logits of 16-term dot products and a 23-term lse, ~1e-6 relative.
  double want = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> logit(V);
    for (int64_t v = 0; v < V; ++v)
      for (int64_t d = 0; d < D; ++d) logit[v] += static_cast<double>(w.f32()[v * D + d]) * y.f32()[t * D + d];
    const double mx = *std::max_element(logit.begin(), logit.end());
    double se = 0;
    for (double l : logit) se += std::exp(l - mx);
    want += mx + std::log(se) - logit[targets.i32()[t]];
  }
  EXPECT_NEAR(loss_sum, want, 1e-5 * want);
  Tensor dw = zeros_like(w);
  Tensor dy = dense::lm_head_backward(ctx, w, saved, scale, dw);
  expect_directional_grad("dy", y, dy, rng, objective);
  expect_directional_grad("dW", w, dw, rng, objective);
}

}  // namespace
}  // namespace origami
