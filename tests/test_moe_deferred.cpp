// The MoE modules' split backward (kernels/deferred.h) on one rank: the
// router, the grouped experts (uneven segments, an empty expert, a group fed
// by two segments) and the whole MoE layer (shared expert, aux and z losses,
// capacity with drops, recompute_experts) give bitwise the fused backward's
// dx and weight gradients from B then W, with W run after the weights were
// poisoned into a binding unbound through B (tests/deferred_check.h).
#include <gtest/gtest.h>

#include <optional>

#include "deferred_check.h"
#include "grad_check.h"
#include "moe/moe_layer.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using moe::ExpertWeights;
using moe::MoeLayerWeights;
using testing::expect_split_is_fused;
using testing::random_tensor;

constexpr int64_t B = 2, S = 12, T = B * S, D = 16, E = 6, K = 2, F = 12, FS = 20;

std::vector<Tensor*> expert_views(ExpertWeights& g) { return {&g.w1_EFD, &g.w3_EFD, &g.w2_EDF}; }
std::vector<Tensor*> layer_views(MoeLayerWeights& g) {
  std::vector<Tensor*> v{&g.gate_ED, &g.experts.w1_EFD, &g.experts.w3_EFD, &g.experts.w2_EDF};
  if (g.shared.w1_EFD.defined()) v.insert(v.end(), {&g.shared.w1_EFD, &g.shared.w3_EFD, &g.shared.w2_EDF});
  return v;
}

ExpertWeights random_experts(int64_t n, int64_t f, std::mt19937& rng, float sd = 0.3f) {
  return {random_tensor({n, f, D}, rng, sd), random_tensor({n, f, D}, rng, sd), random_tensor({n, D, f}, rng, sd)};
}

moe::RouterOptions router_options(bool sigmoid_seq_z) {
  moe::RouterOptions r;
  r.num_experts = E, r.top_k = K;
  r.load_balancing = moe::LoadBalancing::aux_loss, r.aux_loss_coeff = 0.5;
  if (sigmoid_seq_z) {
    r.score_function = moe::ScoreFunction::sigmoid, r.normalize_topk = true, r.topk_scaling = 2.5f;
    r.load_balancing = moe::LoadBalancing::seq_aux_loss, r.z_loss_coeff = 0.05;
  }
  return r;
}

TEST(MoeDeferred, Router) {
  for (bool variant : {false, true}) {
    std::mt19937 rng(testing::test_seed(variant ? 11 : 10));
    const moe::RouterOptions opt = router_options(variant);
    Tensor gate = random_tensor({E, D}, rng, 0.5f), x = random_tensor({T, D}, rng);
    moe::RouterSaved saved;
    moe::router_forward(ctx, opt, x, gate, Tensor(), S, saved);
    moe::router_losses(opt, saved);
    const Tensor dweight = random_tensor({T, K}, rng);
    expect_split_is_fused(variant ? "router (sigmoid, seq aux, z)" : "router (softmax, aux)",
                          random_tensor({E, D}, rng), testing::tensor_views, {gate}, 1,
                          [&](Tensor& dgate, WeightGradQueue* q) {
                            return moe::router_backward(ctx, opt, saved, gate, dweight, 0.25f, dgate, q);
                          });
  }
}

TEST(MoeDeferred, GroupedExperts) {
  std::mt19937 rng(testing::test_seed(12));
  const ExpertWeights w = random_experts(4, F, rng);
  // Expert 2 empty, expert 1 fed by two segments (the expert-parallel arrival order).
  const moe::ExpertSegments segments{{0, 5}, {1, 3}, {3, 7}, {1, 4}};
  Tensor x = random_tensor({19, D}, rng), dy = random_tensor({19, D}, rng);
  moe::ExpertsSaved saved;
  moe::experts_forward(ctx, w, x, segments, saved);
  ExpertWeights start = random_experts(4, F, rng, 1.0f);
  expect_split_is_fused("experts", start, expert_views, {w.w1_EFD, w.w3_EFD, w.w2_EDF}, 3,
                        [&](ExpertWeights& g, WeightGradQueue* q) {
                          return moe::experts_backward(ctx, w, saved, dy, g, q);
                        });
}

struct LayerCase {
  const char* name;
  bool sigmoid_seq_z = false, shared = true, recompute = false;
  std::optional<double> capacity;
};

TEST(MoeDeferred, WholeLayer) {
  const LayerCase cases[] = {{"aux, shared expert", false, true, false, {}},
                             {"sigmoid, seq aux, z, recompute_experts", true, true, true, {}},
                             {"capacity 1.0 with drops, no shared expert", false, false, false, 1.0}};
  uint32_t seed = 20;
  for (const LayerCase& c : cases) {
    std::mt19937 rng(testing::test_seed(seed++));
    moe::MoeLayerOptions opt;
    opt.router = router_options(c.sigmoid_seq_z);
    opt.capacity.capacity_factor = c.capacity;
    opt.recompute_experts = c.recompute;
    MoeLayerWeights w;
    w.gate_ED = random_tensor({E, D}, rng, 0.5f);
    w.experts = random_experts(E, F, rng);
    if (c.shared) w.shared = random_experts(1, FS, rng);
    Tensor x = random_tensor({T, D}, rng), dy = random_tensor({T, D}, rng);
    moe::MoeLayerSaved saved;
    moe::MoeLayerStats stats;
    moe::moe_layer_forward(ctx, opt, w, x, S, saved, stats);
    MoeLayerWeights start;
    start.gate_ED = random_tensor({E, D}, rng);
    start.experts = random_experts(E, F, rng, 1.0f);
    if (c.shared) start.shared = random_experts(1, FS, rng, 1.0f);
    std::vector<Tensor> weights{w.gate_ED, w.experts.w1_EFD, w.experts.w3_EFD, w.experts.w2_EDF};
    if (c.shared) weights.insert(weights.end(), {w.shared.w1_EFD, w.shared.w3_EFD, w.shared.w2_EDF});
    expect_split_is_fused(c.name, start, layer_views, weights, c.shared ? 7 : 4,
                          [&](MoeLayerWeights& g, WeightGradQueue* q) {
                            return moe::moe_layer_backward(ctx, opt, w, saved, dy, 0.5f, g, nullptr, q);
                          });
  }
}

}  // namespace
}  // namespace origami
