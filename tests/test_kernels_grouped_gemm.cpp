// Grouped GEMM (kernels/grouped_gemm.h) against a naive fp64 loop: forward
// (X·Wᵀ), data gradient (dY·W) and weight gradient (Σ dYᵀ·X per group), each
// overwriting and accumulating, over segment lists with empty segments,
// repeated groups (the expert-parallel layout), unused groups, a segment
// longer than one work item (1024 rows, so it is split), and N = 0. Outputs
// sit between sentinel regions; overwrite starts from NaN so a result that
// reads the old output shows. At 1, 2 and 3 threads the results are bitwise
// those of calling gemm per segment (the loop the experts ran before) at the
// same thread count in the per-segment schedule, and those of the loop at
// one thread in the item schedule (many small segments).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/grouped_gemm.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

constexpr float kSentinel = -12345.0f;
constexpr int kGuard = 16;

Tensor make(Shape s) { return Tensor::empty(std::move(s), DType::f32, MemCategory::activation); }

// Inputs drawn from N(0, 1): never all zeros, no exact cancellations.
Tensor randn(Shape s, std::mt19937& g) {
  Tensor t = make(std::move(s));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

// An f32 output view with kGuard sentinel floats on each side of it.
struct Guarded {
  Tensor storage, view;
  explicit Guarded(Shape s) {
    const int64_t n = shape_numel(s);
    storage = make({n + 2 * kGuard});
    std::fill(storage.f32(), storage.f32() + n + 2 * kGuard, kSentinel);
    view = storage.flat_view(kGuard, n, std::move(s));
  }
  void fill(const Tensor& src) { std::copy(src.f32(), src.f32() + src.numel(), view.f32()); }
  void fill_nan() { std::fill(view.f32(), view.f32() + view.numel(), std::numeric_limits<float>::quiet_NaN()); }
  void expect_intact(const char* what) const {
    const int64_t n = view.numel();
    for (int i = 0; i < kGuard; ++i) {
      EXPECT_EQ(storage.f32()[i], kSentinel) << what << ": write before the output";
      EXPECT_EQ(storage.f32()[kGuard + n + i], kSentinel) << what << ": write past the output";
    }
  }
};

using Segments = std::vector<GemmSegment>;

int64_t total_rows(const Segments& s) {
  int64_t n = 0;
  for (const GemmSegment& g : s) n += g.rows;
  return n;
}

// Reference value and the scale its rounding error is measured against
// (Σ|terms| + |beta · old|), both in fp64.
struct Ref {
  std::vector<double> value, scale;
};

// Y_s = X_s · op(W[g]) + beta · Y0_s, one element at a time.
Ref naive_rows(const Tensor& X, const Tensor& W, Trans trans_w, const Segments& segs, const Tensor& Y0, float beta) {
  const int64_t M = trans_w == Trans::yes ? W.size(1) : W.size(2);
  const int64_t K = trans_w == Trans::yes ? W.size(2) : W.size(1);
  const int64_t N = total_rows(segs);
  Ref r{std::vector<double>(N * M), std::vector<double>(N * M)};
  int64_t n0 = 0;
  for (const GemmSegment& s : segs) {
    const float* w = W.f32() + s.group * M * K;
    for (int64_t n = n0; n < n0 + s.rows; ++n)
      for (int64_t m = 0; m < M; ++m) {
        double v = 0.0;
        if (beta != 0.0f) v = double(beta) * Y0.f32()[n * M + m];
        double a = std::abs(v);
        for (int64_t k = 0; k < K; ++k) {
          const double wv = trans_w == Trans::yes ? w[m * K + k] : w[k * M + m];
          const double t = double(X.f32()[n * K + k]) * wv;
          v += t;
          a += std::abs(t);
        }
        r.value[n * M + m] = v;
        r.scale[n * M + m] = a;
      }
    n0 += s.rows;
  }
  return r;
}

// dW[g] = beta · dW0[g] + Σ_{s: g_s = g} dY_sᵀ · X_s.
Ref naive_wgrad(const Tensor& dY, const Tensor& X, const Segments& segs, const Tensor& dW0, float beta) {
  const int64_t G = dW0.size(0), M = dW0.size(1), K = dW0.size(2);
  Ref r{std::vector<double>(G * M * K), std::vector<double>(G * M * K)};
  for (int64_t i = 0; i < G * M * K; ++i) {
    r.value[i] = beta == 0.0f ? 0.0 : double(beta) * dW0.f32()[i];
    r.scale[i] = std::abs(r.value[i]);
  }
  int64_t n0 = 0;
  for (const GemmSegment& s : segs) {
    for (int64_t n = n0; n < n0 + s.rows; ++n)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) {
          const double t = double(dY.f32()[n * M + m]) * X.f32()[n * K + k];
          r.value[(s.group * M + m) * K + k] += t;
          r.scale[(s.group * M + m) * K + k] += std::abs(t);
        }
    n0 += s.rows;
  }
  return r;
}

