// Devices, execution contexts, per-device ledgers, Tensor::to / copy_from /
// fill_zero, ExecContext::copy / to and the dispatch's device rule. The host half runs everywhere;
// the CUDA half needs a CUDA build and a device and skips (naming which is
// missing) otherwise. Values are fresh random floats compared bitwise: a copy
// either moves every bit or it is wrong.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/allocator.h"
#include "kernels/context.h"
#include "kernels/cross_entropy.h"
#include "kernels/device.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_ops.h"
#include "kernels/tensor.h"
#include "grouped_gemm_cases.h"
#ifdef ORIGAMI_WITH_CUDA
#include <cuda_runtime.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/cublas_library.h"
#endif

namespace origami {
namespace {

Tensor random_host(Shape shape, uint32_t seed, MemCategory cat = MemCategory::activation) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32, cat);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// adamw_update_fused against the calls it fuses (kernels/adamw.h), made one
// by one on the same context: every output bit for bit. 40 runs, so two
// launches on CUDA (32 runs each at most), of 0 to 9000 elements (past the
// kernel's 8192-element chunks: the first run aligned, so its vector path
// crosses one; the fourth most likely not), most starting off a 16-byte boundary,
// weight decay alternating; the fp32 recipe (f32 grad, no working copy), the
// bf16 one (bf16 grad and working copy) and a bf16 grad alone; the clip's
// scale and none.
void expect_fused_adamw_is_the_calls_one_by_one(const ExecContext& ctx) {
  std::mt19937 rng(7);
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
// (bf16 inputs widened exactly). On CUDA this reaches what the op harness
// (automatic schedule) does not: the grouped call for every case (empty
// segments, repeated groups, 2100 problems in two chunks), the per-problem
// cuBLASLt path in bf16, K = 0. Bound per element, with Σ = Σ|products| +
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

// Why the CUDA half cannot run here, or "" when it can.
std::string no_cuda_reason() {
  if (!built_with_cuda()) return "built without CUDA (-DORIGAMI_CUDA=OFF or no toolkit)";
  if (cuda_device_count() == 0) return "built with CUDA, but this machine has no CUDA device";
  return "";
}

TEST(Device, Names) {
  EXPECT_EQ(to_string(Device::cpu()), "cpu");
  EXPECT_EQ(to_string(Device::cuda(3)), "cuda:3");
  EXPECT_TRUE(Device::cpu().is_host());
  EXPECT_FALSE(Device::cuda(0).is_host());
  EXPECT_NE(Device::cuda(0), Device::cuda(1));
}

// The launcher's variables and CUDA_MODULE_LOADING as a test sets them; the
// process's own values come back at the end.
class LaunchEnv {
 public:
  LaunchEnv() {
    for (const char* v : kVars) {
      if (const char* x = std::getenv(v)) saved_[v] = x;
      unsetenv(v);
    }
  }
  ~LaunchEnv() {
    for (const char* v : kVars) unsetenv(v);
    for (const auto& [k, x] : saved_) setenv(k.c_str(), x.c_str(), 1);
  }
  static std::string loading() {
    const char* x = std::getenv("CUDA_MODULE_LOADING");
    return x ? x : "(unset)";
  }

 private:
  static constexpr const char* kVars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                                          "PMIX_RANK", "PMI_RANK", "CUDA_MODULE_LOADING"};
  std::map<std::string, std::string> saved_;
};

TEST(Device, MultiRankJobsLoadCudaKernelsEagerlyUnlessTheUserChose) {
  const LaunchEnv env;
  // No launcher, or a one-rank job: the driver's lazy default stays.
  EXPECT_EQ(launcher_world_size(), 0);
  EXPECT_EQ(choose_cuda_module_loading(), "");
  EXPECT_EQ(LaunchEnv::loading(), "(unset)");
  setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  EXPECT_EQ(launcher_world_size(), 1);
  EXPECT_EQ(choose_cuda_module_loading(), "");
  EXPECT_EQ(LaunchEnv::loading(), "(unset)");
  // Several ranks: eager, in the environment the driver will read.
  setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
  EXPECT_EQ(launcher_world_size(), 8);
  EXPECT_EQ(choose_cuda_module_loading(), "EAGER");
  EXPECT_EQ(LaunchEnv::loading(), "EAGER");
  // The user's choice is kept, whatever it is.
  setenv("CUDA_MODULE_LOADING", "LAZY", 1);
  EXPECT_EQ(choose_cuda_module_loading(), "LAZY");
  EXPECT_EQ(LaunchEnv::loading(), "LAZY");
  // A launcher that names a rank but not the job's size: eager, to be safe.
  unsetenv("CUDA_MODULE_LOADING");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("PMIX_RANK", "0", 1);
  EXPECT_EQ(launcher_world_size(), 0);
  EXPECT_EQ(choose_cuda_module_loading(), "EAGER");
  // A batch script's own process (SLURM_NTASKS alone) is no launch.
  unsetenv("PMIX_RANK");
  unsetenv("CUDA_MODULE_LOADING");
  setenv("SLURM_NTASKS", "8", 1);
  EXPECT_EQ(launcher_world_size(), 0);
  EXPECT_EQ(choose_cuda_module_loading(), "");
  // srun's step size, MPICH's size.
  setenv("SLURM_STEP_NUM_TASKS", "2", 1);
  EXPECT_EQ(launcher_world_size(), 2);
  EXPECT_EQ(choose_cuda_module_loading(), "EAGER");
  setenv("PMI_SIZE", "1", 1);  // the first variable set wins: MPICH's before Slurm's
  EXPECT_EQ(launcher_world_size(), 1);
}

TEST(Dispatch, DeviceRuleNamesTheOpTheContextAndEachStrayTensor) {
  EXPECT_EQ(device_mismatch("gemm", Device::cpu(), {{"A", Device::cpu()}, {"B", Device::cpu()}}), "");
  EXPECT_EQ(
      device_mismatch("gemm", Device::cpu(), {{"A", Device::cpu()}, {"B", Device::cuda(0)}, {"C", Device::cpu()}}),
      "gemm: the context runs on cpu but B is on cuda:0");
  EXPECT_EQ(device_mismatch("axpy", Device::cuda(1), {{"x", Device::cuda(0)}, {"y", Device::cpu()}}),
            "axpy: the context runs on cuda:1 but x is on cuda:0, y is on cpu");
  // The tensor form skips undefined (optional) arguments.
  const Tensor host = random_host({3}, 1), none;
  EXPECT_EQ(device_mismatch("moe_topk_forward", Device::cpu(), {{"logits_TE", &host}, {"bias_E", &none}}), "");
  EXPECT_EQ(device_mismatch("gemm", Device::cuda(0), {{"A", &host}, {"B", &none}}),
            "gemm: the context runs on cuda:0 but A is on cpu");
}

TEST(ExecContext, CpuContextRunsOpsOnItsThreadsAndRestoresTheCallers) {
  const ExecContext one = ExecContext::cpu(1), three = ExecContext::cpu(3);
  EXPECT_EQ(one.device(), Device::cpu());
  EXPECT_EQ(three.threads(), 3);
  EXPECT_EQ(one.stream(), nullptr);
  EXPECT_EQ(one.blas(), nullptr);
  const int before = omp_get_max_threads();
  Tensor x = random_host({4097}, 2);
  // sum_squares sums fixed per-thread blocks, so the thread count shows in
  // the last bits only; what matters is the caller's setting afterwards.
  const double a = sum_squares(one, x), b = sum_squares(three, x);
  EXPECT_NEAR(a, b, 1e-12 * a);
  EXPECT_GT(a, 0.0);
  EXPECT_EQ(omp_get_max_threads(), before);
}

TEST(ExecContext, WorkspaceIsTrackedBytesOnTheContextsDevice) {
  const ExecContext ctx = ExecContext::cpu(2);
  const int ws = static_cast<int>(MemCategory::workspace);
  const int64_t before = TrackedAllocator::host().snapshot().current[ws];
  {
    const Tensor w = ctx.workspace(1000);
    EXPECT_EQ(w.nbytes(), 1000u);
    EXPECT_EQ(w.device(), Device::cpu());
    EXPECT_EQ(TrackedAllocator::host().snapshot().current[ws] - before, 1000);
  }
  EXPECT_EQ(TrackedAllocator::host().snapshot().current[ws], before);
}

TEST(ExecContext, CudaContextWithoutBackendOrDeviceIsAUserError) {
  const std::string reason = no_cuda_reason();
  if (reason.empty()) GTEST_SKIP() << "a CUDA device is present; the error path needs a machine without one";
  try {
    (void)ExecContext::cuda(0);
    FAIL() << "ExecContext::cuda(0) succeeded without a device";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda:0 requested"), std::string::npos) << what;
    if (!built_with_cuda()) {
      EXPECT_NE(what.find("built without CUDA"), std::string::npos) << what;
    } else {
      EXPECT_NE(what.find("sees 0 CUDA device(s)"), std::string::npos) << what;
    }
  }
}

// A memory source that counts what it hands out and refuses past a budget
// of outstanding bytes (a device running out), for the allocator tests.
struct CountingSource {
  static inline int64_t outstanding = 0, budget = 0;
  static inline int allocations = 0, releases = 0;
  static inline std::vector<size_t> sizes;
  static inline std::map<void*, size_t> live;
  static void* allocate(size_t bytes, int) {
    if (outstanding + static_cast<int64_t>(bytes) > budget) return nullptr;
    outstanding += static_cast<int64_t>(bytes);
    ++allocations;
    sizes.push_back(bytes);
    void* p = std::aligned_alloc(64, bytes);
    std::memset(p, 0x5a, bytes);  // every byte the caller may touch exists
    live[p] = bytes;
    return p;
  }
  static void release(void* p, int) {
    ++releases;
    outstanding -= static_cast<int64_t>(live.at(p));
    live.erase(p);
    std::free(p);
  }
  static void reset(int64_t budget_bytes) {
    outstanding = 0;
    budget = budget_bytes;
    allocations = releases = 0;
    sizes.clear();
    live.clear();
  }
};

// Buffers whose size follows the routing (a new size every micro-batch) meet
// the cached block of their size class instead of fresh memory each time; a
// class wastes at most an eighth of its power of two, and at most 2 MiB; a
// cached block serves a request at most 12.5% smaller than itself.
TEST(TrackedAllocator, SizesThatVaryStepToStepReuseTheBlockOfTheirClass) {
  CountingSource::reset(int64_t{1} << 30);
  {
    TrackedAllocator a(Device::cpu(), MemorySource{CountingSource::allocate, CountingSource::release});
    std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<size_t> jitter(0, 60000);
    const size_t base = size_t{1} << 20;  // class steps of 128 KiB from 1 MiB
    for (int step = 0; step < 50; ++step) {
      const size_t bytes = base + 1 + jitter(rng);  // all inside (1 MiB, 1 MiB + 128 KiB]
      void* p = a.allocate(bytes, MemCategory::comm);
      ASSERT_NE(p, nullptr);
      std::memset(p, step, bytes);
      EXPECT_EQ(a.snapshot().current[static_cast<int>(MemCategory::comm)], static_cast<int64_t>(bytes))
          << "the ledger counts requested bytes";
      a.release(p, bytes, MemCategory::comm);
    }
    EXPECT_EQ(CountingSource::allocations, 1) << "one block served every size of the class";
    EXPECT_EQ(CountingSource::sizes.at(0), base + base / 8);
    EXPECT_EQ(a.snapshot().cached, static_cast<int64_t>(base + base / 8));
    // Half the cached block's size is too small to take it.
    void* half = a.allocate(base / 2, MemCategory::comm);
    EXPECT_EQ(CountingSource::allocations, 2);
    EXPECT_EQ(CountingSource::sizes.back(), base / 2);
    a.release(half, base / 2, MemCategory::comm);
    // Every size from 64 KiB to 64 MiB gets at least what it asked for and
    // at most 12.5% more (plus alignment), from 16 MiB up at most 2 MiB more.
    for (size_t bytes = size_t{64} << 10; bytes <= (size_t{64} << 20); bytes = bytes * 9 / 7 + 13) {
      const int before = CountingSource::allocations;
      void* p = a.allocate(bytes, MemCategory::activation);
      if (CountingSource::allocations > before) {
        const size_t got = CountingSource::sizes.back();
        EXPECT_GE(got, bytes);
        EXPECT_LE(got, bytes + bytes / 8 + 64) << bytes << " bytes";
        EXPECT_LE(got, bytes + (size_t{2} << 20) + 64) << bytes << " bytes";
      }
      a.release(p, bytes, MemCategory::activation);
    }
  }
  EXPECT_EQ(CountingSource::releases, CountingSource::allocations) << "the cache goes back to the source";
}

// When the source refuses (device memory full of cached blocks of other
// sizes), the cache goes back to it and the allocation succeeds.
TEST(TrackedAllocator, ARefusedAllocationReleasesTheCacheAndRetries) {
  CountingSource::reset(int64_t{8} << 20);
  TrackedAllocator a(Device::cpu(), MemorySource{CountingSource::allocate, CountingSource::release});
  std::vector<std::pair<void*, size_t>> held;
  for (size_t mib = 1; mib <= 3; ++mib) held.emplace_back(a.allocate(mib << 20, MemCategory::activation), mib << 20);
  for (auto& [p, bytes] : held) a.release(p, bytes, MemCategory::activation);
  EXPECT_EQ(a.snapshot().cached, int64_t{6} << 20);
  void* big = a.allocate(size_t{7} << 20, MemCategory::activation);  // 6 MiB cached + 7 > the 8 MiB budget
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(CountingSource::releases, 3);
  EXPECT_EQ(a.snapshot().cached, 0);
  a.release(big, size_t{7} << 20, MemCategory::activation);
}

// A refused allocation first takes a cached block that holds it, however
// much it wastes (no block goes back, so no cudaFree waits on the device);
// the block returns to the cache at its own size.
TEST(TrackedAllocator, ARefusedAllocationTakesALargerCachedBlockBeforeReleasingAny) {
  CountingSource::reset(int64_t{8} << 20);
  TrackedAllocator a(Device::cuda(0), MemorySource{CountingSource::allocate, CountingSource::release});
  void* big = a.allocate(size_t{6} << 20, MemCategory::activation);
  void* small = a.allocate(size_t{1} << 20, MemCategory::activation);
  a.release(big, size_t{6} << 20, MemCategory::activation);
  a.release(small, size_t{1} << 20, MemCategory::activation);
  const int64_t cached = a.snapshot().cached;
  // 2 MiB: the 6 MiB block is far past the 12.5% a cached block may spare,
  // so the source is asked first, and it has ~1 MiB left.
  void* p = a.allocate(size_t{2} << 20, MemCategory::activation);
  ASSERT_EQ(p, big);
  EXPECT_EQ(CountingSource::releases, 0);
  EXPECT_EQ(CountingSource::allocations, 2);
  EXPECT_EQ(a.snapshot().cached, cached - static_cast<int64_t>(CountingSource::live.at(big)));
  EXPECT_EQ(a.snapshot().current_total, int64_t{2} << 20) << "the ledger counts the request, not the block";
  a.release(p, size_t{2} << 20, MemCategory::activation);
  EXPECT_EQ(a.snapshot().cached, cached);
}

// On a GPU the cache goes back to CUDA (cudaFree, which waits for the whole
// device) only while no communication is in flight there: with a hold, an
// allocation no cached block can serve ends the job as out of memory
// (exit 2) naming the oldest holder, instead of risking a wait on an op
// that waits on this rank. Host memory goes back to malloc regardless
// (free waits on nothing).
TEST(TrackedAllocatorDeathTest, ADeviceCacheStaysWhileCommunicationIsInFlight) {
  const MemorySource source{CountingSource::allocate, CountingSource::release};
  const auto fill_cache = [](TrackedAllocator& a) {
    std::vector<std::pair<void*, size_t>> blocks;
    for (size_t mib = 1; mib <= 3; ++mib) blocks.emplace_back(a.allocate(mib << 20, MemCategory::activation), mib << 20);
    for (auto& [p, bytes] : blocks) a.release(p, bytes, MemCategory::activation);
  };
  {
    CountingSource::reset(int64_t{8} << 20);
    TrackedAllocator a(Device::cuda(0), source);
    fill_cache(a);
    auto* grads = static_cast<std::byte*>(a.allocate(4096, MemCategory::grad));
    (void)a.hold(grads, 4096, "group pp recv seq 12");
    (void)a.hold(grads, 4096, "group dp all_gather seq 40");
    EXPECT_EXIT(a.allocate(size_t{7} << 20, MemCategory::activation), ::testing::ExitedWithCode(kExitUserError),
                "out of memory on cuda:0: an allocation of 7340032 bytes \\(activation\\) failed with 4096 bytes "
                "live \\(param 0, grad 4096, optim 0, activation 0, comm 0, workspace 0\\) and 6291456 cached in "
                "smaller blocks, which cannot go back to CUDA while communication is in flight on 2 held "
                "range\\(s\\), the oldest group pp recv seq 12");
  }
  for (const Device device : {Device::cuda(0), Device::cpu()}) {
    SCOPED_TRACE(to_string(device));
    CountingSource::reset(int64_t{8} << 20);
    TrackedAllocator a(device, source);
    fill_cache(a);
    auto* grads = static_cast<std::byte*>(a.allocate(4096, MemCategory::grad));
    const int64_t hold = a.hold(grads, 4096, "group dp all_gather seq 40");
    if (device.is_host()) {
      // malloc's free waits on nothing: the hold does not keep the cache.
    } else {
      a.unhold(hold);  // the op completed
    }
    void* big = a.allocate(size_t{7} << 20, MemCategory::activation);
    ASSERT_NE(big, nullptr);
    EXPECT_EQ(CountingSource::releases, 3) << "the cached blocks went back to the source";
    a.release(big, size_t{7} << 20, MemCategory::activation);
    if (device.is_host()) a.unhold(hold);
    a.release(grads, 4096, MemCategory::grad);
  }
}

// Out of memory with nothing cached to give back is the settings' doing:
// the job ends at once with exit 2, the rank's ledger by category and what
// to change, on the host as on a GPU.
TEST(TrackedAllocatorDeathTest, OutOfMemoryEndsTheJobWithTheLedgerAndWhatToChange) {
  for (const Device device : {Device::cuda(0), Device::cpu()}) {
    SCOPED_TRACE(to_string(device));
    CountingSource::reset(int64_t{8} << 20);
    TrackedAllocator a(device, MemorySource{CountingSource::allocate, CountingSource::release});
    void* params = a.allocate(size_t{3} << 20, MemCategory::param);
    void* moments = a.allocate(size_t{4} << 20, MemCategory::optim);
    EXPECT_EXIT(a.allocate(size_t{2} << 20, MemCategory::activation), ::testing::ExitedWithCode(kExitUserError),
                "out of memory on " + to_string(device) +
                    ": an allocation of 2097152 bytes \\(activation\\) failed with 7340032 bytes live \\(param "
                    "3145728, grad 0, optim 4194304, activation 0, comm 0, workspace 0\\) and 0 cached; the run "
                    "needs less memory per rank: a smaller training.micro_batch");
    a.release(params, size_t{3} << 20, MemCategory::param);
    a.release(moments, size_t{4} << 20, MemCategory::optim);
  }
}

// Holds (the communicators' in-flight check): a buffer overlapping a held
// range cannot be released while the hold lasts, whichever end overlaps;
// buffers beside it, zero-byte holds and released holds stop nothing, and
// holds of several holders may overlap.
TEST(TrackedAllocator, HeldRangesStopOnlyTheReleasesThatOverlapThem) {
  CountingSource::reset(int64_t{1} << 30);
  TrackedAllocator a(Device::cpu(), MemorySource{CountingSource::allocate, CountingSource::release});
  auto* lo = static_cast<std::byte*>(a.allocate(4096, MemCategory::comm));
  auto* hi = static_cast<std::byte*>(a.allocate(4096, MemCategory::comm));
  const int64_t whole = a.hold(lo, 4096, "op A");
  const int64_t part = a.hold(lo + 100, 8, "op B");  // overlaps op A's
  (void)a.hold(hi, 0, "op C");                         // holds nothing, never released
  a.release(hi, 4096, MemCategory::comm);               // beside the holds
  a.unhold(whole);
  a.unhold(part);
  a.release(lo, 4096, MemCategory::comm);
  EXPECT_EQ(a.snapshot().current_total, 0);
}

TEST(TrackedAllocatorDeathTest, ReleasingABufferUnderAHoldAbortsNamingTheHolder) {
  CountingSource::reset(int64_t{1} << 30);
  TrackedAllocator a(Device::cpu(), MemorySource{CountingSource::allocate, CountingSource::release});
  auto* p = static_cast<std::byte*>(a.allocate(4096, MemCategory::grad));
  auto* q = static_cast<std::byte*>(a.allocate(256, MemCategory::comm));
  (void)a.hold(p + 4000, 96, "group dp reduce_scatter seq 7");  // the buffer's last bytes
  EXPECT_EXIT(a.release(p, 4096, MemCategory::grad), ::testing::ExitedWithCode(kExitInternal),
              "cpu buffer of 4096 bytes \\(grad\\) freed while group dp reduce_scatter seq 7 was in flight on it");
  (void)a.hold(q, 1, "group ep all_to_all_v seq 3");  // the buffer's first byte
  EXPECT_EXIT(a.release(q, 256, MemCategory::comm), ::testing::ExitedWithCode(kExitInternal),
              "freed while group ep all_to_all_v seq 3 was in flight");
}

TEST(Tensor, HostToHostCopiesAndFills) {
  const Tensor src = random_host({5, 7}, 3);
  const Tensor copy = src.to(Device::cpu());
  EXPECT_NE(copy.raw(), src.raw()) << "to() must copy, not alias";
  EXPECT_EQ(copy.shape(), src.shape());
  EXPECT_EQ(copy.category(), src.category());
  EXPECT_TRUE(same_bits(copy, src));
  Tensor dst = Tensor::empty({35}, DType::f32, MemCategory::activation);
  dst.copy_from(src);
  EXPECT_TRUE(same_bits(dst, src));
  dst.fill_zero();
  for (int64_t i = 0; i < dst.numel(); ++i) ASSERT_EQ(dst.f32()[i], 0.0f);
  EXPECT_NE(src.f32()[0], 0.0f) << "fill_zero reached the source";
}

TEST(ExecContext, CopyAndToOnTheHostMoveEveryBitAndKeepTheCategory) {
  const ExecContext ctx = ExecContext::cpu(1);
  const Tensor src = random_host({6, 5}, 12, MemCategory::grad);
  const Tensor copy = ctx.to(src, Device::cpu());
  EXPECT_NE(copy.raw(), src.raw()) << "to() must copy, not alias";
  EXPECT_EQ(copy.shape(), src.shape());
  EXPECT_EQ(copy.category(), MemCategory::grad);
  EXPECT_TRUE(same_bits(copy, src));
  // Into a view: rows 1..3 of a larger tensor, the rest untouched.
  const Tensor big = random_host({8, 5}, 13);
  const Tensor before = big.to(Device::cpu());
  ctx.copy(big.slice(1, 3), src.slice(2, 3));
  for (int64_t r = 0; r < 8; ++r)
    for (int64_t c = 0; c < 5; ++c)
      ASSERT_EQ(big.f32()[r * 5 + c], r >= 1 && r < 4 ? src.f32()[(r + 1) * 5 + c] : before.f32()[r * 5 + c]) << r;
}

// On the host read_later copies at once: the read keeps the values of when
// it was queued, whatever happens to the source after, in the source's
// shape, dtype and category; copies of a read share it.
TEST(ExecContext, ReadLaterOnTheHostKeepsTheValuesOfWhenItWasQueued) {
  const ExecContext ctx = ExecContext::cpu(1);
  Tensor src = random_host({3, 7}, 18, MemCategory::workspace);
  const Tensor before = src.to(Device::cpu());
  HostRead read = ctx.read_later(src);
  ASSERT_TRUE(read.defined());
  add_inplace(ctx, src, random_host({3, 7}, 19));
  HostRead copy = read;
  const Tensor& got = read.get();
  EXPECT_EQ(got.device(), Device::cpu());
  EXPECT_EQ(got.shape(), src.shape());
  EXPECT_EQ(got.category(), MemCategory::workspace);
  EXPECT_TRUE(same_bits(got, before));
  EXPECT_EQ(copy.get().raw(), got.raw()) << "copies of a read share its host tensor";
  EXPECT_FALSE(HostRead().defined());
}

TEST(ExecContext, ReadLaterGivesAnAccumulatorsScalar) {
  const ExecContext ctx = ExecContext::cpu(1);
  Tensor acc = ctx.zeros({1}, DType::f64, MemCategory::workspace);
  const Tensor x = random_host({257}, 20);
  sum_add(ctx, x, acc);
  sum_add(ctx, x, acc);
  const double once = sum(ctx, x);
  EXPECT_EQ(ctx.read_later(acc).scalar_f64(), once + once) << "two adds from zero, each sum's own fp64 total";
}

// The host stand-in (cpu:1) is host memory, but its elements are its
// kernels' alone, as a GPU's are: ops read and write them (the dispatch's
// kernel scope), a copy to plain cpu is readable, and host code reading or
// writing them directly fails naming the tensor, as it would on a GPU.
TEST(ExecContext, TheStandInsElementsAreReadThroughItsOpsAndCopies) {
  const ExecContext ctx = ExecContext::host_stand_in(1);
  const Tensor x_host = random_host({5, 3}, 31), y_host = random_host({5, 3}, 32);
  Tensor x = ctx.to(x_host, ctx.device()), y = ctx.to(y_host, ctx.device());
  ASSERT_EQ(y.device(), (Device{DeviceKind::cpu, 1}));
  axpy(ctx, 2.0f, x, y);
  const Tensor got = y.on_host();
  ASSERT_EQ(got.device(), Device::cpu());
  for (int64_t i = 0; i < got.numel(); ++i)
    EXPECT_EQ(got.f32()[i], y_host.f32()[i] + 2.0f * x_host.f32()[i]) << i;
  EXPECT_EQ(ctx.read_later(y).get().device(), Device::cpu());
}

// A new stand-in tensor holds garbage until written, as a GPU's does (fresh
// host pages are zero, which would hide a read of unwritten elements): NaN
// in every float dtype, negative in the integer ones; zeros() are zeros.
TEST(ExecContext, TheStandInsNewTensorsHoldGarbageUntilWritten) {
  const ExecContext ctx = ExecContext::host_stand_in(1);
  const Tensor f = ctx.empty({64, 33}, DType::f32, MemCategory::activation).on_host();
  for (int64_t i = 0; i < f.numel(); ++i) ASSERT_TRUE(std::isnan(f.f32()[i])) << i;
  const Tensor b = ctx.empty({7}, DType::bf16, MemCategory::activation).on_host_f32();
  for (int64_t i = 0; i < b.numel(); ++i) ASSERT_TRUE(std::isnan(b.f32()[i])) << i;
  const Tensor d = ctx.empty({3}, DType::f64, MemCategory::optim).on_host();
  for (int64_t i = 0; i < d.numel(); ++i) ASSERT_TRUE(std::isnan(d.data<double>()[i])) << i;
  const Tensor n = ctx.empty({9}, DType::i64, MemCategory::workspace).on_host();
  for (int64_t i = 0; i < n.numel(); ++i) ASSERT_LT(n.data<int64_t>()[i], 0) << i;
  const Tensor z = ctx.zeros({5}, DType::f32, MemCategory::grad).on_host();
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.f32()[i], 0.0f) << i;
}

