// CPU tiled attention beyond a plain reference comparison (those, over GQA,
// context-parallel chunks, masked tiles, shuffled positions and lengths off
// the tile size, live in the op × backend harness,
// tests/backend_ops/ops_attention.cpp): the backward against finite
// differences of the forward, bitwise independence from the thread count,
// and a rate report against sgemm; on CUDA (skipped without a device) the
// same finite-difference check of the fp32 kernels and bitwise run-to-run
// reproducibility; on both, a row that sees no key beside an infinite value.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "kernels/device.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

Tensor make(Shape s) { return Tensor::empty(std::move(s), DType::f32, MemCategory::activation); }

Tensor randn(Shape s, std::mt19937& g) {
  Tensor t = make(std::move(s));
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

Tensor ints(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::activation);
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

std::vector<int32_t> iota(int32_t lo, int32_t hi) {  // [lo, hi)
  std::vector<int32_t> v(hi - lo);
  std::iota(v.begin(), v.end(), lo);
  return v;
}

struct Problem {
  AttentionDims d;
  std::vector<int32_t> qpos, kvpos;
  float scale;
  Tensor q, k, v, dO;
};

Problem make_problem(int64_t B, int64_t Hq, int64_t Hkv, int64_t hd, std::vector<int32_t> qpos,
                     std::vector<int32_t> kvpos, uint32_t seed) {
  Problem p;
  p.d = {B, static_cast<int64_t>(qpos.size()), static_cast<int64_t>(kvpos.size()), Hq, Hkv, hd};
  p.qpos = std::move(qpos);
  p.kvpos = std::move(kvpos);
  p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::mt19937 g(testing::test_seed(seed));
  p.q = randn({B, p.d.q_len, Hq, hd}, g);
  p.k = randn({B, p.d.kv_len, Hkv, hd}, g);
  p.v = randn({B, p.d.kv_len, Hkv, hd}, g);
  p.dO = randn({B, p.d.q_len, Hq, hd}, g);
  return p;
}

struct Result {
  std::vector<double> o, lse, dq, dk, dv;
};

std::vector<double> flat(const Tensor& t) { return std::vector<double>(t.f32(), t.f32() + t.numel()); }

Tensor nan_workspace(int64_t n) {
  Tensor ws = make({n});
  std::fill(ws.f32(), ws.f32() + n, std::nanf(""));
  return ws;
}

Result run_kernel(const Problem& p, bool backward = true, const ExecContext& ctx = testing::test_context()) {
  const AttentionDims& d = p.d;
  Tensor qp = ints(p.qpos), kp = ints(p.kvpos);
  Tensor o = make({d.batch, d.q_len, d.num_heads, d.head_dim}), lse = make({d.batch, d.num_heads, d.q_len});
  Tensor wf = nan_workspace(attention_forward_workspace_bytes(ctx, d) / 4);
  attention_forward(ctx, d, p.q, p.k, p.v, qp, kp, p.scale, o, lse, wf);
  Result r{flat(o), flat(lse), {}, {}, {}};
  if (!backward) return r;
  Tensor dq = make(p.q.shape()), dk = make(p.k.shape()), dv = make(p.v.shape());
  Tensor wb = nan_workspace(attention_backward_workspace_bytes(ctx, d) / 4);
  attention_backward(ctx, d, p.q, p.k, p.v, o, lse, p.dO, qp, kp, p.scale, dq, dk, dv, wb);
  r.dq = flat(dq);
  r.dk = flat(dk);
  r.dv = flat(dv);
  return r;
}

// Backward against central finite differences of forward, through `run`
// (a backend's forward, and backward when asked): context-parallel chunks of
// queries over 64 keys, GQA group 2; keys 48..63 are seen by no query.
void expect_backward_matches_finite_differences(const std::function<Result(const Problem&, bool)>& run) {
  auto qpos = iota(8, 16);
  auto tail = iota(40, 48);
  qpos.insert(qpos.end(), tail.begin(), tail.end());
  Problem p = make_problem(1, 4, 2, 16, qpos, iota(0, 64), 6);
  const Result base = run(p, true);
  // L = Σ o ⊙ dO, so ∂L/∂x is what backward returns for upstream gradient dO.
  auto loss = [&](const Problem& pp) {
    const Result r = run(pp, false);
    double l = 0.0;
    for (size_t i = 0; i < r.o.size(); ++i) l += r.o[i] * pp.dO.f32()[i];
    return l;
  };
  std::mt19937 g(testing::test_seed(7));
  const float h = 1e-2f;
  int checked = 0;
  for (Tensor Problem::*which : {&Problem::q, &Problem::k, &Problem::v}) {
    const std::vector<double>& grad = which == &Problem::q ? base.dq : which == &Problem::k ? base.dk : base.dv;
    std::uniform_int_distribution<int64_t> pick(0, (p.*which).numel() - 1);
    for (int probe = 0; probe < 8; ++probe) {
      const int64_t idx = pick(g);
      float& x = (p.*which).f32()[idx];
      const float x0 = x;
      x = x0 + h;
      const double lp = loss(p);
      x = x0 - h;
      const double lm = loss(p);
      x = x0;
      const double fd = (lp - lm) / (2.0 * h);
      // O(h²) truncation plus fp32 rounding of L over 2h: observed <= 3e-5 on the CPU.
      EXPECT_NEAR(grad[idx], fd, 1e-4 + 1e-3 * std::abs(fd)) << "element " << idx;
      checked += grad[idx] != 0.0;
    }
  }
  EXPECT_GT(checked, 12);  // keys 48..63 get a zero gradient; most probes are elsewhere
}

// The CUDA SIMT attention's shared memory (kernels/attention.h), which the
// config rules hold head_dim to on a GPU: at Hopper's 232448 bytes a block
// (227 KiB), head_dim 290's backward fits and 292's does not.
TEST(Attention, CudaSharedMemoryBoundsTheHeadDim) {
  constexpr size_t hopper = 232448;
  EXPECT_EQ(attention_cuda_max_head_dim(hopper), 290);
  EXPECT_LE(attention_cuda_backward_smem(290), hopper);
  EXPECT_GT(attention_cuda_backward_smem(292), hopper);
  EXPECT_LT(attention_cuda_forward_smem(292), attention_cuda_backward_smem(292));  // the backward binds
  EXPECT_EQ(attention_cuda_max_head_dim(attention_cuda_backward_smem(128)), 128);  // Mixtral's and Llama's
  EXPECT_EQ(attention_cuda_max_head_dim(101376), 118);  // sm_86/89's 99 KiB: bf16 128 takes tensor cores there
  EXPECT_TRUE(attention_cuda_on_tensor_cores(true, 128));
  EXPECT_FALSE(attention_cuda_on_tensor_cores(false, 128));
  EXPECT_GT(attention_cuda_max_head_dim(hopper, /*backward=*/false), 290);  // eval: the forward alone
  EXPECT_LE(attention_cuda_forward_smem(attention_cuda_max_head_dim(hopper, false)), hopper);
  EXPECT_EQ(attention_cuda_max_head_dim(0), 0);
}

TEST(Attention, BackwardMatchesFiniteDifferencesOfForward) {
  expect_backward_matches_finite_differences([](const Problem& p, bool backward) { return run_kernel(p, backward); });
}

TEST(Attention, ResultsDoNotDependOnThreadCount) {
  auto pos = iota(0, 200);
  Problem p = make_problem(2, 4, 2, 64, pos, pos, 8);
  const Result one = run_kernel(p, true, ExecContext::cpu(1));
  const Result many = run_kernel(p, true, ExecContext::cpu(std::max(3, ctx.threads())));
  // Work items own disjoint outputs and each is computed by one thread in a
  // fixed order, so the results are bitwise identical.
  EXPECT_EQ(one.o, many.o);
  EXPECT_EQ(one.lse, many.lse);
  EXPECT_EQ(one.dq, many.dq);
  EXPECT_EQ(one.dk, many.dk);
  EXPECT_EQ(one.dv, many.dv);
}

// ---- CUDA: the same finite-difference check of the fp32 (SIMT) kernels, and
// bitwise run-to-run reproducibility (no atomics, fixed reduction orders).

std::string no_cuda_reason() {
  if (!built_with_cuda()) return "built without CUDA";
  if (cuda_device_count() == 0) return "no CUDA device";
  return "";
}

const ExecContext& cuda_context() {
  static const ExecContext c = ExecContext::cuda(0);
  return c;
}

Tensor on(const ExecContext& c, const Tensor& host) { return host.to(c.device()); }
std::vector<double> flat_from(const ExecContext& c, const Tensor& t) {
  c.synchronize();
  return flat(t.to(Device::cpu()));
}

// The problem on cuda:0 with data of dtype dt (bf16 with head_dim 64 or
// 128: the tensor-core kernels; lse stays f32); results widened to f32.
Result run_cuda(const Problem& p, bool backward, DType dt = DType::f32) {
  const ExecContext& c = cuda_context();
  const AttentionDims& d = p.d;
  auto dev_empty = [&](Shape s, DType type) {
    return Tensor::empty(std::move(s), type, MemCategory::activation, c.device());
  };
  auto dev_in = [&](const Tensor& host) {
    Tensor x = on(c, host);
    if (dt == DType::f32) return x;
    Tensor y = dev_empty(host.shape(), dt);
    cast(c, x, y);
    return y;
  };
  auto out = [&](const Tensor& t) {
    if (t.dtype() == DType::f32) return flat_from(c, t);
    Tensor wide = dev_empty(t.shape(), DType::f32);
    cast(c, t, wide);
    return flat_from(c, wide);
  };
  const Tensor q = dev_in(p.q), k = dev_in(p.k), v = dev_in(p.v), dO = dev_in(p.dO);
  const Tensor qp = on(c, ints(p.qpos)), kp = on(c, ints(p.kvpos));
  Tensor o = dev_empty(p.q.shape(), dt), lse = dev_empty({d.batch, d.num_heads, d.q_len}, DType::f32);
  Tensor wf = c.workspace(attention_forward_workspace_bytes(c, d));
  attention_forward(c, d, q, k, v, qp, kp, p.scale, o, lse, wf);
  Result r{out(o), out(lse), {}, {}, {}};
  if (!backward) return r;
  Tensor dq = dev_empty(p.q.shape(), dt), dk = dev_empty(p.k.shape(), dt), dv = dev_empty(p.v.shape(), dt);
  Tensor wb = c.workspace(attention_backward_workspace_bytes(c, d));
  attention_backward(c, d, q, k, v, o, lse, dO, qp, kp, p.scale, dq, dk, dv, wb);
  r.dq = out(dq);
  r.dk = out(dk);
  r.dv = out(dv);
  return r;
}

TEST(AttentionCuda, BackwardMatchesFiniteDifferencesOfForward) {
  if (const std::string why = no_cuda_reason(); !why.empty()) GTEST_SKIP() << why;
  // The SIMT kernels: fp32, hd 16, two 32-key tiles.
  expect_backward_matches_finite_differences([](const Problem& p, bool b) { return run_cuda(p, b); });
}

void expect_same_results(const Result& one, const Result& two) {
  EXPECT_EQ(one.o, two.o);
  EXPECT_EQ(one.lse, two.lse);
  EXPECT_EQ(one.dq, two.dq);
  EXPECT_EQ(one.dk, two.dk);
  EXPECT_EQ(one.dv, two.dv);
}

TEST(AttentionCuda, ResultsAreBitwiseReproducible) {
  if (const std::string why = no_cuda_reason(); !why.empty()) GTEST_SKIP() << why;
  auto pos = iota(0, 200);
  Problem p = make_problem(2, 4, 2, 64, pos, pos, 8);
  expect_same_results(run_cuda(p, true), run_cuda(p, true));
}

// The bf16 tensor-core kernels (head_dim 64 and 128, the shipped configs'
// 128 among them), GQA, several query and key tiles: run to run, bit for bit.
TEST(AttentionCuda, Bf16TensorCoreResultsAreBitwiseReproducible) {
  if (const std::string why = no_cuda_reason(); !why.empty()) GTEST_SKIP() << why;
  auto pos = iota(0, 300);
  for (const int64_t hd : {64, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(hd));
    Problem p = make_problem(2, 8, 2, hd, pos, pos, 11);
    const Result one = run_cuda(p, true, DType::bf16), two = run_cuda(p, true, DType::bf16);
    expect_same_results(one, two);
    EXPECT_TRUE(std::all_of(one.dk.begin(), one.dk.end(), [](double x) { return std::isfinite(x); }));
  }
}

// A query row that sees no key (its position before every key's, as in a
// context-parallel chunk) gets o = 0 and lse = -inf, even when a key the
// other rows of its tile see holds an infinite V (0 * inf would be NaN):
// on the CPU, and from the bf16 tensor-core kernel on CUDA.
Problem unseen_row_problem() {
  Problem p = make_problem(1, 2, 1, 64, iota(0, 64), iota(1, 65), 9);  // query 0 precedes every key
  p.v.f32()[5] = std::numeric_limits<float>::infinity();                   // key 0 (position 1), kv head 0
  return p;
}
void expect_unseen_row_zero(const AttentionDims& d, const std::vector<double>& o, const std::vector<double>& lse) {
  for (int64_t h = 0; h < d.num_heads; ++h) {
    SCOPED_TRACE("head " + std::to_string(h));
    EXPECT_EQ(lse[h * d.q_len], -std::numeric_limits<double>::infinity());
    for (int64_t e = 0; e < d.head_dim; ++e) EXPECT_EQ(o[h * d.head_dim + e], 0.0) << "element " << e;  // [0, h, e]
  }
  EXPECT_FALSE(std::isfinite(o[d.num_heads * d.head_dim + 5])) << "row 1 sees the infinite value";
}

TEST(Attention, ARowThatSeesNoKeyIsZeroBesideANonFiniteValue) {
  const Problem p = unseen_row_problem();
  const Result r = run_kernel(p, false);
  expect_unseen_row_zero(p.d, r.o, r.lse);
}

TEST(AttentionCuda, ARowThatSeesNoKeyIsZeroBesideANonFiniteValue) {
  if (const std::string why = no_cuda_reason(); !why.empty()) GTEST_SKIP() << why;
  const ExecContext& c = cuda_context();
  const Problem p = unseen_row_problem();
  const AttentionDims& d = p.d;
  auto to_bf16 = [&](const Tensor& host) {  // bf16 and head_dim 64: the tensor-core kernel
    Tensor x = on(c, host), y = Tensor::empty(host.shape(), DType::bf16, MemCategory::activation, c.device());
    cast(c, x, y);
    return y;
  };
  const Tensor q = to_bf16(p.q), k = to_bf16(p.k), v = to_bf16(p.v);
  const Tensor qp = on(c, ints(p.qpos)), kp = on(c, ints(p.kvpos));
  Tensor o = Tensor::empty(p.q.shape(), DType::bf16, MemCategory::activation, c.device());
  Tensor lse = Tensor::empty({d.batch, d.num_heads, d.q_len}, DType::f32, MemCategory::activation, c.device());
  Tensor wf = c.workspace(attention_forward_workspace_bytes(c, d));
  attention_forward(c, d, q, k, v, qp, kp, p.scale, o, lse, wf);
  Tensor o_f32 = Tensor::empty(p.q.shape(), DType::f32, MemCategory::activation, c.device());
  cast(c, o, o_f32);
  expect_unseen_row_zero(d, flat_from(c, o_f32), flat_from(c, lse));
}

// Not a pass/fail gate (the build machine is shared): prints the attention
// fwd+bwd rate next to a large sgemm's, the ratio the training step's FLOP
// budget depends on.
TEST(AttentionBench, ReportsRateAgainstSgemm) {
  const int64_t B = 8, S = 512, H = 8, hd = 64;
  Problem p = make_problem(B, H, H, hd, iota(0, S), iota(0, S), 9);
  const AttentionDims& d = p.d;
  Tensor qp = ints(p.qpos), kp = ints(p.kvpos);
  Tensor o = make(p.q.shape()), lse = make({B, H, S}), dq = make(p.q.shape()), dk = make(p.k.shape()),
         dv = make(p.v.shape());
  Tensor wf = ctx.workspace(attention_forward_workspace_bytes(ctx, d)),
         wb = ctx.workspace(attention_backward_workspace_bytes(ctx, d));
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  const int64_t n = 1024;
  Tensor A = make({n, n}), Bm = make({n, n}), C = make({n, n});
  std::fill(A.f32(), A.f32() + n * n, 0.5f);
  std::fill(Bm.f32(), Bm.f32() + n * n, 0.25f);
  double best_fwd = 1e9, best_bwd = 1e9, best_gemm = 1e9;
  for (int rep = 0; rep < 4; ++rep) {  // best of several: other jobs share the cores
    auto t0 = clock::now();
    attention_forward(ctx, d, p.q, p.k, p.v, qp, kp, p.scale, o, lse, wf);
    auto t1 = clock::now();
    attention_backward(ctx, d, p.q, p.k, p.v, o, lse, p.dO, qp, kp, p.scale, dq, dk, dv, wb);
    auto t2 = clock::now();
    best_fwd = std::min(best_fwd, secs(t0, t1));
    best_bwd = std::min(best_bwd, secs(t1, t2));
    for (int i = 0; i < 3; ++i) {
      auto t3 = clock::now();
      gemm(ctx, A, Trans::no, Bm, Trans::no, C);
      best_gemm = std::min(best_gemm, secs(t3, clock::now()));
    }
  }
  const double fwd_flop = 4.0 * B * H * S * S * hd / 2;  // causal: half the score matrix
  const double gf_fwd = fwd_flop / best_fwd / 1e9, gf_bwd = 2.5 * fwd_flop / best_bwd / 1e9;
  const double gf_all = 3.5 * fwd_flop / (best_fwd + best_bwd) / 1e9, gf_gemm = 2.0 * n * n * n / best_gemm / 1e9;
  std::printf("[attention B=%lld S=%lld H=%lld hd=%lld, %d threads] fwd %.1f GFLOP/s, bwd %.1f GFLOP/s, "
              "fwd+bwd %.1f GFLOP/s; sgemm %lld^3 %.1f GFLOP/s; ratio %.2f\n",
              static_cast<long long>(B), static_cast<long long>(S), static_cast<long long>(H),
              static_cast<long long>(hd), omp_get_max_threads(), gf_fwd, gf_bwd, gf_all,
              static_cast<long long>(n), gf_gemm, gf_all / gf_gemm);
  EXPECT_GT(gf_all, 0.0);
}

}  // namespace
}  // namespace origami
