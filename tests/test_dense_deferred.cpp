// The dense modules' split backward (kernels/deferred.h) on one rank: each
// module's B then W gives bitwise the fused backward's dx and weight
// gradients, on fresh random inputs, with W run after the weights were
// poisoned (it reads none) into a binding that was unbound through B
// (tests/deferred_check.h): RMSNorm, attention (GQA, RoPE at offset
// positions), context-parallel attention on no group, the SwiGLU MLP, the LM
// head, the embedding, and the tensor-parallel wrappers on no group. A
// queue run with a destination left unbound stops with a message.
#include <gtest/gtest.h>

#include "deferred_check.h"
#include "dense/attention.h"
#include "dense/attention_cp.h"
#include "dense/embedding.h"
#include "dense/lm_head.h"
#include "dense/mlp.h"
#include "dense/norm.h"
#include "dense/tensor_parallel.h"
#include "grad_check.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using testing::expect_split_is_fused;
using testing::random_tensor;

constexpr int64_t B = 2, S = 11, T = B * S, D = 32, Hq = 4, Hkv = 2, hd = 8, F = 40, V = 29;

std::vector<Tensor*> attention_views(dense::AttentionWeights& g) { return {&g.wq, &g.wk, &g.wv, &g.wo}; }
std::vector<Tensor*> mlp_views(dense::MlpWeights& g) { return {&g.gate, &g.up, &g.down}; }

Tensor positions(int64_t first) {
  Tensor pos = Tensor::empty({S}, DType::i32, MemCategory::activation);
  for (int64_t s = 0; s < S; ++s) pos.i32()[s] = static_cast<int32_t>(first + s);
  return pos;
}

Tensor ids(std::mt19937& rng) {
  Tensor t = Tensor::empty({T}, DType::i32, MemCategory::activation);
  std::uniform_int_distribution<int32_t> d(0, V - 1);
  for (int64_t i = 0; i < T; ++i) t.i32()[i] = d(rng);
  t.i32()[T - 1] = t.i32()[0];  // a repeated id: the scatter-add accumulates it
  return t;
}

dense::AttentionWeights random_attention(std::mt19937& rng) {
  return {random_tensor({Hq * hd, D}, rng, 0.3f), random_tensor({Hkv * hd, D}, rng, 0.3f),
          random_tensor({Hkv * hd, D}, rng, 0.3f), random_tensor({D, Hq * hd}, rng, 0.3f)};
}
dense::AttentionWeights like(const dense::AttentionWeights& w, std::mt19937& rng) {
  return {random_tensor(w.wq.shape(), rng), random_tensor(w.wk.shape(), rng), random_tensor(w.wv.shape(), rng),
          random_tensor(w.wo.shape(), rng)};
}

TEST(DenseDeferred, RmsNorm) {
  std::mt19937 rng(testing::test_seed(1));
  Tensor w = random_tensor({D}, rng), x = random_tensor({T, D}, rng, 2.0f), dy = random_tensor({T, D}, rng);
  dense::RmsNormSaved saved;
  dense::rmsnorm_module_forward(ctx, x, w, 1e-5f, saved);
  expect_split_is_fused("rmsnorm", random_tensor({D}, rng), testing::tensor_views, {w}, 1,
                        [&](Tensor& dw, WeightGradQueue* q) {
                          return dense::rmsnorm_module_backward(ctx, dy, w, saved, dw, q);
                        });
}

TEST(DenseDeferred, AttentionAndContextParallelAttentionOnNoGroup) {
  std::mt19937 rng(testing::test_seed(2));
  const dense::AttentionOptions opt{Hq, Hkv, hd, 10000.0f};
  {
    dense::AttentionWeights w = random_attention(rng);
    Tensor x = random_tensor({T, D}, rng), dy = random_tensor({T, D}, rng);
    dense::AttentionSaved saved;
    dense::attention_module_forward(ctx, opt, w, x, B, positions(37), saved);
    expect_split_is_fused("attention", like(w, rng), attention_views, {w.wq, w.wk, w.wv, w.wo}, 4,
                          [&](dense::AttentionWeights& g, WeightGradQueue* q) {
                            return dense::attention_module_backward(ctx, opt, w, saved, dy, g, q);
                          });
  }
  dense::AttentionWeights w = random_attention(rng);
  Tensor x = random_tensor({T, D}, rng), dy = random_tensor({T, D}, rng);
  dense::CpAttentionSaved saved;
  dense::cp_attention_forward(ctx, opt, w, x, B, dense::CpPositions(positions(5)), nullptr,
                              dense::CpComm::all_gather, saved);
  expect_split_is_fused("cp attention", like(w, rng), attention_views, {w.wq, w.wk, w.wv, w.wo}, 4,
                        [&](dense::AttentionWeights& g, WeightGradQueue* q) {
                          return dense::cp_attention_backward(ctx, opt, w, saved, dy, nullptr, g, q);
                        });
}