TEST(ExecContextDeathTest, HostCodeTouchingTheStandInsElementsFailsAsOnAGpu) {
  const ExecContext ctx = ExecContext::host_stand_in(1);
  const Tensor t = ctx.zeros({4, 2}, DType::f32, MemCategory::activation);
  EXPECT_EXIT((void)t.f32(), ::testing::ExitedWithCode(kExitInternal),
              "host access to the elements of a f32 \\[4, 2\\] tensor on cpu:1 .*the host stand-in's elements are its "
              "kernels' alone");
  EXPECT_EXIT((void)t.raw(), ::testing::ExitedWithCode(kExitInternal), "tensor on cpu:1");
}

TEST(ExecContextDeathTest, ScalarReadRefusesAnythingButOneF64) {
  const ExecContext ctx = ExecContext::cpu(1);
  EXPECT_EXIT(ctx.read_later(random_host({2}, 21)).scalar_f64(), ::testing::ExitedWithCode(kExitInternal),
              "scalar_f64 of f32 \\[2\\], not f64 \\[1\\]");
}

TEST(ExecContextDeathTest, CopyRefusesMismatchedElementsNamingBoth) {
  const ExecContext ctx = ExecContext::cpu(1);
  const Tensor a = random_host({4, 3}, 14);
  const Tensor b = Tensor::empty({4, 3}, DType::i32, MemCategory::activation);
  EXPECT_EXIT(ctx.copy(b, a), ::testing::ExitedWithCode(kExitInternal), "copy of \\[4, 3\\] f32 into \\[4, 3\\] i32");
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

class CudaDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = no_cuda_reason();
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
};

