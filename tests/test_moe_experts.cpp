// Grouped SwiGLU experts (moe/experts.h): forward against a naive per-row
// fp64 reference with an empty expert, uneven groups and zero padding rows;
// finite-difference checks of dx, dW1, dW3, dW2 for the expert group and for
// the shared-expert use (one expert over all tokens); gradients accumulate
// and leave empty experts untouched. Tolerances are explained in
// grad_check.h; forward tolerances below.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "grad_check.h"
#include "kernels/threads.h"
#include "moe/experts.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using moe::ExpertWeights;
using testing::expect_directional_grad;
using testing::random_tensor;

Tensor zeros_like(const Tensor& t) { return Tensor::zeros(t.shape(), DType::f32, MemCategory::grad); }
ExpertWeights zeros_like(const ExpertWeights& w) {
  return {zeros_like(w.w1_EFD), zeros_like(w.w3_EFD), zeros_like(w.w2_EDF)};
}

ExpertWeights random_experts(int64_t E, int64_t F, int64_t D, std::mt19937& rng, float stddev = 0.3f) {
  return {random_tensor({E, F, D}, rng, stddev, MemCategory::param),
          random_tensor({E, F, D}, rng, stddev, MemCategory::param),
          random_tensor({E, D, F}, rng, stddev, MemCategory::param)};
}

// y[n] = W2[e]·(silu(W1[e]·x[n]) ⊙ W3[e]·x[n]) in fp64, one row at a time,
// straight from §4 with no shared code path.
std::vector<double> naive_experts(const ExpertWeights& w, const Tensor& x_ND, const std::vector<int64_t>& rows) {
  const int64_t F = w.w1_EFD.size(1), D = w.w1_EFD.size(2), N = x_ND.size(0);
  std::vector<double> y(N * D, 0.0), h(F);
  int64_t n = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    const float* w1 = w.w1_EFD.f32() + e * F * D;
    const float* w3 = w.w3_EFD.f32() + e * F * D;
    const float* w2 = w.w2_EDF.f32() + e * D * F;
    for (int64_t r = 0; r < rows[e]; ++r, ++n) {
      const float* x = x_ND.f32() + n * D;
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < D; ++d) {
          g += static_cast<double>(w1[f * D + d]) * x[d];
          u += static_cast<double>(w3[f * D + d]) * x[d];
        }
        h[f] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t d = 0; d < D; ++d) {
        double s = 0;
        for (int64_t f = 0; f < F; ++f) s += static_cast<double>(w2[d * F + f]) * h[f];
        y[n * D + d] = s;
      }
    }
  }
  return y;
}

// fp32 GEMMs over D or F ≤ 40 terms of O(1) products: absolute error ~1e-6;
// 1e-5 relative to max(|y|, 1) leaves room and catches a wrong weight block
// (errors of O(|y|)) and an intermediate rounded short of fp32 (TF32's
// 2^-11 = 5e-4, bf16's 2^-8).
void expect_close(const Tensor& y, const std::vector<double>& ref) {
  ASSERT_EQ(y.numel(), static_cast<int64_t>(ref.size()));
  double max_abs = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    EXPECT_NEAR(y.f32()[i], ref[i], 1e-5 * std::max(1.0, std::abs(ref[i]))) << "element " << i;
    max_abs = std::max(max_abs, std::abs(ref[i]));
  }
  EXPECT_GT(max_abs, 1e-2) << "reference is (near) zero; the comparison would be vacuous";
}

// E = 4 with expert 1 empty and uneven groups; the last two rows of expert 2
// are zero padding rows (as pad_to_capacity produces).
struct GroupCase {
  int64_t E = 4, F = 12, D = 10;
  std::vector<int64_t> rows{5, 0, 9, 3};
  int64_t N = 17;
  int64_t pad_first = 12, pad_count = 2;  // rows [12, 14) of expert 2 (rows 5..13)
};