// fp32 GEMMs with FMA accumulate an inner dimension of up to ~2600 terms
// (the weight gradient sums over a group's rows); the rounding error is
// ~u·√K·Σ|terms| in practice (u = 6e-8: ~3e-6 at K = 2600) and K·u·Σ|terms|
// at worst. 2e-5·Σ|terms| is ~7x the practical size and still far below what
// a wrong group, segment offset or transpose produces (an O(Σ|terms|) error).
void expect_close(const Tensor& y, const Ref& ref, const char* what) {
  ASSERT_EQ(y.numel(), static_cast<int64_t>(ref.value.size())) << what;
  double max_abs = 0, max_scale = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    ASSERT_NEAR(y.f32()[i], ref.value[i], 2e-5 * ref.scale[i] + 1e-30) << what << ", element " << i;
    max_abs = std::max(max_abs, std::abs(ref.value[i]));
    max_scale = std::max(max_scale, ref.scale[i]);
  }
  // An output with no terms at all (N = 0 overwriting the weight gradient)
  // is exactly zero, which the 1e-30 bound above already demands.
  if (max_scale > 0) {
    EXPECT_GT(max_abs, 0.1) << what << ": reference is (near) zero; the comparison would be vacuous";
  }
}

struct Case {
  const char* name;
  int64_t G, K, M;  // weights [G, M, K]: forward [N, K] -> [N, M], data gradient [N, M] -> [N, K]
  Segments segs;
};

// Shapes small enough for the naive loop; segments chosen for the rules.
std::vector<Case> cases() {
  return {
      {"one segment per group", 4, 24, 40, {{0, 7}, {1, 33}, {2, 1}, {3, 20}}},
      {"empty segments, unused group", 5, 17, 9, {{0, 0}, {2, 12}, {4, 0}, {1, 5}, {2, 0}}},
      // The expert-parallel layout: by source rank, then expert; groups repeat.
      {"repeated groups", 3, 16, 24, {{0, 6}, {1, 9}, {2, 4}, {0, 11}, {2, 3}, {1, 2}, {0, 5}}},
      {"segment split into items", 3, 12, 20, {{1, 2500}, {0, 30}, {1, 1100}, {2, 3}}},
      {"one group, one segment", 1, 33, 31, {{0, 1500}}},
      {"N = 0, no segments", 3, 8, 6, {}},
      {"N = 0, empty segments", 3, 8, 6, {{0, 0}, {2, 0}}},
  };
}

// All products on every case, overwrite and accumulate (and a scaling beta).
TEST(KernelsGroupedGemm, MatchesNaiveReference) {
  std::mt19937 rng(2024);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const int64_t N = total_rows(c.segs);
    const Tensor X = randn({N, c.K}, rng), W = randn({c.G, c.M, c.K}, rng), Wn = randn({c.G, c.M, c.K}, rng);
    const Tensor dY = randn({N, c.M}, rng);
    for (const float beta : {0.0f, 1.0f, 0.5f}) {
      SCOPED_TRACE(::testing::Message() << "beta " << beta);
      // forward: Y = X·Wᵀ
      const Tensor Y0 = randn({N, c.M}, rng);
      Guarded Y({N, c.M});
      beta == 0.0f ? Y.fill_nan() : Y.fill(Y0);
      grouped_gemm(ctx, X, W, Trans::yes, c.segs, Y.view, beta);
      expect_close(Y.view, naive_rows(X, W, Trans::yes, c.segs, Y0, beta), "forward");
      Y.expect_intact("forward");
      // data gradient: dX = dY·W
      const Tensor dX0 = randn({N, c.K}, rng);
      Guarded dX({N, c.K});
      beta == 0.0f ? dX.fill_nan() : dX.fill(dX0);
      grouped_gemm(ctx, dY, Wn, Trans::no, c.segs, dX.view, beta);
      expect_close(dX.view, naive_rows(dY, Wn, Trans::no, c.segs, dX0, beta), "data gradient");
      dX.expect_intact("data gradient");
      // weight gradient: dW[g] = beta·dW[g] + Σ dYᵀ·X (beta = 0 zeroes unused groups)
      const Tensor dW0 = randn({c.G, c.M, c.K}, rng);
      Guarded dW({c.G, c.M, c.K});
      beta == 0.0f ? dW.fill_nan() : dW.fill(dW0);
      grouped_gemm_wgrad(ctx, dY, X, c.segs, dW.view, beta);
      expect_close(dW.view, naive_wgrad(dY, X, c.segs, dW0, beta), "weight gradient");
      dW.expect_intact("weight gradient");
    }
  }
}

// Accumulating into a group no segment names leaves it bitwise untouched.
TEST(KernelsGroupedGemm, WeightGradientLeavesUnusedGroupsAlone) {
  std::mt19937 rng(7);
  const Segments segs{{2, 9}, {0, 0}, {2, 4}};
  const Tensor dY = randn({13, 5}, rng), X = randn({13, 6}, rng), dW0 = randn({3, 5, 6}, rng);
  Tensor dW = make({3, 5, 6});
  dW.copy_from(dW0);
  grouped_gemm_wgrad(ctx, dY, X, segs, dW, 1.0f);
  EXPECT_EQ(0, std::memcmp(dW.f32(), dW0.f32(), 2 * 5 * 6 * sizeof(float))) << "groups 0 and 1 changed";
  EXPECT_NE(0, std::memcmp(dW.f32() + 2 * 30, dW0.f32() + 2 * 30, 30 * sizeof(float))) << "group 2 unchanged";
}