TEST_F(CudaDevice, RoundTripIsBitwiseAndTheDeviceLedgerCountsIt) {
  const Tensor host = random_host({257, 33}, 4, MemCategory::param);
  const int param = static_cast<int>(MemCategory::param);
  TrackedAllocator& dev = TrackedAllocator::of(Device::cuda(0));
  const int64_t dev_before = dev.snapshot().current[param];
  const int64_t host_before = TrackedAllocator::host().snapshot().current[param];
  {
    const Tensor d = host.to(Device::cuda(0));
    EXPECT_EQ(d.device(), Device::cuda(0));
    EXPECT_EQ(d.category(), MemCategory::param);
    EXPECT_EQ(dev.snapshot().current[param] - dev_before, static_cast<int64_t>(host.nbytes()));
    EXPECT_EQ(TrackedAllocator::host().snapshot().current[param], host_before) << "a device tensor counted on the host";
    const Tensor back = d.to(Device::cpu());
    EXPECT_TRUE(same_bits(back, host));
    // Device to device, then a view's copy_from in both directions.
    Tensor d2 = Tensor::empty(host.shape(), DType::f32, MemCategory::param, Device::cuda(0));
    d2.copy_from(d);
    EXPECT_TRUE(same_bits(d2.to(Device::cpu()), host));
    Tensor rows_host = Tensor::empty({10, 33}, DType::f32, MemCategory::activation);
    rows_host.copy_from(d2.slice(100, 10));
    EXPECT_EQ(std::memcmp(rows_host.raw(), host.slice(100, 10).raw(), rows_host.nbytes()), 0);
  }
  EXPECT_EQ(dev.snapshot().current[param], dev_before);
}