TEST(DenseDeferred, SwigluMlp) {
  std::mt19937 rng(testing::test_seed(3));
  dense::MlpWeights w{random_tensor({F, D}, rng, 0.3f), random_tensor({F, D}, rng, 0.3f),
                      random_tensor({D, F}, rng, 0.3f)};
  Tensor x = random_tensor({T, D}, rng), dy = random_tensor({T, D}, rng);
  dense::MlpSaved saved;
  dense::mlp_module_forward(ctx, w, x, saved);
  const dense::MlpWeights start{random_tensor({F, D}, rng), random_tensor({F, D}, rng), random_tensor({D, F}, rng)};
  expect_split_is_fused("mlp", start, mlp_views, {w.gate, w.up, w.down}, 3,
                        [&](dense::MlpWeights& g, WeightGradQueue* q) {
                          return dense::mlp_module_backward(ctx, w, saved, dy, g, q);
                        });
}

TEST(DenseDeferred, LmHeadAndEmbedding) {
  std::mt19937 rng(testing::test_seed(4));
  Tensor head = random_tensor({V, D}, rng, 0.3f), y = random_tensor({T, D}, rng), targets = ids(rng);
  // The head's backward consumes its saved logits: each run does its own forward.
  expect_split_is_fused("lm head", random_tensor({V, D}, rng), testing::tensor_views, {head}, 1,
                        [&](Tensor& dw, WeightGradQueue* q) {
                          dense::LmHeadSaved saved;
                          dense::lm_head_forward(ctx, head, y, targets, saved);
                          return dense::lm_head_backward(ctx, head, saved, 1.0f / T, dw, q);
                        });
  const Tensor token_ids = ids(rng), dx = random_tensor({T, D}, rng);
  expect_split_is_fused("embedding", random_tensor({V, D}, rng), testing::tensor_views, {}, 1,
                        [&](Tensor& dtable, WeightGradQueue* q) {
                          dense::embedding_module_backward(ctx, token_ids, dx, dtable, q);
                          return Tensor();
                        });
}

// On no group the wrappers are the modules; their defer reaches them.
TEST(DenseDeferred, TensorParallelWrappersOnNoGroup) {
  std::mt19937 rng(testing::test_seed(5));
  const dense::AttentionOptions opt{Hq, Hkv, hd, 10000.0f};
  dense::AttentionWeights wa = random_attention(rng);
  Tensor x = random_tensor({T, D}, rng), dy = random_tensor({T, D}, rng);
  dense::AttentionSaved sa;
  dense::tp_attention_forward(ctx, opt, wa, x, B, positions(0), nullptr, sa);
  expect_split_is_fused("tp attention", like(wa, rng), attention_views, {wa.wq, wa.wk, wa.wv, wa.wo}, 4,
                        [&](dense::AttentionWeights& g, WeightGradQueue* q) {
                          return dense::tp_attention_backward(ctx, opt, wa, sa, dy, nullptr, g, q);
                        });
  dense::MlpWeights wm{random_tensor({F, D}, rng, 0.3f), random_tensor({F, D}, rng, 0.3f),
                       random_tensor({D, F}, rng, 0.3f)};
  dense::MlpSaved sm;
  dense::tp_mlp_forward(ctx, wm, x, nullptr, sm);
  const dense::MlpWeights start{random_tensor({F, D}, rng), random_tensor({F, D}, rng), random_tensor({D, F}, rng)};
  expect_split_is_fused("tp mlp", start, mlp_views, {wm.gate, wm.up, wm.down}, 3,
                        [&](dense::MlpWeights& g, WeightGradQueue* q) {
                          return dense::tp_mlp_backward(ctx, wm, sm, dy, nullptr, g, q);
                        });
  const Tensor token_ids = ids(rng), head = random_tensor({V, D}, rng, 0.3f);
  expect_split_is_fused("tp embedding", random_tensor({V, D}, rng), testing::tensor_views, {}, 1,
                        [&](Tensor& dtable, WeightGradQueue* q) {
                          dense::tp_embedding_backward(ctx, token_ids, dy, V, nullptr, dtable, q);
                          return Tensor();
                        });
  expect_split_is_fused("tp lm head", random_tensor({V, D}, rng), testing::tensor_views, {head}, 1,
                        [&](Tensor& dw, WeightGradQueue* q) {
                          dense::TpLmHeadSaved saved;
                          dense::tp_lm_head_forward(ctx, head, V, x, token_ids, nullptr, saved);
                          return dense::tp_lm_head_backward(ctx, head, saved, 0.5f, nullptr, dw, q);
                        });
}

TEST(DenseDeferredDeathTest, RunningWithAnUnboundDestinationStops) {
  std::mt19937 rng(testing::test_seed(6));
  Tensor w = random_tensor({D}, rng), x = random_tensor({T, D}, rng), dy = random_tensor({T, D}, rng);
  dense::RmsNormSaved saved;
  dense::rmsnorm_module_forward(ctx, x, w, 1e-5f, saved);
  WeightGradQueue q;
  Tensor unbound;
  dense::rmsnorm_module_backward(ctx, dy, w, saved, unbound, &q);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(q.run(ctx), "deferred weight gradient 0 of 1: its destination is not bound");
}

}  // namespace
}  // namespace origami