Tensor group_input(const GroupCase& c, std::mt19937& rng) {
  Tensor x = random_tensor({c.N, c.D}, rng);
  for (int64_t i = c.pad_first * c.D; i < (c.pad_first + c.pad_count) * c.D; ++i) x.f32()[i] = 0.0f;
  return x;
}

TEST(MoeExperts, ForwardMatchesNaiveReferenceWithEmptyExpertAndPadding) {
  std::mt19937 rng(testing::test_seed(11));
  GroupCase c;
  ExpertWeights w = random_experts(c.E, c.F, c.D, rng);
  Tensor x = group_input(c, rng);
  moe::ExpertsSaved saved;
  Tensor y = moe::experts_forward(ctx, w, x, c.rows, saved);
  check_shape(y, {c.N, c.D}, "y");
  expect_close(y, naive_experts(w, x, c.rows));
  // Padding rows are zero in, so exactly zero out (SwiGLU(0) = 0, no bias).
  for (int64_t i = c.pad_first * c.D; i < (c.pad_first + c.pad_count) * c.D; ++i) EXPECT_EQ(y.f32()[i], 0.0f);
}

TEST(MoeExperts, FiniteDifferenceGradients) {
  std::mt19937 rng(testing::test_seed(12));
  GroupCase c;
  ExpertWeights w = random_experts(c.E, c.F, c.D, rng);
  Tensor x = group_input(c, rng), r = random_tensor({c.N, c.D}, rng);
  auto objective = [&] {
    moe::ExpertsSaved s;
    return testing::dot(moe::experts_forward(ctx, w, x, c.rows, s), r);
  };
  moe::ExpertsSaved saved;
  moe::experts_forward(ctx, w, x, c.rows, saved);
  ExpertWeights g = zeros_like(w);
  Tensor dx = moe::experts_backward(ctx, w, saved, r, g);
  expect_directional_grad("dx", x, dx, rng, objective);
  expect_directional_grad("dW1", w.w1_EFD, g.w1_EFD, rng, objective);
  expect_directional_grad("dW3", w.w3_EFD, g.w3_EFD, rng, objective);
  expect_directional_grad("dW2", w.w2_EDF, g.w2_EDF, rng, objective);

  // The empty expert's gradient stays exactly zero; a row-offset slip would
  // write into it.
  const int64_t FD = c.F * c.D;
  for (int64_t i = 0; i < FD; ++i) {
    EXPECT_EQ(g.w1_EFD.f32()[FD + i], 0.0f);
    EXPECT_EQ(g.w3_EFD.f32()[FD + i], 0.0f);
    EXPECT_EQ(g.w2_EDF.f32()[FD + i], 0.0f);
  }
}