TEST_F(CudaDevice, FillZeroOnTheDevice) {
  const Tensor host = random_host({1000}, 5);
  Tensor d = host.to(Device::cuda(0));
  d.slice(100, 200).fill_zero();
  const Tensor back = d.to(Device::cpu());
  for (int64_t i = 0; i < 1000; ++i) {
    if (i >= 100 && i < 300) {
      ASSERT_EQ(back.f32()[i], 0.0f) << i;
    } else {
      ASSERT_EQ(back.f32()[i], host.f32()[i]) << i;
    }
  }
}

TEST_F(CudaDevice, ContextHasAStreamAndAHandle) {
  const ExecContext ctx = ExecContext::cuda(0);
  EXPECT_EQ(ctx.device(), Device::cuda(0));
  EXPECT_NE(ctx.stream(), nullptr);
  EXPECT_NE(ctx.blas(), nullptr);
  const Tensor w = ctx.workspace(4096);
  EXPECT_EQ(w.device(), Device::cuda(0));
  ctx.synchronize();
}

// One random vector x on the host and on cuda:0, and y = x on both; add(k)
// queues y += x k times on the device and does the same on the host, so the
// host's y is what the device's must hold once the stream reaches that point
// (each add rounds once, the same on both).
struct PairedAdds {
  const ExecContext& ctx;
  const ExecContext host_ctx = ExecContext::cpu(1);
  Tensor x, y_host, x_dev, y_dev;
  PairedAdds(const ExecContext& c, int64_t n, uint32_t seed)
      : ctx(c),
        x(random_host({n}, seed)),
        y_host(x.to(Device::cpu())),
        x_dev(ctx.to(x, ctx.device())),
        y_dev(ctx.to(x, ctx.device())) {}
  void add(int k) {
    for (int i = 0; i < k; ++i) {
      add_inplace(ctx, y_dev, x_dev);
      add_inplace(host_ctx, y_host, x);
    }
  }
};

