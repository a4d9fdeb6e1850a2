// CUDA ops beyond the op harness's comparisons (tests/test_kernels_backend_ops.cpp):
// the fused AdamW bit for bit against the calls it fuses; the grouped GEMM
// under each schedule and dtype pair on every segment list, and at shapes
// that fill the device; the cuBLASLt plan cache starting over at its
// capacity; device-side checks stopping the job. Each device test's
// comparison also runs on the host backend, where one exists, so its
// bounds and bookkeeping are checked on every machine; the CUDA half skips,
// naming what is missing, without a CUDA build or a device.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "device_test_util.h"
#include "grouped_gemm_cases.h"
#include "kernels/adamw.h"
#include "kernels/context.h"
#include "kernels/context_parallel.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/init.h"
#include "kernels/moe_ops.h"
#include "kernels/tensor.h"
#include "test_seed.h"
#ifdef ORIGAMI_WITH_CUDA
#include "kernels/cuda/blas.h"
#endif

namespace origami {
namespace {

using testing::CudaDevice;
using testing::random_host;
using testing::same_bits;

// adamw_update_fused against the calls it fuses (kernels/adamw.h), made one
// by one on the same context: every output bit for bit. 40 runs, so two
// launches on CUDA (32 runs each at most), of 0 to 9000 elements (past the
// kernel's 8192-element chunks: the first run aligned, so its vector path
// crosses one; the fourth most likely not), most starting off a 16-byte boundary,
// weight decay alternating; the fp32 recipe (f32 grad, no working copy), the
// bf16 one (bf16 grad and working copy) and a bf16 grad alone; the clip's
// scale and none.
void expect_fused_adamw_is_the_calls_one_by_one(const ExecContext& ctx) {
  std::mt19937 rng(testing::test_seed(7));
  std::uniform_int_distribution<int64_t> length(1, 300);
  std::vector<AdamWSegment> runs;
  int64_t n = 0;
  for (int i = 0; i < 40; ++i) {
    const int64_t len = i == 0 || i == 3 ? 9000 : i == 7 ? 0 : length(rng);
    runs.push_back({n, len, i % 2 ? 0.1f : 0.0f});
    n += len;
  }
  AdamWStep step;
  step.lr = 1e-2f;
  step.step = 4;
  const Tensor master0 = random_host({n}, 11), grad0 = random_host({n}, 12), m0 = random_host({n}, 13);
  Tensor v0 = random_host({n}, 14);
  for (int64_t i = 0; i < n; ++i) v0.f32()[i] *= v0.f32()[i];  // a second moment: >= 0
  const ExecContext host = ExecContext::cpu(1);
  struct Recipe {
    DType grad;
    bool copy;
  };
  for (const Recipe r : {Recipe{DType::f32, false}, Recipe{DType::bf16, true}, Recipe{DType::bf16, false}})
    for (const float scale : {1.0f, 0.37f}) {
      SCOPED_TRACE(std::string("grad ") + std::string(to_string(r.grad)) + (r.copy ? ", working copy" : "") +
                   ", scale " + std::to_string(scale));
      Tensor grad_host = Tensor::empty({n}, r.grad, MemCategory::grad);
      cast(host, grad0, grad_host);
      struct State {
        Tensor master, grad, m, v, param;
      };
      const auto fresh = [&] {
        State st{ctx.to(master0, ctx.device()), ctx.to(grad_host, ctx.device()), ctx.to(m0, ctx.device()),
                 ctx.to(v0, ctx.device()), {}};
        if (r.copy) st.param = ctx.empty({n}, DType::bf16, MemCategory::param);
        return st;
      };
      State fused = fresh(), calls = fresh();
      adamw_update_fused(ctx, fused.master, fused.grad, fused.m, fused.v, fused.param, runs, scale, step);
      if (scale != 1.0f) scale_inplace(ctx, calls.grad, scale);
      for (const AdamWSegment& run : runs) {
        const auto part = [&](const Tensor& t) { return t.flat_view(run.begin, run.numel, {run.numel}); };
        Tensor p = part(calls.master), g = part(calls.grad), m = part(calls.m), v = part(calls.v);
        AdamWStep s = step;
        s.weight_decay = run.weight_decay;
        adamw_update(ctx, p, g, m, v, s);
        if (!r.copy) continue;
        Tensor out = part(calls.param);
        cast(ctx, p, out);
      }
      const auto on_host = [&](const Tensor& t) { return ctx.to(t, Device::cpu()); };
      EXPECT_TRUE(same_bits(on_host(fused.master), on_host(calls.master))) << "master";
      EXPECT_TRUE(same_bits(on_host(fused.grad), on_host(calls.grad))) << "grad";
      EXPECT_TRUE(same_bits(on_host(fused.m), on_host(calls.m))) << "exp_avg";
      EXPECT_TRUE(same_bits(on_host(fused.v), on_host(calls.v))) << "exp_avg_sq";
      if (r.copy) {
        EXPECT_TRUE(same_bits(on_host(fused.param), on_host(calls.param))) << "working copy";
      }
      EXPECT_FALSE(same_bits(on_host(fused.master), master0)) << "the step moved nothing";
    }
}

// The grouped GEMM's three products (forward Y = X·Wᵀ, data gradient
// dX = dY·W, weight gradient dW = Σ dYᵀ·X) on ctx under each schedule
// (automatic, grouped, single) and in each dtype pair (f32; bf16 operands
// with a bf16 or an f32 output, the fp32 master gradient) over every case
// of tests/grouped_gemm_cases.h, beta 0.5 (accumulating; groups no segment
// names only scaled): against the host's fp32 products of the same values
// (bf16 inputs widened exactly). On CUDA this adds to the op harness (the
// automatic schedule, which runs these small products in the grouped call,
// or per problem for bf16 with an f32 output, which cuBLAS's grouped call
// does not take) the per-problem cuBLASLt path for every case and dtype
// pair (empty segments, repeated groups, 2100 problems, K = 0); the test
// below has products that fill the device and run alone. Bound per element, with Σ = Σ|products| +
// |beta·old| (the host's own products of |inputs|): 2·(n+1)·2^-24·Σ for two
// fp32 sums of n terms in any orders, plus r·2^-8·Σ for a bf16 output
// rounded r times (once; the weight gradient once per segment of its group).
void expect_grouped_gemm_schedules_give_the_hosts_products(const ExecContext& ctx) {
  const ExecContext host = ExecContext::cpu(1);
  const double u = std::ldexp(1.0, -24), bf16_rounding = std::ldexp(1.0, -8);
  const float beta = 0.5f;
  auto to_dtype = [&](const Tensor& t, DType dt) {  // host f32 -> host dt
    if (dt == DType::f32) return t;
    Tensor o = Tensor::empty(t.shape(), dt, MemCategory::activation);
    cast(host, t, o);
    return o;
  };
  auto widened = [&](const Tensor& t) {  // host or device, f32 or bf16 -> host f32
    const Tensor h = t.device().is_host() ? t : ctx.to(t, Device::cpu());
    if (h.dtype() == DType::f32) return h;
    Tensor o = Tensor::empty(h.shape(), DType::f32, MemCategory::activation);
    cast(host, h, o);
    return o;
  };
  auto abs_of = [](const Tensor& t) {
    Tensor a = Tensor::empty(t.shape(), DType::f32, MemCategory::activation);
    for (int64_t i = 0; i < t.numel(); ++i) a.f32()[i] = std::abs(t.f32()[i]);
    return a;
  };
  enum class Product { forward, data, weight };
  struct Pair {
    DType in, out;
  };
  constexpr GroupedGemmSchedule kAll[] = {GroupedGemmSchedule::automatic, GroupedGemmSchedule::grouped,
                                          GroupedGemmSchedule::single};
  uint32_t seed = 1000;
  int64_t compared = 0;
  for (const testing::GroupedGemmCase& c : testing::grouped_gemm_cases())
    for (const Product product : {Product::forward, Product::data, Product::weight})
      for (const Pair pair : {Pair{DType::f32, DType::f32}, Pair{DType::bf16, DType::bf16}, Pair{DType::bf16, DType::f32}}) {
        const char* names[] = {"forward", "data gradient", "weight gradient"};
        SCOPED_TRACE(std::string(c.name) + ", " + names[static_cast<int>(product)] + ", " +
                     std::string(to_string(pair.in)) + " -> " + std::string(to_string(pair.out)));
        const int64_t N = testing::total_rows(c.segs);
        // Operands: a [N, ·] (X or dY), b (W, or X for the weight gradient), the output.
        const Shape a_shape = product == Product::data ? Shape{N, c.M} : product == Product::forward ? Shape{N, c.K}
                                                                                                     : Shape{N, c.M};
        const Shape b_shape = product == Product::weight ? Shape{N, c.K} : Shape{c.G, c.M, c.K};
        const Shape out_shape = product == Product::forward ? Shape{N, c.M}
                                : product == Product::data  ? Shape{N, c.K}
                                                            : Shape{c.G, c.M, c.K};
        const Tensor a = widened(to_dtype(random_host(a_shape, seed++), pair.in));
        const Tensor b = widened(to_dtype(random_host(b_shape, seed++), pair.in));
        const Tensor out0 = widened(to_dtype(random_host(out_shape, seed++), pair.out));
        const auto run = [&](const ExecContext& on, const Tensor& x, const Tensor& y, Tensor& out,
                             GroupedGemmSchedule how) {
          if (product == Product::weight)
            grouped_gemm_wgrad(on, x, y, c.segs, out, beta, how);
          else
            grouped_gemm(on, x, y, product == Product::forward ? Trans::yes : Trans::no, c.segs, out, beta, how);
        };
        Tensor want = Tensor::empty(out_shape, DType::f32, MemCategory::activation);
        want.copy_from(out0);
        run(host, a, b, want, GroupedGemmSchedule::automatic);
        Tensor terms = abs_of(out0);
        run(host, abs_of(a), abs_of(b), terms, GroupedGemmSchedule::automatic);
        // n (terms per element) and r (bf16 roundings) for each element.
        std::vector<int64_t> group_rows(c.G, 0), group_segments(c.G, 0);
        for (const GemmSegment& s : c.segs) {
          group_rows[s.group] += s.rows;
          group_segments[s.group] += s.rows > 0;
        }
        const int64_t per_group = c.M * c.K;
        const auto n_and_r = [&](int64_t i) -> std::pair<int64_t, int64_t> {
          if (product == Product::forward) return {c.K, 1};
          if (product == Product::data) return {c.M, 1};
          const int64_t g = i / per_group;
          return {group_rows[g] + group_segments[g], std::max<int64_t>(1, group_segments[g])};
        };
        const Tensor a_in = ctx.to(to_dtype(a, pair.in), ctx.device()), b_in = ctx.to(to_dtype(b, pair.in), ctx.device());
        for (const GroupedGemmSchedule how : kAll) {
          Tensor out = ctx.to(to_dtype(out0, pair.out), ctx.device());
          run(ctx, a_in, b_in, out, how);
          const Tensor got = widened(out);
          int64_t bad = 0;
          std::string first;
          for (int64_t i = 0; i < want.numel(); ++i) {
            const auto [n, r] = n_and_r(i);
            const double scale = terms.f32()[i];
            const double bound =
                2.0 * static_cast<double>(n + 1) * u * scale + (pair.out == DType::bf16 ? r * bf16_rounding * scale : 0.0);
            const double err = std::abs(double(got.f32()[i]) - want.f32()[i]);
            if (err <= bound) continue;
            if (bad++ == 0)
              first = "element " + std::to_string(i) + ": " + std::to_string(got.f32()[i]) + " vs " +
                      std::to_string(want.f32()[i]) + ", bound " + std::to_string(bound);
          }
          compared += want.numel();
          EXPECT_EQ(bad, 0) << "schedule " << static_cast<int>(how) << ": " << bad << " of " << want.numel()
                            << " elements outside the bound; first " << first;
        }
      }
  EXPECT_GT(compared, 1'000'000) << "the cases no longer reach the shapes they were chosen for";
}

TEST(AdamWFused, IsTheCallsItFusesBitForBitOnTheHost) {
  expect_fused_adamw_is_the_calls_one_by_one(ExecContext::cpu(2));
}

TEST(AdamWFusedDeathTest, RunsThatDoNotTileTheUnitOrAMixedRecipeAreAnInternalError) {
  const ExecContext ctx = ExecContext::cpu(1);
  Tensor p = random_host({10}, 1), g = random_host({10}, 2), m = random_host({10}, 3), v = random_host({10}, 4), none;
  const std::vector<AdamWSegment> gap{{0, 4, 0.0f}, {5, 5, 0.1f}}, short_of{{0, 9, 0.0f}};
  EXPECT_EXIT(adamw_update_fused(ctx, p, g, m, v, none, gap, 1.0f, AdamWStep{}),
              ::testing::ExitedWithCode(kExitInternal),
              "segments must tile \\[0, 10\\) in order; one is \\[5, \\+5\\) after 4");
  EXPECT_EXIT(adamw_update_fused(ctx, p, g, m, v, none, short_of, 1.0f, AdamWStep{}),
              ::testing::ExitedWithCode(kExitInternal), "the segments cover \\[0, 9\\) of \\[0, 10\\)");
  Tensor copy = Tensor::empty({10}, DType::bf16, MemCategory::param);  // beside an f32 grad
  const std::vector<AdamWSegment> whole{{0, 10, 0.1f}};
  EXPECT_EXIT(adamw_update_fused(ctx, p, g, m, v, copy, whole, 1.0f, AdamWStep{}),
              ::testing::ExitedWithCode(kExitInternal), "got bf16 \\[10\\] beside a f32 grad");
}

// The device test's comparison on the host's own backend (the schedule is
// ignored there, bf16 emulated): its bounds hold where the products are
// the host's in another summation order at most.
TEST(GroupedGemmSchedules, TheDeviceComparisonHoldsOnTheHost) {
  expect_grouped_gemm_schedules_give_the_hosts_products(ExecContext::cpu(3));
}

// ---- CUDA (device present) -------------------------------------------------

// The CUDA grouped GEMM's three schedules (kernels/grouped_gemm.h) each give
// the host's products, at shapes the op harness's small cases never reach.
// Forward: a 1700-row segment whose output holds 182 tiles of 128x128 over
// an inner dimension of 512 (alone under `automatic` on a GPU of up to 182
// SMs) beside two small ones (one grouped call). Weight gradient: 1664 x
// 1664 per group (169 tiles) over 520 to 1112 rows, group 0 fed twice (two
// rounds, the second accumulating). Bound per element: two fp32 sums of the
// same n products in any two orders differ by at most 2·(n+1)·2^-24·Σ|products|
// (each is within n·u·Σ|terms| of the exact sum; +1 for the second round's
// add onto the first); Σ|products| is the same product of |X| and |W|.
TEST_F(CudaDevice, GroupedGemmSchedulesEachGiveTheHostsProducts) {
  const ExecContext host = ExecContext::cpu(omp_get_max_threads()), ctx = ExecContext::cuda(0);
  const double u = std::ldexp(1.0, -24);
  auto abs_of = [](const Tensor& t) {
    Tensor a = Tensor::empty(t.shape(), DType::f32, MemCategory::activation);
    for (int64_t i = 0; i < t.numel(); ++i) a.f32()[i] = std::abs(t.f32()[i]);
    return a;
  };
  auto expect_within = [&](const Tensor& got_dev, const Tensor& want, const Tensor& terms,
                           const std::vector<double>& n_of, int64_t per_n, GroupedGemmSchedule how, const char* what) {
    const Tensor got = ctx.to(got_dev, Device::cpu());
    int64_t bad = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double bound = 2.0 * (n_of[static_cast<size_t>(i / per_n)] + 1) * u * terms.f32()[i];
      bad += !(std::abs(double(got.f32()[i]) - want.f32()[i]) <= bound);
    }
    EXPECT_EQ(bad, 0) << what << ", schedule " << static_cast<int>(how);
  };
  constexpr GroupedGemmSchedule kAll[] = {GroupedGemmSchedule::automatic, GroupedGemmSchedule::grouped,
                                          GroupedGemmSchedule::single};
  {  // forward Y = X·Wᵀ per segment: K products per element
    const int64_t G = 3, K = 512, M = 1664, N = 2040;
    const std::vector<GemmSegment> segs{{0, 1700}, {1, 40}, {2, 300}};
    const Tensor x = random_host({N, K}, 31), w = random_host({G, M, K}, 32);
    Tensor want = Tensor::empty({N, M}, DType::f32, MemCategory::activation);
    Tensor terms = Tensor::empty({N, M}, DType::f32, MemCategory::activation);
    grouped_gemm(host, x, w, Trans::yes, segs, want);
    grouped_gemm(host, abs_of(x), abs_of(w), Trans::yes, segs, terms);
    const std::vector<double> n_of{static_cast<double>(K)};
    const Tensor x_dev = x.to(Device::cuda(0)), w_dev = w.to(Device::cuda(0));
    for (const GroupedGemmSchedule how : kAll) {
      Tensor y = Tensor::empty({N, M}, DType::f32, MemCategory::activation, Device::cuda(0));
      grouped_gemm(ctx, x_dev, w_dev, Trans::yes, segs, y, 0.0f, how);
      expect_within(y, want, terms, n_of, N * M, how, "forward");
    }
  }
  {  // weight gradient dW[g] = Σ dY_sᵀ·X_s, beta 0: a group's rows' products per element
    const int64_t G = 2, M = 1664, K = 1664, N = 1632;
    const std::vector<GemmSegment> segs{{0, 600}, {1, 520}, {0, 512}};
    const Tensor dy = random_host({N, M}, 33), x = random_host({N, K}, 34);
    Tensor want = Tensor::empty({G, M, K}, DType::f32, MemCategory::activation);
    Tensor terms = Tensor::empty({G, M, K}, DType::f32, MemCategory::activation);
    grouped_gemm_wgrad(host, dy, x, segs, want, 0.0f);
    grouped_gemm_wgrad(host, abs_of(dy), abs_of(x), segs, terms, 0.0f);
    const std::vector<double> n_of{600.0 + 512.0, 520.0};
    const Tensor dy_dev = dy.to(Device::cuda(0)), x_dev = x.to(Device::cuda(0));
    for (const GroupedGemmSchedule how : kAll) {
      Tensor dw = Tensor::empty({G, M, K}, DType::f32, MemCategory::activation, Device::cuda(0));
      grouped_gemm_wgrad(ctx, dy_dev, x_dev, segs, dw, 0.0f, how);
      expect_within(dw, want, terms, n_of, M * K, how, "weight gradient");
    }
  }
}

TEST_F(CudaDevice, GroupedGemmEveryScheduleAndDtypeGivesTheHostsProductsOnEveryCase) {
  expect_grouped_gemm_schedules_give_the_hosts_products(ExecContext::cuda(0));
}

#ifdef ORIGAMI_WITH_CUDA
// The cuBLASLt plan cache starts over at kMaxLtPlans (kernels/cuda/blas.h)
// while matmuls of the plans it drops may still be queued (descriptors are
// read when a call is enqueued): [1, k]·[k, 8] for k = 1 .. kMaxLtPlans + 300,
// each a plan of its own, queued without a sync, each into its own output
// row; then k = 1 .. 300 again, on rebuilt plans. The cache holds 300 plans
// after the first pass (it started over once, at the right size) and 600
// after the second. Every row against prefix sums in double: row k is
// Σ_{i<k} a_i·b[i, :], within 2·(k+1)·2^-24·Σ|terms| (two fp32 sums of k
// products in any orders).
TEST_F(CudaDevice, GemmPlanCacheStartsOverPastItsCapacityAndQueuedProductsStayRight) {
  const ExecContext ctx = ExecContext::cuda(0);
  constexpr int64_t kN = 8, kKs = static_cast<int64_t>(cuda::kMaxLtPlans) + 300, kAgain = 300;
  const Tensor a = random_host({kKs}, 41), b = random_host({kKs * kN}, 42);
  const Tensor a_dev = a.to(Device::cuda(0)), b_dev = b.to(Device::cuda(0));
  Tensor c_dev = Tensor::empty({kKs + kAgain, kN}, DType::f32, MemCategory::activation, Device::cuda(0));
  const auto& plans = cuda::state_of(ctx).plans;
  ASSERT_EQ(plans.size(), 0u) << "a fresh context holds no plans";
  for (int64_t row = 0; row < kKs + kAgain; ++row) {
    const int64_t k = row < kKs ? row + 1 : row - kKs + 1;
    const Tensor ak = a_dev.flat_view(0, k, {1, k}), bk = b_dev.flat_view(0, k * kN, {k, kN});
    Tensor ck = c_dev.flat_view(row * kN, kN, {1, kN});
    gemm(ctx, ak, Trans::no, bk, Trans::no, ck);
    if (row == kKs - 1) {
      EXPECT_EQ(plans.size(), 300u) << "the cache did not start over once at its capacity";
    }
  }
  EXPECT_EQ(plans.size(), 600u);
  const Tensor c = ctx.to(c_dev, Device::cpu());
  const double u = std::ldexp(1.0, -24);
  std::vector<double> want(kN, 0.0), terms(kN, 0.0);
  std::vector<std::vector<double>> want_of(kKs + 1), terms_of(kKs + 1);  // by k
  for (int64_t k = 1; k <= kKs; ++k) {
    for (int64_t j = 0; j < kN; ++j) {
      const double t = double(a.f32()[k - 1]) * b.f32()[(k - 1) * kN + j];
      want[j] += t;
      terms[j] += std::abs(t);
    }
    want_of[k] = want;
    terms_of[k] = terms;
  }
  int64_t bad = 0;
  for (int64_t row = 0; row < kKs + kAgain; ++row) {
    const int64_t k = row < kKs ? row + 1 : row - kKs + 1;
    for (int64_t j = 0; j < kN; ++j) {
      const double bound = 2.0 * static_cast<double>(k + 1) * u * terms_of[k][j];
      if (!(std::abs(c.f32()[row * kN + j] - want_of[k][j]) <= bound) && bad++ < 5)
        ADD_FAILURE() << "row " << row << " (k " << k << "), column " << j << ": " << c.f32()[row * kN + j]
                      << " vs " << want_of[k][j] << ", bound " << bound;
    }
  }
  EXPECT_EQ(bad, 0);
}
#endif

// Past 2^31 elements (a unit of a larger model than the shipped ones: the
// Mixtral-like config's expert unit holds 1.4e9 elements, 5.6 GB), every
// index and byte offset must be 64-bit and the grid-capped kernels loop
// over many elements a thread. n = 2^31 + 1037 f32 elements (8.6 GB a
// tensor, 35 GB at the peak, so the test has the GPU to itself: RUN_SERIAL
// in tests/CMakeLists.txt); windows of 64 elements at the start, across
// 2^31 and at the end are checked bit for bit: init_normal against the
// host's generation of the same global elements; axpy, the bf16 cast and
// the fused AdamW (one run, weight decay, the clip's scale, the bf16
// working copy) against the same op on a 64-element device copy of the
// window's inputs (each element's result depends on its inputs alone; the
// 35 GB are the bf16 recipe's: an f32 master and moments, a bf16 gradient
// and working copy); the fp64 sum of squares of 0.5s is n/4 exactly.
TEST_F(CudaDevice, OpsPastTwoToThe31ElementsReachEveryElement) {
  const ExecContext ctx = ExecContext::cuda(0), host = ExecContext::cpu(omp_get_max_threads());
  const Device gpu = Device::cuda(0);
  constexpr int64_t kW = 64, n = (int64_t{1} << 31) + 1037;
  const int64_t starts[] = {0, (int64_t{1} << 31) - kW / 2, n - kW};
  const auto big = [&](DType dt) { return Tensor::empty({n}, dt, MemCategory::param, gpu); };
  const auto window = [&](const Tensor& t, int64_t at) { return t.flat_view(at, kW, {kW}); };
  const auto bits_at = [&](const Tensor& t, int64_t at) { return ctx.to(window(t, at), Device::cpu()); };
  const auto on_gpu = [&](const Tensor& t, int64_t at) { return ctx.to(window(t, at), gpu); };  // a device copy

  Tensor x = big(DType::f32);
  init_normal(ctx, x, 7, "past-2^31", 0, 1.0f);
  for (const int64_t at : starts) {
    Tensor want = Tensor::empty({kW}, DType::f32, MemCategory::param);
    init_normal(host, want, 7, "past-2^31", at, 1.0f);
    EXPECT_TRUE(same_bits(bits_at(x, at), want)) << "init_normal at " << at;
  }
  {
    Tensor y = big(DType::f32), y16 = big(DType::bf16);
    init_constant(ctx, y, 1.0f);
    axpy(ctx, 0.5f, x, y);
    cast(ctx, y, y16);
    for (const int64_t at : starts) {
      Tensor small_y = ctx.empty({kW}, DType::f32, MemCategory::param), small_16 = ctx.empty({kW}, DType::bf16, MemCategory::param);
      init_constant(ctx, small_y, 1.0f);
      axpy(ctx, 0.5f, on_gpu(x, at), small_y);
      cast(ctx, small_y, small_16);
      EXPECT_TRUE(same_bits(bits_at(y, at), ctx.to(small_y, Device::cpu()))) << "axpy at " << at;
      EXPECT_TRUE(same_bits(bits_at(y16, at), ctx.to(small_16, Device::cpu()))) << "cast at " << at;
    }
    init_constant(ctx, y, 0.5f);
    EXPECT_EQ(sum_squares(ctx, y), 0.25 * static_cast<double>(n));
  }
  // The bf16 recipe: a bf16 gradient beside the bf16 working copy.
  Tensor grad = big(DType::bf16), m = big(DType::f32), v = big(DType::f32), param = big(DType::bf16);
  init_normal(ctx, grad, 7, "past-2^31 grad", 0, 0.5f);
  init_normal(ctx, m, 7, "past-2^31 m", 0, 0.1f);
  init_constant(ctx, v, 0.01f);
  struct Small {
    Tensor master, grad, m, v, param;
  };
  std::vector<Small> before;
  for (const int64_t at : starts)
    before.push_back({on_gpu(x, at), on_gpu(grad, at), on_gpu(m, at), on_gpu(v, at),
                      ctx.empty({kW}, DType::bf16, MemCategory::param)});
  AdamWStep step;
  step.lr = 1e-2f;
  step.step = 3;
  const std::vector<AdamWSegment> whole{{0, n, 0.1f}}, small{{0, kW, 0.1f}};
  adamw_update_fused(ctx, x, grad, m, v, param, whole, 0.37f, step);
  for (size_t w = 0; w < before.size(); ++w) {
    Small& b = before[w];
    adamw_update_fused(ctx, b.master, b.grad, b.m, b.v, b.param, small, 0.37f, step);
    const int64_t at = starts[w];
    const auto host_of = [&](const Tensor& t) { return ctx.to(t, Device::cpu()); };
    EXPECT_TRUE(same_bits(bits_at(x, at), host_of(b.master))) << "AdamW master at " << at;
    EXPECT_TRUE(same_bits(bits_at(grad, at), host_of(b.grad))) << "AdamW scaled grad at " << at;
    EXPECT_TRUE(same_bits(bits_at(m, at), host_of(b.m))) << "AdamW exp_avg at " << at;
    EXPECT_TRUE(same_bits(bits_at(v, at), host_of(b.v))) << "AdamW exp_avg_sq at " << at;
    EXPECT_TRUE(same_bits(bits_at(param, at), host_of(b.param))) << "AdamW working copy at " << at;
  }
}

TEST_F(CudaDevice, FusedAdamWIsTheCallsItFusesBitForBit) {
  expect_fused_adamw_is_the_calls_one_by_one(ExecContext::cuda(0));
}

using CudaDeviceDeathTest = CudaDevice;

// A device-side check stops the job as the host's checks do: the kernel
// reports (the CPU check's text, by the device's printf, or a device
// assertion naming the rule) and traps, the next CUDA call of the job fails
// at its CUDA_CHECK, and the process exits with the internal-error status.
// The child starts afresh (threadsafe style: a CUDA context does not survive
// fork) and sends its stdout, where device printf lands, to stderr,
// unbuffered, so the kernel's report is part of what the death test reads.
void route_stdout_to_stderr() {
  std::fflush(stdout);
  ::dup2(STDERR_FILENO, STDOUT_FILENO);
  std::setvbuf(stdout, nullptr, _IONBF, 0);
}

// `launch(ctx)` queues a kernel whose device-side check fails; in a fresh
// child the job must stop with exit 4, the kernel's `report` and then the
// next CUDA call's check failure in its output.
template <class Launch>
void expect_device_check_stops_the_job(Launch launch, const std::string& report) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto run = [&] {
    route_stdout_to_stderr();
    const ExecContext ctx = ExecContext::cuda(0);
    launch(ctx);
    ctx.synchronize();
  };
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(kExitInternal), report);
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(kExitInternal), "check failed: .*cudaError");
}

