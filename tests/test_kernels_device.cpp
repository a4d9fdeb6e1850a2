// Devices, execution contexts, per-device ledgers, Tensor::to / copy_from /
// fill_zero, ExecContext::copy / to and the dispatch's device rule. The host half runs everywhere;
// the CUDA half needs a CUDA build and a device and skips (naming which is
// missing) otherwise. Values are fresh random floats compared bitwise: a copy
// either moves every bit or it is wrong.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/allocator.h"
#include "kernels/check.h"
#include "kernels/context.h"
#include "kernels/device.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/tensor.h"
#include "device_test_util.h"
#ifdef ORIGAMI_WITH_CUDA
#include <cuda_runtime.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "kernels/cuda/cublas_library.h"
#endif

namespace origami {
namespace {

using testing::CudaDevice;
using testing::no_cuda_reason;
using testing::random_host;
using testing::same_bits;

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
                                          "PMIX_RANK", "PMI_RANK", "CUDA_MODULE_LOADING",
                                          "CUDA_DEVICE_MAX_CONNECTIONS"};
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

// The driver's hardware queues: raised to its most for a multi-rank job, so
// that fewer streams share one; a user's value is kept.
TEST(Device, MultiRankJobsGetTheMostHardwareQueuesUnlessTheUserChose) {
  const LaunchEnv env;
  auto connections = [] {
    const char* x = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    return std::string(x ? x : "(unset)");
  };
  EXPECT_EQ(choose_cuda_device_max_connections(), "");
  EXPECT_EQ(connections(), "(unset)");
  setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  EXPECT_EQ(choose_cuda_device_max_connections(), "");
  EXPECT_EQ(connections(), "(unset)");
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_EQ(choose_cuda_device_max_connections(), "32");
  EXPECT_EQ(connections(), "32");
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
  EXPECT_EQ(choose_cuda_device_max_connections(), "1");
  EXPECT_EQ(connections(), "1");
}

// Serialised streams are refused only where point-to-point channels would
// post receives ahead (a pipeline, ring attention).
TEST(Device, SerialisedStreamsAreRefusedWherePointToPointChannelsRun) {
  EXPECT_EQ(cuda_stream_serialization_rule(nullptr, nullptr, true), "");
  EXPECT_EQ(cuda_stream_serialization_rule("8", "0", true), "");
  EXPECT_EQ(cuda_stream_serialization_rule("32", nullptr, true), "");
  EXPECT_EQ(cuda_stream_serialization_rule("1", "1", false), "");
  EXPECT_EQ(cuda_stream_serialization_rule("1", nullptr, true),
            "CUDA_DEVICE_MAX_CONNECTIONS=1 gives the GPU one hardware queue for every stream");
  EXPECT_EQ(cuda_stream_serialization_rule(" 1 ", nullptr, true),
            "CUDA_DEVICE_MAX_CONNECTIONS=1 gives the GPU one hardware queue for every stream");
  EXPECT_EQ(cuda_stream_serialization_rule("12", "1", true),
            "NCCL_LAUNCH_ORDER_IMPLICIT=1 runs each NCCL kernel only after the one launched before it");
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

// ---- CUDA (device present) -------------------------------------------------

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

// The device allocator on a GPU that runs out (kernels/allocator.cpp over
// cudaMalloc; M is the device's memory): with 45% of M cached, CUDA refuses
// a request for 60%, the cache goes back and the retry succeeds; with that
// 60% block cached, CUDA refuses a request for 50% (which the cache does
// not serve first: the block would waste more than an eighth) and the
// cached block serves it, returning to the cache at its own size.
TEST_F(CudaDevice, ARefusedDeviceAllocationReleasesTheCacheOrTakesALargerCachedBlock) {
  TrackedAllocator& a = TrackedAllocator::of(Device::cuda(0));
  a.release_cached();
  const double M = static_cast<double>(cuda_device_memory(0));
  const auto part = [&](double f) { return static_cast<size_t>(M * f) / 4096 * 4096; };
  const size_t first = part(0.45), second = part(0.6), third = part(0.5);
  void* p = a.allocate(first, MemCategory::activation);
  a.release(p, first, MemCategory::activation);
  ASSERT_GE(a.snapshot().cached, static_cast<int64_t>(first));
  p = a.allocate(second, MemCategory::activation);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(a.snapshot().cached, 0) << "the cached 45% went back to CUDA for the 60% request";
  a.release(p, second, MemCategory::activation);
  const int64_t cached = a.snapshot().cached;
  ASSERT_GE(cached, static_cast<int64_t>(second));
  p = a.allocate(third, MemCategory::activation);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(a.snapshot().cached, 0) << "the cached 60% block served the refused 50% request";
  a.release(p, third, MemCategory::activation);
  EXPECT_EQ(a.snapshot().cached, cached) << "the block returned to the cache at its own size";
  a.release_cached();
}

using CudaDeviceDeathTest = CudaDevice;

// A device allocation past the GPU's memory, with nothing cached to give
// back, ends the job at once with the user-error status (the settings' doing:
// kernels/allocator.cpp), naming the device, the request and the ledger.
TEST_F(CudaDeviceDeathTest, AnAllocationPastTheGpusMemoryEndsTheJobWithTheLedger) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts afresh: a CUDA context does not survive fork
  const size_t twice = 2 * cuda_device_memory(0);
  EXPECT_EXIT((void)TrackedAllocator::of(Device::cuda(0)).allocate(twice, MemCategory::activation),
              ::testing::ExitedWithCode(kExitUserError),
              "out of memory on cuda:0: an allocation of " + std::to_string(twice) +
                  " bytes \\(activation\\) failed with [0-9]+ bytes live");
}

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
