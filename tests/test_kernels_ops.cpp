// CPU kernels against naive double-precision references (ARCHITECTURE.md §9):
// gemm, rmsnorm, rope, swiglu, embedding, cross-entropy, adamw, elementwise.
// Inputs are fresh random values, never all zeros, and every test asserts its
// outputs are non-zero so it cannot pass on an op that writes nothing. Where
// inputs are small integers the reference is exact and so is the comparison.
// Attention, init and the vectorized exp have their own files.
#include <dirent.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/cpu/ops.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "test_context.h"

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

std::vector<double> ref_gemm(const Tensor& A, Trans ta, const Tensor& B, Trans tb, const std::vector<double>& C0,
                             int64_t M, int64_t N, int64_t K, double alpha, double beta) {
  std::vector<double> C(M * N);
  const int64_t lda = A.cols(), ldb = B.cols();
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = ta == Trans::no ? A.f32()[i * lda + k] : A.f32()[k * lda + i];
        const double b = tb == Trans::no ? B.f32()[k * ldb + j] : B.f32()[j * ldb + k];
        s += a * b;
      }
      C[i * N + j] = alpha * s + beta * C0[i * N + j];
    }
  return C;
}

TEST(Gemm, AllTransposesAlphaBetaExactOnIntegers) {
  std::mt19937 g(1);
  const int64_t M = 37, N = 29, K = 45;  // odd sizes: no kernel-friendly multiples
  for (Trans ta : {Trans::no, Trans::yes})
    for (Trans tb : {Trans::no, Trans::yes}) {
      Tensor A = ta == Trans::no ? randint({M, K}, g, -4, 4) : randint({K, M}, g, -4, 4);
      Tensor B = tb == Trans::no ? randint({K, N}, g, -4, 4) : randint({N, K}, g, -4, 4);
      Tensor C = randint({M, N}, g, -8, 8);
      const std::vector<double> C0 = to_double(C);
      // |Σ| <= 45·16 and alpha, beta are short binary fractions: every
      // intermediate is exact in fp32, so the comparison is exact.
      gemm(ctx, A, ta, B, tb, C, 0.5f, -1.5f);
      const auto want = ref_gemm(A, ta, B, tb, C0, M, N, K, 0.5, -1.5);
      for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(C.f32()[i], want[i]) << "ta/tb " << int(ta) << int(tb) << " @" << i;
      EXPECT_GT(count_nonzero(C), M * N / 2);
      // beta = 0 overwrites, even over NaN (BLAS semantics).
      for (int64_t i = 0; i < M * N; ++i) C.f32()[i] = std::nanf("");
      gemm(ctx, A, ta, B, tb, C);
      const auto want0 = ref_gemm(A, ta, B, tb, std::vector<double>(M * N, 0.0), M, N, K, 1.0, 0.0);
      for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(C.f32()[i], want0[i]);
    }
}

TEST(Gemm, RandomNormalRank3ReadsAsMatrix) {
  std::mt19937 g(2);
  Tensor A = randn({3, 50, 64}, g), B = randn({70, 64}, g), C = make({3, 50, 70});
  gemm(ctx, A, Trans::no, B, Trans::yes, C);
  const auto want = ref_gemm(A.view({150, 64}), Trans::no, B, Trans::yes, std::vector<double>(150 * 70), 150, 70,
                             64, 1.0, 0.0);
  // fp32 dot products of 64 unit normals: error ~ sqrt(64)·ulp·|terms|.
  EXPECT_LT(rel_err(C, want), 1e-6);
  EXPECT_EQ(count_nonzero(C), C.numel());
}

TEST(Gemm, KZeroScalesC) {
  std::mt19937 g(3);
  Tensor A = make({4, 0}), B = make({0, 5}), C = randint({4, 5}, g, 1, 9);
  const auto c0 = to_double(C);
  gemm(ctx, A, Trans::no, B, Trans::no, C, 1.0f, 2.0f);
  for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(C.f32()[i], 2.0 * c0[i]);
}

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
  std::mt19937 g(4);
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
    const auto want = ref_gemm(A[t], Trans::no, B[t], Trans::yes, std::vector<double>(n * n), n, n, n, 1.0, 0.0);
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

std::vector<double> ref_rmsnorm(const std::vector<double>& x, const std::vector<double>& w, int64_t T, int64_t D,
                                double eps) {
  std::vector<double> y(T * D);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += x[t * D + i] * x[t * D + i];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) y[t * D + i] = x[t * D + i] * r * w[i];
  }
  return y;
}