// ExecContext::copy/to are queued on the context's stream (no device-wide
// wait): a copy must still see every op queued before it on that stream. 16
// adds over 16M elements keep the stream busy for a while after the host
// has queued them; the device-to-device copy of a slice and the copy to the
// host behind it must read the final sums, bitwise the host's (each add
// rounds once, the same on both).
TEST_F(CudaDevice, ContextCopiesSeeEveryOpQueuedBeforeThemOnTheStream) {
  const ExecContext ctx = ExecContext::cuda(0);
  const int64_t n = int64_t{1} << 24;
  PairedAdds p(ctx, n, 15);
  Tensor &y_dev = p.y_dev, &y_host = p.y_host;
  EXPECT_EQ(p.x_dev.device(), Device::cuda(0));
  EXPECT_EQ(p.x_dev.category(), MemCategory::activation);
  p.add(16);
  const int64_t begin = 1000, count = n - 3000;
  Tensor part = ctx.empty({count}, DType::f32, MemCategory::activation);
  ctx.copy(part, y_dev.flat_view(begin, count, {count}));  // device to device, not waited for
  const Tensor back = ctx.to(part, Device::cpu());         // waits for the stream
  EXPECT_EQ(back.device(), Device::cpu());
  EXPECT_EQ(std::memcmp(back.raw(), y_host.flat_view(begin, count, {count}).raw(), back.nbytes()), 0);
  // Host into a device view, then back: the rows around it are untouched.
  const Tensor patch = random_host({100}, 16);
  ctx.copy(y_dev.flat_view(50, 100, {100}), patch);
  const Tensor head = ctx.to(y_dev.flat_view(0, 200, {200}), Device::cpu());
  for (int64_t i = 0; i < 200; ++i)
    ASSERT_EQ(head.f32()[i], i >= 50 && i < 150 ? patch.f32()[i - 50] : y_host.f32()[i]) << i;
}

