// Kernel checks beyond a plain reference comparison (those live in the op ×
// backend harness, tests/backend_ops/): sgemm_raw inside a parallel region
// (no nested team, concurrent calls correct), gemm's shape error message,
// rmsnorm's and cross-entropy's backward against finite differences of an
// fp64 forward, rmsnorm's split backward bitwise its fused one, cross-entropy backward in place, rope's backward as the
// inverse and the adjoint of its forward, add_inplace, and reductions that
// reproduce bitwise. Attention, MoE routing, grouped GEMM, init and the
// vectorized exp have their own files.
#include <dirent.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "naive_ops.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

Tensor make(Shape s) { return Tensor::empty(std::move(s), DType::f32, MemCategory::activation); }

Tensor randn(Shape s, std::mt19937& g, float std = 1.0f) {
  Tensor t = make(std::move(s));
  std::normal_distribution<float> nd(0.0f, std);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

// Small integers: products and sums stay exact in fp32.
Tensor randint(Shape s, std::mt19937& g, int lo, int hi) {
  Tensor t = make(std::move(s));
  std::uniform_int_distribution<int> d(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = static_cast<float>(d(g));
  return t;
}

Tensor ints(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::activation);
  for (size_t i = 0; i < v.size(); ++i) t.i32()[i] = v[i];
  return t;
}

Tensor clone(const Tensor& x) {
  Tensor t = make(x.shape());
  t.copy_from(x);
  return t;
}

std::vector<double> to_double(const Tensor& t) { return std::vector<double>(t.f32(), t.f32() + t.numel()); }

int64_t count_nonzero(const Tensor& t) {
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += t.f32()[i] != 0.0f;
  return n;
}

// max |got − want| / (abs_floor + max |want|): one scale per tensor.
double rel_err(const Tensor& got, const std::vector<double>& want, double abs_floor = 1e-30) {
  EXPECT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  double err = 0.0, scale = abs_floor;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got.f32()[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

// ---------------------------------------------------------------- gemm

int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Attention calls sgemm_raw from inside its own parallel region. Even with
// nesting enabled, oneDNN must not open a nested team there (it would
// oversubscribe the cores), and concurrent calls must not interfere. A
// watcher thread samples this process's thread count while the calls run
// (nested teams' threads exit with their region, so counting afterwards
// would see nothing).
TEST(Gemm, RawInsideParallelRegionIsSingleThreadedAndCorrect) {
  std::mt19937 g(testing::test_seed(4));
  const int nt = std::max(2, omp_get_max_threads());
  const int64_t n = 384;  // big enough that oneDNN would split it if allowed
  std::vector<Tensor> A, B, C;
  for (int t = 0; t < nt; ++t) {
    A.push_back(randint({n, n}, g, -3, 3));
    B.push_back(randint({n, n}, g, -3, 3));
    C.push_back(make({n, n}));
  }
#pragma omp parallel num_threads(nt)
  { (void)omp_get_thread_num(); }  // create the pool before counting threads
  std::atomic<bool> done{false};
  std::atomic<int> peak{0};
  std::thread watcher([&] {
    while (!done) {
      peak = std::max(peak.load(), thread_count());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const int before = peak.load();
  const int saved_levels = omp_get_max_active_levels();
  omp_set_max_active_levels(4);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    for (int rep = 0; rep < 10; ++rep)
      cpu::sgemm_raw(Trans::no, Trans::yes, n, n, n, 1.0f, A[t].f32(), n, B[t].f32(), n, 0.0f, C[t].f32(), n);
  }
  omp_set_max_active_levels(saved_levels);
  done = true;
  watcher.join();
  EXPECT_EQ(peak.load(), before) << "a nested OpenMP team was created inside sgemm_raw";
  for (int t = 0; t < nt; ++t) {
    const auto want =
        testing::ref_gemm(A[t], Trans::no, B[t], Trans::yes, std::vector<double>(n * n), n, n, n, 1.0, 0.0);
    for (int64_t i = 0; i < n * n; ++i) ASSERT_EQ(C[t].f32()[i], want[i]) << "thread " << t;
    EXPECT_GT(count_nonzero(C[t]), 0);
  }
}

TEST(GemmDeathTest, MismatchedInnerDimensionNamesShapes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Tensor A = make({4, 5}), B = make({6, 7}), C = make({4, 7});
  EXPECT_DEATH(gemm(ctx, A, Trans::no, B, Trans::no, C), "inner dimensions differ.*\\[4, 5\\]");
}

// ---------------------------------------------------------------- rmsnorm

TEST(RmsNorm, BackwardDataGradientMatchesFiniteDifferencesOfForward) {
  std::mt19937 g(testing::test_seed(5));
  const int64_t T = 13, D = 67;
  const float eps = 1e-5f;
  Tensor x = randn({T, D}, g, 2.0f), w = randn({D}, g), dy = randn({T, D}, g);
  Tensor y = make({T, D}), rstd = make({T});
  rmsnorm_forward(ctx, x, w, eps, y, rstd);
  const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  Tensor dx = make({T, D}), dw = randn({D}, g);
  Tensor ws = ctx.workspace(rmsnorm_backward_workspace_bytes(ctx, T, D));
  rmsnorm_backward(ctx, dy, x, w, rstd, dx, dw, ws);

  // dx against central differences of the double forward (an independent
  // derivation, not a restatement of the kernel's formula). L = Σ dy ⊙ y.
  auto loss = [&](const std::vector<double>& xs) {
    const auto ys = testing::ref_rmsnorm(xs, wd, T, D, eps);
    double l = 0.0;
    for (int64_t i = 0; i < T * D; ++i) l += dyd[i] * ys[i];
    return l;
  };
  std::vector<double> want_dx(T * D);
  for (int64_t i = 0; i < T * D; ++i) {
    auto xp = xd, xm = xd;
    const double h = 1e-5;
    xp[i] += h;
    xm[i] -= h;
    want_dx[i] = (loss(xp) - loss(xm)) / (2 * h);
  }
  EXPECT_LT(rel_err(dx, want_dx), 2e-5);  // fp32 kernel vs O(h²) + 1e-11/h differencing noise
  EXPECT_EQ(count_nonzero(dx), T * D);
}

// The backward's two halves (input, deferred weight) are bitwise the fused
// kernel at every thread count: the split moves dw to a second call, it does
// not change one rounding (kernels/deferred.h relies on it).
TEST(RmsNorm, InputAndWeightHalvesAreBitwiseTheFusedBackward) {
  std::mt19937 g(testing::test_seed(6));
  for (auto [T, D] : {std::pair<int64_t, int64_t>{13, 67}, {1, 1}, {97, 256}})
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE("T " + std::to_string(T) + ", D " + std::to_string(D) + ", threads " + std::to_string(threads));
      const ExecContext c = ExecContext::cpu(threads);
      Tensor x = randn({T, D}, g, 2.0f), w = randn({D}, g), dy = randn({T, D}, g);
      Tensor y = make({T, D}), rstd = make({T});
      rmsnorm_forward(c, x, w, 1e-5f, y, rstd);
      Tensor dx_fused = make({T, D}), dx_split = make({T, D});
      Tensor dw_fused = randn({D}, g), dw_split = make({D});
      dw_split.copy_from(dw_fused);  // both accumulate onto the same start
      Tensor ws = c.workspace(rmsnorm_backward_workspace_bytes(c, T, D));
      rmsnorm_backward(c, dy, x, w, rstd, dx_fused, dw_fused, ws);
      rmsnorm_backward_input(c, dy, x, w, rstd, dx_split);
      Tensor ws_w = c.workspace(rmsnorm_backward_weight_workspace_bytes(c, T, D));
      rmsnorm_backward_weight(c, dy, x, rstd, dw_split, ws_w);
      EXPECT_TRUE(std::equal(dx_fused.f32(), dx_fused.f32() + T * D, dx_split.f32()));
      EXPECT_TRUE(std::equal(dw_fused.f32(), dw_fused.f32() + D, dw_split.f32()));
      EXPECT_EQ(count_nonzero(dx_split), T * D);
    }
}

// ---------------------------------------------------------------- rope

TEST(Rope, BackwardIsTheInverseAndTheAdjointOfForward) {
  std::mt19937 g(testing::test_seed(6));
  const int64_t B = 2, S = 6, H = 3, hd = 64;
  const float theta = 10000.0f;
  Tensor pos = ints({5, 17, 1000, 3, 70000, 123});  // non-contiguous, CP-style
  Tensor x = randn({B, S, H, hd}, g);
  const auto xd = to_double(x);
  Tensor y = clone(x);
  rope_forward(ctx, y, pos, theta);
  EXPECT_GT(rel_err(y, xd), 0.1) << "the forward did not rotate";

  Tensor back = clone(y);
  rope_backward(ctx, back, pos, theta);
  EXPECT_LT(rel_err(back, xd), 1e-6);  // R(−θ)·R(θ) = I up to fp32 rounding

  // Adjoint: <R x, z> = <x, Rᵀ z> for an unrelated z.
  Tensor z = randn({B, S, H, hd}, g);
  Tensor rtz = clone(z);
  rope_backward(ctx, rtz, pos, theta);
  double lhs = 0.0, rhs = 0.0, mag = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    lhs += static_cast<double>(y.f32()[i]) * z.f32()[i];
    rhs += static_cast<double>(x.f32()[i]) * rtz.f32()[i];
    mag += std::abs(static_cast<double>(x.f32()[i]) * z.f32()[i]);
  }
  EXPECT_LT(std::abs(lhs - rhs), 1e-6 * mag);
  EXPECT_GT(std::abs(lhs), 0.0);
}

// ---------------------------------------------------------------- cross-entropy

TEST(CrossEntropy, BackwardMatchesFiniteDifferencesAndRunsInPlace) {
  std::mt19937 g(testing::test_seed(9));
  const int64_t T = 9, V = 1001;
  Tensor logits = randn({T, V}, g, 3.0f);
  std::vector<int32_t> tv(T);
  std::uniform_int_distribution<int32_t> pick(0, V - 1);
  for (auto& t : tv) t = pick(g);
  tv[0] = V - 1;  // last column: the tail of any vector loop
  Tensor targets = ints(tv), loss = make({T}), lse = make({T});
  cross_entropy_forward(ctx, logits, targets, loss, lse);
  const float scale = 0.37f;
  Tensor dlogits = make({T, V});
  cross_entropy_backward(ctx, logits, targets, lse, scale, dlogits);
  EXPECT_EQ(count_nonzero(dlogits), T * V);

  // Finite differences of scale · Σ_t loss_t at a few logits, target ones included.
  const auto xd = to_double(logits);
  for (int64_t probe : {int64_t{0} * V + tv[0], int64_t{3} * V + 17, int64_t{8} * V + tv[8], int64_t{5} * V + V - 1}) {
    auto xp = xd, xm = xd;
    const double h = 1e-5;
    xp[probe] += h;
    xm[probe] -= h;
    const int64_t t = probe / V;
    using testing::ref_cross_entropy_row;
    const double fd =
        scale * (ref_cross_entropy_row(xp, V, t, tv[t]) - ref_cross_entropy_row(xm, V, t, tv[t])) / (2 * h);
    // fp32 dlogits (exp_fast, 2e-7; lse's rounding) ~1e-6 relative; the
    // central difference in fp64 with h 1e-5 is good to ~1e-10 absolute.
    // Relative, so the non-target probes (|dlogit| ~1e-7..1e-5) count too.
    EXPECT_NEAR(dlogits.f32()[probe], fd, 1e-5 * std::abs(fd) + 1e-9) << "logit " << probe;
  }

  // In place: dlogits aliasing logits gives bitwise the same result.
  Tensor inplace = clone(logits);
  cross_entropy_backward(ctx, inplace, targets, lse, scale, inplace);
  for (int64_t i = 0; i < T * V; ++i) ASSERT_EQ(inplace.f32()[i], dlogits.f32()[i]) << i;
}

// ---------------------------------------------------------------- elementwise

// add_inplace is axpy with a = 1 above the backends; the fp64 reductions
// sum fixed per-thread blocks in order, so a repeat is bitwise the same.
TEST(Elementwise, AddInplaceAndReproducibleReductions) {
  std::mt19937 g(testing::test_seed(11));
  const int64_t n = 100003;
  Tensor x = randint({n}, g, -9, 9), y = randint({n}, g, -9, 9);
  const auto x0 = to_double(x), y0 = to_double(y);
  add_inplace(ctx, y, x);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y.f32()[i], y0[i] + x0[i]) << i;  // integers: exact
  EXPECT_GT(count_nonzero(y), n / 2);

  Tensor r = randn({n}, g, 3.0f);
  const double ss = sum_squares(ctx, r), s = sum(ctx, r);
  EXPECT_GT(ss, 0.0);
  EXPECT_EQ(sum_squares(ctx, r), ss);
  EXPECT_EQ(sum(ctx, r), s);
}

}  // namespace
}  // namespace origami