TEST(RmsNorm, ForwardBackwardAgainstDoubleAndFiniteDifferences) {
  std::mt19937 g(5);
  const int64_t T = 13, D = 67;
  const float eps = 1e-5f;
  Tensor x = randn({T, D}, g, 2.0f), w = randn({D}, g), dy = randn({T, D}, g);
  Tensor y = make({T, D}), rstd = make({T});
  rmsnorm_forward(ctx, x, w, eps, y, rstd);
  const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  // fp32 sum of 67 squares, then rsqrt: a few ulp.
  EXPECT_LT(rel_err(y, ref_rmsnorm(xd, wd, T, D, eps)), 2e-6);
  EXPECT_EQ(count_nonzero(y), T * D);

  Tensor dx = make({T, D}), dw = randn({D}, g);
  const auto dw0 = to_double(dw);
  Tensor ws = ctx.workspace(rmsnorm_backward_workspace_bytes(ctx, T, D));
  rmsnorm_backward(ctx, dy, x, w, rstd, dx, dw, ws);

  // dx against central differences of the double forward (an independent
  // derivation, not a restatement of the kernel's formula). L = Σ dy ⊙ y.
  auto loss = [&](const std::vector<double>& xs) {
    const auto ys = ref_rmsnorm(xs, wd, T, D, eps);
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

  // dw accumulates: dw = dw0 + Σ_t dy ⊙ x·r.
  std::vector<double> want_dw(dw0);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += xd[t * D + i] * xd[t * D + i];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) want_dw[i] += dyd[t * D + i] * xd[t * D + i] * r;
  }
  EXPECT_LT(rel_err(dw, want_dw), 2e-6);
}

// ---------------------------------------------------------------- rope

TEST(Rope, ForwardMatchesDoubleAtLargePositionsAndBackwardIsInverseAndAdjoint) {
  std::mt19937 g(6);
  const int64_t B = 2, S = 6, H = 3, hd = 64;
  const float theta = 10000.0f;
  const std::vector<int32_t> positions{5, 17, 1000, 3, 70000, 123};  // non-contiguous, CP-style
  Tensor pos = ints(positions);
  Tensor x = randn({B, S, H, hd}, g);
  const auto xd = to_double(x);
  Tensor y = clone(x);
  rope_forward(ctx, y, pos, theta);

  std::vector<double> want(xd.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const int64_t base = ((b * S + s) * H + h) * hd;
          const double ang = positions[s] * std::pow(10000.0, -2.0 * i / hd);
          const double a = xd[base + i], c = xd[base + i + hd / 2];
          want[base + i] = a * std::cos(ang) - c * std::sin(ang);
          want[base + i + hd / 2] = c * std::cos(ang) + a * std::sin(ang);
        }
  // cos/sin rounded to fp32 once, then two products and a sum.
  EXPECT_LT(rel_err(y, want), 1e-6);
  EXPECT_EQ(count_nonzero(y), y.numel());

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

// ---------------------------------------------------------------- swiglu

TEST(SwiGlu, ForwardBackwardAgainstDoubleAndFiniteDifferences) {
  std::mt19937 g(7);
  const int64_t T = 9, F = 53;
  Tensor gate = randn({T, F}, g, 3.0f), up = randn({T, F}, g), dh = randn({T, F}, g);
  gate.f32()[0] = 95.0f;   // saturated σ = 1
  gate.f32()[1] = -95.0f;  // saturated σ = 0
  Tensor h = make({T, F}), dgate = make({T, F}), dup = make({T, F});
  swiglu_forward(ctx, gate, up, h);
  swiglu_backward(ctx, dh, gate, up, dgate, dup);
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  std::vector<double> want_h(T * F), want_dg(T * F), want_du(T * F);
  for (int64_t i = 0; i < T * F; ++i) {
    const double gv = gate.f32()[i], uv = up.f32()[i], d = dh.f32()[i];
    want_h[i] = silu(gv) * uv;
    want_du[i] = d * silu(gv);
    const double step = 1e-4 * std::max(1.0, std::abs(gv));  // central difference of silu in double
    want_dg[i] = d * uv * (silu(gv + step) - silu(gv - step)) / (2 * step);
  }
  // exp_fast is within 2e-7 relative; one division and two products follow.
  EXPECT_LT(rel_err(h, want_h), 1e-6);
  EXPECT_LT(rel_err(dup, want_du), 1e-6);
  EXPECT_LT(rel_err(dgate, want_dg), 1e-6);  // differencing error ~1e-9 at this step
  EXPECT_GT(count_nonzero(h), T * F - 2);
  EXPECT_GT(count_nonzero(dgate), T * F - 2);
}

// ---------------------------------------------------------------- embedding

TEST(Embedding, ShardOffsetOutOfShardIdsAndRepeatedIds) {
  std::mt19937 g(8);
  const int64_t V = 10, D = 37, vocab_start = 20;
  // 20..29 are in this shard; 5 and 35 belong to other shards; 23 repeats.
  const std::vector<int32_t> id_v{23, 5, 29, 23, 20, 35, 23, 21};
  const int64_t T = static_cast<int64_t>(id_v.size());
  Tensor ids = ints(id_v);
  Tensor table = randn({V, D}, g), out = make({T, D});
  for (int64_t i = 0; i < out.numel(); ++i) out.f32()[i] = std::nanf("");  // must be overwritten
  embedding_forward(ctx, ids, table, vocab_start, out);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = id_v[t] - vocab_start;
    for (int64_t c = 0; c < D; ++c)
      ASSERT_EQ(out.f32()[t * D + c], (row >= 0 && row < V) ? table.f32()[row * D + c] : 0.0f) << t << "," << c;
  }
  EXPECT_EQ(count_nonzero(out), (T - 2) * D);

  Tensor dout = randint({T, D}, g, -5, 5), dtable = randint({V, D}, g, -5, 5);
  std::vector<double> want = to_double(dtable);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = id_v[t] - vocab_start;
    if (row < 0 || row >= V) continue;
    for (int64_t c = 0; c < D; ++c) want[row * D + c] += dout.f32()[t * D + c];
  }
  embedding_backward(ctx, ids, dout, vocab_start, dtable);
  for (int64_t i = 0; i < V * D; ++i) ASSERT_EQ(dtable.f32()[i], want[i]) << i;  // integers: exact
  EXPECT_GT(count_nonzero(dtable), 0);
}