// The expert-parallel layout: runs of one expert in arrival order, an expert
// appearing in several runs (and an empty run). Must equal the same rows
// sorted into one block per expert, row for row, in forward and backward.
TEST(MoeExperts, InterleavedSegmentsEqualSortedRows) {
  std::mt19937 rng(testing::test_seed(14));
  const int64_t E = 3, F = 5, D = 6;
  const moe::ExpertSegments segs = {{2, 3}, {0, 4}, {2, 1}, {1, 0}, {0, 2}, {1, 3}};
  const int64_t N = 13;
  ExpertWeights w = random_experts(E, F, D, rng);
  Tensor x = random_tensor({N, D}, rng), dy = random_tensor({N, D}, rng);
  // sorted_row[n]: where row n of the segment layout sits in expert order.
  std::vector<int64_t> rows(E, 0), sorted_row(N);
  for (const auto& s : segs) rows[s.expert] += s.rows;
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + rows[e - 1];
  int64_t n = 0;
  for (const auto& s : segs)
    for (int64_t i = 0; i < s.rows; ++i) sorted_row[n++] = next[s.expert]++;
  Tensor xs = Tensor::empty({N, D}, DType::f32, MemCategory::activation);
  Tensor dys = Tensor::empty({N, D}, DType::f32, MemCategory::activation);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t d = 0; d < D; ++d) {
      xs.f32()[sorted_row[r] * D + d] = x.f32()[r * D + d];
      dys.f32()[sorted_row[r] * D + d] = dy.f32()[r * D + d];
    }
  moe::ExpertsSaved sa, sb;
  Tensor ya = moe::experts_forward(ctx, w, x, segs, sa), yb = moe::experts_forward(ctx, w, xs, rows, sb);
  ExpertWeights ga = zeros_like(w), gb = zeros_like(w);
  Tensor dxa = moe::experts_backward(ctx, w, sa, dy, ga), dxb = moe::experts_backward(ctx, w, sb, dys, gb);
  // Same GEMM shapes per row, so forward rows agree to rounding; weight
  // gradients sum the same products in a different grouping (fp32, ~1e-6).
  for (int64_t r = 0; r < N; ++r)
    for (int64_t d = 0; d < D; ++d) {
      EXPECT_NEAR(ya.f32()[r * D + d], yb.f32()[sorted_row[r] * D + d], 1e-5f) << "row " << r;
      EXPECT_NEAR(dxa.f32()[r * D + d], dxb.f32()[sorted_row[r] * D + d], 1e-5f) << "row " << r;
    }
  for (auto [a, b] : {std::pair{ga.w1_EFD, gb.w1_EFD}, {ga.w3_EFD, gb.w3_EFD}, {ga.w2_EDF, gb.w2_EDF}})
    for (int64_t i = 0; i < a.numel(); ++i) EXPECT_NEAR(a.f32()[i], b.f32()[i], 1e-5f) << "grad element " << i;
}

TEST(MoeExperts, BackwardAccumulatesIntoGrad) {
  std::mt19937 rng(testing::test_seed(13));
  GroupCase c;
  ExpertWeights w = random_experts(c.E, c.F, c.D, rng);
  Tensor x = group_input(c, rng), dy = random_tensor({c.N, c.D}, rng);
  moe::ExpertsSaved saved;
  moe::experts_forward(ctx, w, x, c.rows, saved);
  ExpertWeights once = zeros_like(w), twice = zeros_like(w);
  moe::experts_backward(ctx, w, saved, dy, once);
  moe::experts_backward(ctx, w, saved, dy, twice);
  moe::experts_backward(ctx, w, saved, dy, twice);
  for (auto [a, b] : {std::pair{&once.w1_EFD, &twice.w1_EFD}, std::pair{&once.w3_EFD, &twice.w3_EFD},
                      std::pair{&once.w2_EDF, &twice.w2_EDF}})
    for (int64_t i = 0; i < a->numel(); ++i) EXPECT_FLOAT_EQ(b->f32()[i], 2.0f * a->f32()[i]) << "element " << i;
}

// The shared expert is the module with E = 1 over all T tokens; it must equal
// the dense SwiGLU of §4, SwiGLU(x) = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ, written here
// with separate [F, D] / [D, F] matrices and row-major loops.
TEST(MoeExperts, SharedExpertEqualsDenseSwiglu) {
  std::mt19937 rng(testing::test_seed(14));
  const int64_t T = 15, D = 16, F = 20;
  Tensor wg = random_tensor({F, D}, rng, 0.3f), wu = random_tensor({F, D}, rng, 0.3f);
  Tensor wd = random_tensor({D, F}, rng, 0.3f);
  ExpertWeights w{wg.view({1, F, D}), wu.view({1, F, D}), wd.view({1, D, F})};
  Tensor x = random_tensor({T, D}, rng);
  moe::ExpertsSaved saved;
  Tensor y = moe::experts_forward(ctx, w, x, std::vector<int64_t>{T}, saved);

  std::vector<double> ref(T * D);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> h(F);
    for (int64_t f = 0; f < F; ++f) {
      double g = 0, u = 0;
      for (int64_t d = 0; d < D; ++d) {
        g += static_cast<double>(x.f32()[t * D + d]) * wg.f32()[f * D + d];
        u += static_cast<double>(x.f32()[t * D + d]) * wu.f32()[f * D + d];
      }
      h[f] = g / (1.0 + std::exp(-g)) * u;
    }
    for (int64_t d = 0; d < D; ++d) {
      double s = 0;
      for (int64_t f = 0; f < F; ++f) s += h[f] * wd.f32()[d * F + f];
      ref[t * D + d] = s;
    }
  }
  expect_close(y, ref);
}