// An i32 tensor on cuda:0 holding `values`.
Tensor device_i32(std::initializer_list<int32_t> values, Shape shape) {
  Tensor host = Tensor::empty(std::move(shape), DType::i32, MemCategory::activation);
  std::copy(values.begin(), values.end(), host.i32());
  return host.to(Device::cuda(0));
}

TEST_F(CudaDeviceDeathTest, ACrossEntropyTargetOutOfRangeStopsTheJobNamingIt) {
  expect_device_check_stops_the_job(
      [](const ExecContext& ctx) {
        const Tensor logits = random_host({4, 8}, 51).to(Device::cuda(0));
        const Tensor targets = device_i32({0, 1, 2, 8}, {4});  // token 3's is V
        Tensor loss = ctx.empty({4}, DType::f32, MemCategory::activation);
        Tensor lse = ctx.empty({4}, DType::f32, MemCategory::activation);
        cross_entropy_forward(ctx, logits, targets, loss, lse);
      },
      "cross-entropy target 8 of token 3 is outside \\[0, 8\\)");
}

TEST_F(CudaDeviceDeathTest, AContextParallelPositionOutOfRangeStopsTheJobNamingIt) {
  expect_device_check_stops_the_job(
      [](const ExecContext& ctx) {
        const Tensor tokens = device_i32({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, {2, 9});
        const Tensor pos_S = device_i32({0, 7, 3, 8}, {4});  // S = 8: row 3 names position 8, past S - 1
        Tensor ids = ctx.empty({8}, DType::i32, MemCategory::activation);
        Tensor targets = ctx.empty({8}, DType::i32, MemCategory::activation);
        cp_gather_tokens(ctx, tokens, pos_S, ids, targets);
      },
      "cp_gather_tokens: position 8 at row 3 outside \\[0, 8\\)");
}

TEST_F(CudaDeviceDeathTest, AnExpertIndexOutOfRangeStopsTheJobNamingTheRule) {
  expect_device_check_stops_the_job(
      [](const ExecContext& ctx) {
        const Tensor expert_TK = device_i32({0, 1, 2, 3, 1, 4}, {3, 2});  // 4 experts: the last slot names 4
        Tensor count_E = ctx.empty({4}, DType::i64, MemCategory::activation);
        moe_expert_histogram(ctx, expert_TK, Tensor(), 4, count_E);
      },
      "moe_expert_histogram: expert index outside \\[0, num_experts\\)");
}

}  // namespace
}  // namespace origami