// ---------------------------------------------------------------- cross-entropy

TEST(CrossEntropy, ForwardBackwardInPlaceAndFiniteDifferences) {
  std::mt19937 g(9);
  const int64_t T = 9, V = 1001;
  Tensor logits = randn({T, V}, g, 3.0f);
  std::vector<int32_t> tv(T);
  std::uniform_int_distribution<int32_t> pick(0, V - 1);
  for (auto& t : tv) t = pick(g);
  tv[0] = V - 1;  // last column: the tail of any vector loop
  Tensor targets = ints(tv), loss = make({T}), lse = make({T});
  cross_entropy_forward(ctx, logits, targets, loss, lse);

  auto ref_loss = [&](const std::vector<double>& x, int64_t t, double* lse_out) {
    double mx = -INFINITY, se = 0.0;
    for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[t * V + i]);
    for (int64_t i = 0; i < V; ++i) se += std::exp(x[t * V + i] - mx);
    if (lse_out) *lse_out = mx + std::log(se);
    return mx + std::log(se) - x[t * V + tv[t]];
  };
  const auto xd = to_double(logits);
  std::vector<double> want_loss(T), want_lse(T);
  for (int64_t t = 0; t < T; ++t) want_loss[t] = ref_loss(xd, t, &want_lse[t]);
  // Float sum of 1001 terms <= 1 plus exp_fast's 2e-7: ~1e-6 of lse ≈ 10.
  EXPECT_LT(rel_err(lse, want_lse), 1e-6);
  for (int64_t t = 0; t < T; ++t) EXPECT_NEAR(loss.f32()[t], want_loss[t], 2e-5 * std::abs(want_lse[t]));
  EXPECT_EQ(count_nonzero(loss), T);

  const float scale = 0.37f;
  Tensor dlogits = make({T, V});
  cross_entropy_backward(ctx, logits, targets, lse, scale, dlogits);
  std::vector<double> want_d(T * V);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < V; ++i)
      want_d[t * V + i] = scale * (std::exp(xd[t * V + i] - want_lse[t]) - (i == tv[t] ? 1.0 : 0.0));
  EXPECT_LT(rel_err(dlogits, want_d), 2e-6);
  EXPECT_EQ(count_nonzero(dlogits), T * V);

  // Finite differences of scale · Σ_t loss_t at a few logits, target ones included.
  for (int64_t probe : {int64_t{0} * V + tv[0], int64_t{3} * V + 17, int64_t{8} * V + tv[8], int64_t{5} * V + V - 1}) {
    auto xp = xd, xm = xd;
    const double h = 1e-5;
    xp[probe] += h;
    xm[probe] -= h;
    const int64_t t = probe / V;
    const double fd = scale * (ref_loss(xp, t, nullptr) - ref_loss(xm, t, nullptr)) / (2 * h);
    EXPECT_NEAR(dlogits.f32()[probe], fd, 1e-6) << "logit " << probe;
  }

  // In place: dlogits aliasing logits gives bitwise the same result.
  Tensor inplace = clone(logits);
  cross_entropy_backward(ctx, inplace, targets, lse, scale, inplace);
  for (int64_t i = 0; i < T * V; ++i) ASSERT_EQ(inplace.f32()[i], dlogits.f32()[i]) << i;
}