TEST(MoeExperts, SharedExpertFiniteDifferenceGradients) {
  std::mt19937 rng(testing::test_seed(15));
  const int64_t T = 11, D = 14, F = 18;
  ExpertWeights w = random_experts(1, F, D, rng);
  Tensor x = random_tensor({T, D}, rng), r = random_tensor({T, D}, rng);
  auto objective = [&] {
    moe::ExpertsSaved s;
    return testing::dot(moe::experts_forward(ctx, w, x, std::vector<int64_t>{T}, s), r);
  };
  moe::ExpertsSaved saved;
  moe::experts_forward(ctx, w, x, std::vector<int64_t>{T}, saved);
  ExpertWeights g = zeros_like(w);
  Tensor dx = moe::experts_backward(ctx, w, saved, r, g);
  expect_directional_grad("dx", x, dx, rng, objective);
  expect_directional_grad("dW1", w.w1_EFD, g.w1_EFD, rng, objective);
  expect_directional_grad("dW3", w.w3_EFD, g.w3_EFD, rng, objective);
  expect_directional_grad("dW2", w.w2_EDF, g.w2_EDF, rng, objective);
}

// Not a correctness check: reports forward + backward time and GEMM FLOP rate
// at a Mixtral-like per-rank shape (T·k = 8192 rows, D = 512, F = 352, E = 8,
// balanced). 9 GEMMs of 2·n·D·F FLOPs per expert (3 forward, 6 backward).
TEST(MoeExperts, ThroughputReport) {
  std::mt19937 rng(testing::test_seed(16));
  const int64_t N = 8192, D = 512, F = 352, E = 8;
  ExpertWeights w = random_experts(E, F, D, rng, 0.05f);
  ExpertWeights g = zeros_like(w);
  Tensor x = random_tensor({N, D}, rng), dy = random_tensor({N, D}, rng);
  const std::vector<int64_t> rows(E, N / E);
  double best_fwd = 1e30, best_bwd = 1e30;
  for (int rep = 0; rep < 4; ++rep) {  // rep 0 warms caches and oneDNN's JIT
    moe::ExpertsSaved saved;
    const auto t0 = std::chrono::steady_clock::now();
    Tensor y = moe::experts_forward(ctx, w, x, rows, saved);
    const auto t1 = std::chrono::steady_clock::now();
    Tensor dx = moe::experts_backward(ctx, w, saved, dy, g);
    const auto t2 = std::chrono::steady_clock::now();
    if (rep == 0) {
      EXPECT_GT(std::abs(y.f32()[N * D - 1]) + std::abs(dx.f32()[0]), 0.0f);
      continue;
    }
    best_fwd = std::min(best_fwd, std::chrono::duration<double>(t1 - t0).count());
    best_bwd = std::min(best_bwd, std::chrono::duration<double>(t2 - t1).count());
  }
  const double gemm_flop = 2.0 * N * D * F;
  std::printf("experts N=%lld D=%lld F=%lld E=%lld, %d thread(s): forward %.1f ms (%.1f GFLOP/s), "
              "backward %.1f ms (%.1f GFLOP/s), total %.1f ms (%.1f GFLOP/s)\n",
              static_cast<long long>(N), static_cast<long long>(D), static_cast<long long>(F),
              static_cast<long long>(E), num_threads(), best_fwd * 1e3, 3 * gemm_flop / best_fwd * 1e-9,
              best_bwd * 1e3, 6 * gemm_flop / best_bwd * 1e-9, (best_fwd + best_bwd) * 1e3,
              9 * gemm_flop / (best_fwd + best_bwd) * 1e-9);
}

}  // namespace
}  // namespace origami