// Needs the CUDA runtime itself (a host function on the stream), so only a
// CUDA build has it.
#ifdef ORIGAMI_WITH_CUDA
// read_later waits for its own point of the stream, not for what was queued
// after it: the stream is held by a host function sleeping 1 s between two
// reads, and the first read returns at once with the values of 16 adds, the
// second after the sleep with those of 32 (bitwise the host's adds). Then
// reads dropped before they were taken, their pinned buffers reused behind
// copies still in flight, and a last read that must see the last add.
TEST_F(CudaDevice, ReadLaterWaitsForItsPointOfTheStreamNotForLaterWork) {
  const ExecContext ctx = ExecContext::cuda(0);
  PairedAdds p(ctx, int64_t{1} << 20, 20);
  const Tensor &y_dev = p.y_dev, &y_host = p.y_host;
  {  // two pinned buffers in the pool first: cudaHostAlloc may wait for the device, which would hide the sleep
    HostRead warm_a = ctx.read_later(y_dev), warm_b = ctx.read_later(y_dev);
    (void)warm_a.get();
    (void)warm_b.get();
  }
  p.add(16);
  HostRead first = ctx.read_later(y_dev);
  const Tensor want_first = y_host.to(Device::cpu());
  ASSERT_EQ(cudaLaunchHostFunc(
                static_cast<cudaStream_t>(ctx.stream()),
                [](void*) { std::this_thread::sleep_for(std::chrono::seconds(1)); }, nullptr),
            cudaSuccess);
  p.add(16);
  HostRead second = ctx.read_later(y_dev);
  const auto t0 = std::chrono::steady_clock::now();
  const Tensor& got_first = first.get();
  const double first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(first_s, 0.5) << "the first read waited for work queued after it";
  EXPECT_TRUE(same_bits(got_first, want_first));
  EXPECT_TRUE(same_bits(second.get(), y_host));
  const double second_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(second_s, 0.5) << "the second read did not wait for the sleep queued before it";

  for (int i = 0; i < 50; ++i) {
    p.add(1);
    (void)ctx.read_later(y_dev);  // dropped in flight: its buffer goes back to the pool
  }
  HostRead last = ctx.read_later(y_dev);
  EXPECT_TRUE(same_bits(last.get(), y_host));
}
#endif

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