// ---------------------------------------------------------------- adamw

TEST(AdamW, ThreeStepsMatchTorchFormulaInDouble) {
  std::mt19937 g(10);
  const int64_t n = 1003;
  Tensor p = randn({n}, g), m = make({n}), v = make({n});
  m.fill_zero();
  v.fill_zero();
  std::vector<double> pd = to_double(p), md(n, 0.0), vd(n, 0.0);
  AdamWStep s;
  s.lr = 1e-2f;
  s.beta1 = 0.9f;
  s.beta2 = 0.95f;
  s.eps = 1e-8f;
  s.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor grad = randn({n}, g, 0.5f);
    s.step = step;
    const std::vector<double> p_before = to_double(p), pd_before = pd;
    adamw_update(ctx, p, grad, m, v, s);
    // torch.optim.AdamW (foreach=False), written out in double.
    const double b1 = s.beta1, b2 = s.beta2, lr = s.lr, wd = s.weight_decay, eps = s.eps;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = grad.f32()[i];
      pd[i] *= 1 - lr * wd;
      md[i] = b1 * md[i] + (1 - b1) * gi;
      vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
      pd[i] -= lr / bc1 * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + eps);
    }
    // fp32 state over 3 steps: each term carries ~1e-7 relative rounding.
    EXPECT_LT(rel_err(m, md), 1e-6) << "step " << step;
    EXPECT_LT(rel_err(v, vd), 1e-6) << "step " << step;
    EXPECT_LT(rel_err(p, pd), 1e-6) << "step " << step;
    // The step itself (O(lr), small next to |p|) must match too: fp32
    // rounding of p (~1e-7·|p|) against steps of ~1e-2 allows ~1e-5.
    Tensor delta = make({n});
    std::vector<double> want_delta(n);
    for (int64_t i = 0; i < n; ++i) {
      delta.f32()[i] = static_cast<float>(p.f32()[i] - p_before[i]);
      want_delta[i] = pd[i] - pd_before[i];
    }
    EXPECT_LT(rel_err(delta, want_delta), 1e-4) << "step " << step;
    EXPECT_EQ(count_nonzero(delta), n);
  }
  EXPECT_EQ(count_nonzero(p), n);
  EXPECT_EQ(count_nonzero(m), n);
}

// ---------------------------------------------------------------- elementwise

TEST(Elementwise, AxpyAddScaleAndFp64Reductions) {
  std::mt19937 g(11);
  const int64_t n = 100003;
  Tensor x = randint({n}, g, -9, 9), y = randint({n}, g, -9, 9);
  const auto x0 = to_double(x), y0 = to_double(y);
  add_inplace(ctx, y, x);
  axpy(ctx, -2.5f, x, y);
  scale_inplace(ctx, y, 0.5f);
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = (y0[i] + x0[i] - 2.5 * x0[i]) * 0.5;
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y.f32()[i], want[i]) << i;  // short binary fractions: exact
  EXPECT_GT(count_nonzero(y), n / 2);

  Tensor r = randn({n}, g, 3.0f);
  double ss = 0.0, s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    ss += static_cast<double>(r.f32()[i]) * r.f32()[i];
    s += r.f32()[i];
  }
  // Both sides sum fp32 values in double, in different orders.
  EXPECT_NEAR(sum_squares(ctx, r), ss, 2e-11 * ss);  // n·eps bound for positive terms
  double mag = 0.0;
  for (int64_t i = 0; i < n; ++i) mag += std::abs(r.f32()[i]);
  EXPECT_NEAR(sum(ctx, r), s, 2e-11 * mag);
  EXPECT_GT(ss, 0.0);
  // Reproducible: same input, same thread count, bitwise the same result.
  EXPECT_EQ(sum_squares(ctx, r), sum_squares(ctx, r));
}

}  // namespace
}  // namespace origami
