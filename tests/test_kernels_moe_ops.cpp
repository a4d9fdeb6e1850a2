// MoE routing kernels (ARCHITECTURE.md §9), what the op × backend harness
// (tests/backend_ops/ops_moe*.cpp) does not check: top-k on constructed
// logits (exact expert ties, group ties, bias moving the selection but not
// the weights), the per-token backward against fp64 central differences of
// a naive forward, bitwise-equal results at 1 and 3 threads, and the
// messages for bad routing-statistics shapes. Every plain comparison of an
// op with its naive reference (forward, statistics buffer, totals, aux
// coefficients, histograms, capacity masks, rows per expert, row maps and
// gathers, expert-bias update) lives in the harness.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/moe_ops.h"
#include "naive_ops.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();
using testing::naive_topk;
using testing::NaiveTopk;

Tensor make(Shape s, DType dt = DType::f32) { return Tensor::empty(std::move(s), dt, MemCategory::activation); }

Tensor randn(Shape s, std::mt19937& g, float sd = 1.0f) {
  Tensor t = make(std::move(s));
  std::normal_distribution<float> nd(0.0f, sd);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

std::vector<double> to_double(const Tensor& t) { return std::vector<double>(t.f32(), t.f32() + t.numel()); }

struct TopkOut {
  Tensor scores, experts, weights, lse;
};
TopkOut run_topk(const Tensor& logits, const Tensor& bias, const MoeTopkParams& p,
                 const ExecContext& ctx = testing::test_context()) {
  const int64_t T = logits.rows(), E = logits.cols();
  TopkOut o{make({T, E}), make({T, p.top_k}, DType::i32), make({T, p.top_k}), make({T})};
  moe_topk_forward(ctx, logits, bias, p, o.scores, o.experts, o.weights, o.lse);
  return o;
}

TEST(KernelsMoe, TopkTiesOnConstructedLogits) {
  auto logits_of = [](std::vector<float> v, int64_t E) {
    Tensor t = make({int64_t(v.size()) / E, E});
    std::copy(v.begin(), v.end(), t.f32());
    return t;
  };
  // Expert ties: lower index first, output in descending order.
  MoeTopkParams p{MoeScore::softmax, 3, 1, 1, false, 1.0f};
  TopkOut o = run_topk(logits_of({1, 2, 2, 0, 2, 1}, 6), Tensor(), p);
  EXPECT_EQ(std::vector<int>(o.experts.i32(), o.experts.i32() + 3), (std::vector<int>{1, 2, 4}));
  // Group ties: groups {0,1}, {2,3}, {4,5}; groups 1 and 2 tie on the sum of
  // their top-2 and beat group 0; group 1 (lower) is kept.
  p = MoeTopkParams{MoeScore::sigmoid, 2, 3, 1, false, 1.0f};
  o = run_topk(logits_of({0, 0, 1, 3, 3, 1}, 6), Tensor(), p);
  EXPECT_EQ(std::vector<int>(o.experts.i32(), o.experts.i32() + 2), (std::vector<int>{3, 2}));
  // Bias moves selection; weights stay the unbiased scores.
  Tensor bias = make({6});
  std::fill(bias.f32(), bias.f32() + 6, 0.0f);
  bias.f32()[0] = 1.0f;
  p = MoeTopkParams{MoeScore::sigmoid, 1, 1, 1, false, 1.0f};
  o = run_topk(logits_of({0, 0, 1, 3, 3, 1}, 6), bias, p);
  EXPECT_EQ(o.experts.i32()[0], 0);
  EXPECT_FLOAT_EQ(o.weights.f32()[0], 0.5f);
}

// Objective the backward differentiates, in fp64 with the selection fixed.
double naive_objective(const std::vector<double>& z, int64_t E, const MoeTopkParams& p, const std::vector<int>& experts,
                       const std::vector<double>& R, const std::vector<double>& A, int64_t seg_len, double zc) {
  const NaiveTopk n = naive_topk(z, E, p, {}, &experts);
  const int64_t T = int64_t(z.size()) / E, K = p.top_k;
  double f = 0;
  for (int64_t i = 0; i < T * K; ++i) f += R[i] * n.weights[i];
  for (int64_t t = 0; t < T; ++t) {
    double norm = 0;
    for (int64_t e = 0; e < E; ++e) norm += n.scores[t * E + e];
    for (int64_t e = 0; e < E; ++e) {
      const double s = n.scores[t * E + e];
      f += A[(t / seg_len) * E + e] * (p.score_function == MoeScore::sigmoid ? s / (norm + 1e-20) : s);
    }
    f += zc * n.lse[t] * n.lse[t];
  }
  return f;
}

TEST(KernelsMoe, TopkBackwardMatchesFp64CentralDifferences) {
  std::mt19937 rng(testing::test_seed(73));
  const int64_t T = 12, E = 8, K = 3, seg = 4;
  for (MoeScore sc : {MoeScore::softmax, MoeScore::sigmoid}) {
    for (bool norm : {false, true}) {
      MoeTopkParams p{sc, K, 2, 1, norm, 1.3f};
      Tensor logits = randn({T, E}, rng, 1.5f), R = randn({T, K}, rng), A = randn({T / seg, E}, rng, 0.3f);
      const TopkOut o = run_topk(logits, Tensor(), p);
      const float zc = 0.07f;
      Tensor dz = make({T, E});
      moe_topk_backward(ctx, logits, o.scores, o.experts, R, A, seg, zc, p, dz);
      const std::vector<int> experts(o.experts.i32(), o.experts.i32() + T * K);
      std::vector<double> z = to_double(logits);
      const std::vector<double> Rd = to_double(R), Ad = to_double(A);
      // fp64 central differences, h = 1e-6: truncation ~1e-12, rounding ~1e-10.
      for (int64_t i = 0; i < T * E; ++i) {
        const double z0 = z[i];
        z[i] = z0 + 1e-6;
        const double fp = naive_objective(z, E, p, experts, Rd, Ad, seg, zc);
        z[i] = z0 - 1e-6;
        const double fm = naive_objective(z, E, p, experts, Rd, Ad, seg, zc);
        z[i] = z0;
        const double want = (fp - fm) / 2e-6;
        // The kernel runs in fp32 (exp_fast, float sums): 1e-5 of the row scale.
        EXPECT_NEAR(dz.f32()[i], want, 1e-5 * (1 + std::abs(want))) << "score " << int(sc) << " norm " << norm << " i " << i;
      }
    }
  }
}

// The statistics ops name what is wrong with their shapes.
TEST(KernelsMoe, RoutingStatisticsRejectBadShapes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::mt19937 rng(testing::test_seed(80));
  const int64_t T = 10, E = 4;
  const TopkOut o = run_topk(randn({T, E}, rng), Tensor(), MoeTopkParams{MoeScore::softmax, 2, 1, 1, false, 1.0});
  Tensor stats3 = make({2 * 3 * E + 2}, DType::f64), stats1 = make({2 * E + 2}, DType::f64);
  EXPECT_DEATH(moe_routing_stats(ctx, o.scores, o.experts, o.lse, MoeScore::softmax, 3, stats3),
               "10 tokens do not split into 3 segments");
  EXPECT_DEATH(moe_routing_stats(ctx, o.scores, o.experts, o.lse, MoeScore::softmax, 2, stats1), "router stats_N");
  Tensor totals = make({3}, DType::f64), totals2 = make({2}, DType::f64);
  EXPECT_DEATH(moe_routing_totals(ctx, stats1, 1, E, 0, totals), "router totals need top_k >= 1, got 0");
  EXPECT_DEATH(moe_routing_totals(ctx, stats1, 1, E, 2, totals2), "router totals_3 must be f64 \\[3\\]");
  Tensor aux = make({2, E});
  EXPECT_DEATH(moe_aux_coefficients(ctx, stats1, 0.1, aux), "router stats_N");
  Tensor bias = make({E});
  const std::vector<int64_t> load(E + 1, 1);
  EXPECT_DEATH(moe_expert_bias_update(ctx, bias, load, 0.1f), "expert bias_E");
}

// Row maps for a small routing with one drop and padding to 3 rows/expert.
struct Maps {
  Tensor row_of, token, slot;
};
Maps small_maps(const Tensor& ex, const Tensor& kept, int64_t E, int64_t rows_each) {
  Tensor rows = make({E}, DType::i64);
  std::fill(rows.data<int64_t>(), rows.data<int64_t>() + E, rows_each);
  Maps m{make(ex.shape(), DType::i32), make({E * rows_each}, DType::i32), make({E * rows_each}, DType::i32)};
  moe_permutation_maps(ctx, ex, kept, rows, m.row_of, m.token, m.slot);
  return m;
}

// Every op gives bitwise-identical results at 1 and 3 threads.
TEST(KernelsMoe, ResultsDoNotDependOnThreadCount) {
  std::mt19937 rng(testing::test_seed(89));
  const int64_t T = 700, E = 16, K = 4, D = 33;
  MoeTopkParams p{MoeScore::sigmoid, K, 4, 2, true, 2.0f};
  Tensor logits = randn({T, E}, rng, 2.0f), R = randn({T, K}, rng), A = randn({1, E}, rng), x = randn({T, D}, rng);
  auto run = [&](int threads) {
    const ExecContext local = ExecContext::cpu(threads);
    const ExecContext& ctx = local;
    std::vector<float> out;
    const TopkOut o = run_topk(logits, Tensor(), p, ctx);
    Tensor stats = make({2 * E + 2}, DType::f64);
    moe_routing_stats(ctx, o.scores, o.experts, o.lse, p.score_function, 1, stats);
    const double* c = stats.data<double>();
    const double* s = c + E;
    Tensor dz = make({T, E});
    moe_topk_backward(ctx, logits, o.scores, o.experts, R, A, T, 0.01f, p, dz);
    const Maps m = small_maps(o.experts, Tensor(), E, T);
    Tensor x_ND = make({E * T, D}), y = make({T, D}), dy = make({E * T, D}), dw = make({T, K});
    moe_permute_rows(ctx, x, m.token, x_ND);
    moe_unpermute_rows(ctx, x_ND, m.row_of, o.weights, y);
    moe_unpermute_rows_backward(ctx, x, x_ND, m.row_of, m.token, o.weights, dy, dw);
    Tensor dx = make({T, D});
    std::fill(dx.f32(), dx.f32() + T * D, 0.0f);
    moe_permute_rows_backward(ctx, dy, m.row_of, dx);
    for (const Tensor& t : {o.scores, o.weights, dz, y, dw, dx}) out.insert(out.end(), t.f32(), t.f32() + t.numel());
    for (int64_t e = 0; e < E; ++e)
      out.push_back(float(c[e])), out.push_back(float(s[e])), out.push_back(float(s[e] - float(s[e])));
    return out;
  };
  const std::vector<float> one = run(1), three = run(3);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(one[i], three[i]) << "element " << i;
}

}  // namespace
}  // namespace origami