TEST_F(CudaDevice, FusedAdamWIsTheCallsItFusesBitForBit) {
  expect_fused_adamw_is_the_calls_one_by_one(ExecContext::cuda(0));
}

using CudaDeviceDeathTest = CudaDevice;

TEST_F(CudaDeviceDeathTest, AContextCopiesOnlyItsOwnDeviceAndTheHost) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs a second device: every tensor here is on cuda:0 or the host";
  const ExecContext ctx = ExecContext::cuda(1);
  const Tensor d0 = random_host({8}, 17).to(Device::cuda(0));
  Tensor h = Tensor::empty({8}, DType::f32, MemCategory::activation);
  EXPECT_EXIT(ctx.copy(h, d0), ::testing::ExitedWithCode(kExitInternal),
              "copy from cuda:0 to cpu on a context of cuda:1");
}

TEST_F(CudaDeviceDeathTest, HostReadOfADeviceTensorIsAClearError) {
  const Tensor d = random_host({8}, 6).to(Device::cuda(0));
  EXPECT_EXIT((void)d.f32(), ::testing::ExitedWithCode(kExitInternal),
              "host access to the elements of a f32 \\[8\\] tensor on cuda:0");
}

TEST_F(CudaDeviceDeathTest, AnOpRefusesADtypeItDoesNotTakeNamingIt) {
  const ExecContext ctx = ExecContext::cuda(0);
  const Tensor src = Tensor::zeros({4, 4}, DType::i32, MemCategory::activation, Device::cuda(0));
  Tensor dst = Tensor::empty({4, 4}, DType::f32, MemCategory::activation, Device::cuda(0));
  EXPECT_EXIT(cast(ctx, src, dst), ::testing::ExitedWithCode(kExitInternal),
              "cast converts between f32 and bf16, not i32 to f32");
}