// Every output of one call sequence, at a given thread count.
std::vector<float> run_all(const Case& c, int threads, bool per_segment_gemm) {
  std::mt19937 rng(99);
  const int64_t N = total_rows(c.segs);
  const Tensor X = randn({N, c.K}, rng), W = randn({c.G, c.M, c.K}, rng), Wn = randn({c.G, c.M, c.K}, rng);
  const Tensor dY = randn({N, c.M}, rng);
  Tensor Y = make({N, c.M}), dX = randn({N, c.K}, rng), dW = randn({c.G, c.M, c.K}, rng);
  const ExecContext local = ExecContext::cpu(threads);
  const ExecContext& ctx = local;
  if (!per_segment_gemm) {
    grouped_gemm(ctx, X, W, Trans::yes, c.segs, Y);
    grouped_gemm(ctx, dY, Wn, Trans::no, c.segs, dX, 1.0f);
    grouped_gemm_wgrad(ctx, dY, X, c.segs, dW, 1.0f);
  } else {  // the experts' former loop: one gemm per non-empty segment, in order
    int64_t off = 0;
    for (const auto [g, n] : c.segs) {
      if (n == 0) continue;
      Tensor y = Y.slice(off, n), dx = dX.slice(off, n);
      Tensor dw = dW.flat_view(g * c.M * c.K, c.M * c.K, {c.M, c.K});
      gemm(ctx, X.slice(off, n), Trans::no, W.flat_view(g * c.M * c.K, c.M * c.K, {c.M, c.K}), Trans::yes, y);
      gemm(ctx, dY.slice(off, n), Trans::no, Wn.flat_view(g * c.M * c.K, c.M * c.K, {c.M, c.K}), Trans::no, dx, 1.0f,
           1.0f);
      gemm(ctx, dY.slice(off, n), Trans::yes, X.slice(off, n), Trans::no, dw, 1.0f, 1.0f);
      off += n;
    }
  }
  std::vector<float> out;
  for (const Tensor& t : {Y, dX, dW}) out.insert(out.end(), t.f32(), t.f32() + t.numel());
  return out;
}

void expect_bitwise(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << what << ", element " << i;
}

// Per segment (few or large segments): bitwise the per-segment gemm loop at
// the same thread count. "bench-like" holds shapes where a threaded
// dnnl_sgemm itself differs between thread counts (1-row products,
// 64 × 704 × 512).
TEST(KernelsGroupedGemm, PerSegmentScheduleIsTheLoopAtEveryThreadCount) {
  std::vector<Case> cs = cases();
  cs.push_back({"bench-like", 3, 512, 704, {{0, 64}, {1, 1}, {2, 200}, {0, 64}}});
  for (const Case& c : cs) {
    SCOPED_TRACE(c.name);
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(threads);
      expect_bitwise(run_all(c, threads, true), run_all(c, threads, false), "grouped vs per-segment gemm");
    }
  }
}

// Many small segments run as single-threaded items in parallel: bitwise the
// loop at one thread, whatever the thread count.
TEST(KernelsGroupedGemm, ItemScheduleIsTheOneThreadLoopAtEveryThreadCount) {
  Segments many;
  for (int i = 0; i < 40; ++i) many.push_back({i % 7, 1 + (i * 37) % 90});
  const Case c{"many small segments", 7, 48, 40, many};
  const std::vector<float> loop = run_all(c, 1, true);
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    expect_bitwise(loop, run_all(c, threads, false), "grouped vs one-thread per-segment gemm");
  }
}

TEST(KernelsGroupedGemm, RejectsBadSegments) {
  std::mt19937 rng(3);
  const Tensor X = randn({10, 4}, rng), W = randn({2, 6, 4}, rng);
  Tensor Y = make({10, 6}), dW = make({2, 6, 4});
  const Segments short_segs{{0, 4}, {1, 5}}, bad_group{{0, 4}, {2, 6}};
  EXPECT_DEATH(grouped_gemm(ctx, X, W, Trans::yes, short_segs, Y), "segments cover 9 rows but the operand has 10");
  EXPECT_DEATH(grouped_gemm(ctx, X, W, Trans::yes, bad_group, Y), "segment group 2 outside \\[0, 2\\)");
  EXPECT_DEATH(grouped_gemm(ctx, X, W, Trans::no, Segments{{0, 10}}, Y), "X \\[10, 4\\] should be \\[N, 6\\]");
  EXPECT_DEATH(grouped_gemm_wgrad(ctx, Y, X, short_segs, dW), "segments cover 9 rows");
}

}  // namespace
}  // namespace origami