TEST_F(CudaDeviceDeathTest, MixedDevicesAreRefusedBeforeAnyBackendRuns) {
  const ExecContext ctx = ExecContext::cpu(1);
  const Tensor host = random_host({4, 4}, 8);
  const Tensor dev = host.to(Device::cuda(0));
  Tensor c = Tensor::empty({4, 4}, DType::f32, MemCategory::activation);
  EXPECT_EXIT(gemm(ctx, host, Trans::no, dev, Trans::no, c), ::testing::ExitedWithCode(kExitInternal),
              "gemm: the context runs on cpu but B is on cuda:0");
}

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

TEST_F(CudaDeviceDeathTest, ACrossEntropyTargetOutOfRangeStopsTheJobNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto bad_target = [] {
    route_stdout_to_stderr();
    const ExecContext ctx = ExecContext::cuda(0);
    const Tensor logits = random_host({4, 8}, 51).to(Device::cuda(0));
    Tensor targets_host = Tensor::empty({4}, DType::i32, MemCategory::activation);
    for (int32_t t = 0; t < 4; ++t) targets_host.i32()[t] = t == 3 ? 8 : t;  // token 3's is V
    const Tensor targets = targets_host.to(Device::cuda(0));
    Tensor loss = ctx.empty({4}, DType::f32, MemCategory::activation);
    Tensor lse = ctx.empty({4}, DType::f32, MemCategory::activation);
    cross_entropy_forward(ctx, logits, targets, loss, lse);
    ctx.synchronize();
  };
  EXPECT_EXIT(bad_target(), ::testing::ExitedWithCode(kExitInternal),
              "cross-entropy target 8 of token 3 is outside \\[0, 8\\)");
  EXPECT_EXIT(bad_target(), ::testing::ExitedWithCode(kExitInternal), "check failed: .*cudaError");
}

TEST_F(CudaDeviceDeathTest, AnExpertIndexOutOfRangeStopsTheJobNamingTheRule) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto bad_expert = [] {
    route_stdout_to_stderr();
    const ExecContext ctx = ExecContext::cuda(0);
    Tensor expert_host = Tensor::empty({3, 2}, DType::i32, MemCategory::activation);
    const int32_t experts[] = {0, 1, 2, 3, 1, 4};  // 4 experts: the last slot names expert 4
    std::copy(std::begin(experts), std::end(experts), expert_host.i32());
    const Tensor expert_TK = expert_host.to(Device::cuda(0));
    Tensor count_E = ctx.empty({4}, DType::i64, MemCategory::activation);
    moe_expert_histogram(ctx, expert_TK, Tensor(), 4, count_E);
    ctx.synchronize();
  };
  EXPECT_EXIT(bad_expert(), ::testing::ExitedWithCode(kExitInternal),
              "moe_expert_histogram: expert index outside \\[0, num_experts\\)");
  EXPECT_EXIT(bad_expert(), ::testing::ExitedWithCode(kExitInternal), "check failed: .*cudaError");
}

#ifdef ORIGAMI_WITH_CUDA
// Nothing maps cuBLAS until the first use (kernels/cuda/cublas_library.h):
// CPU ranks and host-only commands do not pay its ~211 MB. Loading needs
// the library, not a device, so this runs on any CUDA build.
TEST(CudaLibraries, CublasLoadsOnFirstUseAndNotBefore) {
  auto mapped = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find("libcublas") != std::string::npos) return true;
    return false;
  };
  ASSERT_FALSE(cuda::cublas_loaded());
  EXPECT_FALSE(mapped()) << "libcublas is mapped before first use: is it linked again?";
  const cuda::CublasLibrary& api = cuda::cublas();
  EXPECT_TRUE(cuda::cublas_loaded());
  EXPECT_TRUE(mapped());
  ASSERT_NE(api.status_name, nullptr);
  EXPECT_STREQ(api.status_name(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_NE(api.create, nullptr);
  EXPECT_NE(api.destroy, nullptr);
  EXPECT_NE(api.set_stream, nullptr);
  EXPECT_NE(api.status_string, nullptr);
}
#endif

}  // namespace
}  // namespace origami
