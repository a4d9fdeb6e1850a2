// Start-up GEMM peak (see device_peak.h).
#include "engine/device_peak.h"

#include <algorithm>
#include <chrono>
#include <span>

#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/init.h"

namespace origami {

namespace {

constexpr int64_t kHostPeakN = 1024;

// How the rate is timed. A GPU idles at a few hundred MHz and reaches its
// boost clock only after tens of milliseconds of load (H200: 345 MHz idle,
// 1980 MHz under GEMMs, KINDS.md of the device library): a peak timed right
// after one warm-up GEMM (~1.4 ms) can catch the clock still rising, read
// low, and inflate every MFU divided by it. So the GPU warms up for a fixed
// time first, then times batches of back-to-back GEMMs between two
// synchronizations (the host's wait amortized over the batch) and keeps the
// best batch. The host's sgemm needs no ramp, and each extra repetition is
// ~10 ms of every start-up: one warm-up, then the best of two.
struct Timing {
  double warmup_s;  // at least this long of GEMMs before timing (and at least one)
  int batches, per_batch;
};
constexpr Timing kGpuTiming{0.25, 3, 10};
constexpr Timing kHostTiming{0.0, 2, 1};

GemmPeak measure_alone(const ExecContext& ctx) {
  const bool gpu = !ctx.device().is_host();
  // Large enough to reach the device's rate (H200: 8192³ bf16 ≈ 1.1 TFLOP,
  // ~1.4 ms), small enough to cost a fraction of a second at start-up (host:
  // 1024³ fp32 ≈ 2.1 GFLOP, ~10 ms on two AVX-512 cores).
  GemmPeak peak;
  peak.n = gpu ? 8192 : kHostPeakN;
  peak.dtype = gpu ? DType::bf16 : DType::f32;
  const Timing timing = gpu ? kGpuTiming : kHostTiming;
  const int64_t n = peak.n;
  // Operands: random on a GPU, whose power draw, and so its clock under the
  // board's limit, follows how many bits toggle (constant operands would time
  // an optimistic peak); a constant on the host, whose sgemm takes as long
  // for any normal values, and where drawing 2·n² Box-Muller normals (~0.15
  // s) cost more than the timing itself at every start-up.
  auto operand = [&](const char* name, float host_value) {
    Tensor x = ctx.empty({n, n}, DType::f32, MemCategory::workspace);
    if (gpu)
      init_normal(ctx, x, /*seed=*/1, name, 0, 1.0f);
    else
      init_constant(ctx, x, host_value);
    if (peak.dtype == DType::f32) return x;
    Tensor y = ctx.empty({n, n}, peak.dtype, MemCategory::workspace);
    cast(ctx, x, y);
    return y;
  };
  const Tensor A = operand("peak.A", 0.5f), B = operand("peak.B", 0.25f);  // host: C = n/8, exact
  Tensor C = ctx.empty({n, n}, peak.dtype, MemCategory::workspace);  // one dtype per gemm call
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  // Warm-up: handles, plan selection, and (GPU) the clocks.
  ctx.synchronize();
  const auto warm0 = Clock::now();
  do {
    gemm(ctx, A, Trans::no, B, Trans::yes, C);
    ctx.synchronize();
  } while (seconds_since(warm0) < timing.warmup_s);
  double best = 0;
  for (int b = 0; b < timing.batches; ++b) {
    const auto t0 = Clock::now();
    for (int i = 0; i < timing.per_batch; ++i) gemm(ctx, A, Trans::no, B, Trans::yes, C);
    ctx.synchronize();
    const double s = seconds_since(t0);
    if (s > 0) best = std::max(best, 2.0 * static_cast<double>(n) * n * n * timing.per_batch / s);
  }
  peak.flops_per_s = best;
  return peak;
}

}  // namespace

GemmPeak measure_gemm_peak(const ExecContext& ctx, comm::Communicator* node) {
  if (!ctx.device().is_host() || !node || node->size() == 1) return measure_alone(ctx);
  double flops_per_s = 0;
  if (node->rank() == 0) flops_per_s = measure_alone(ctx).flops_per_s;
  // The others sleep while they wait, leaving the cores to the measurement.
  node->broadcast_async(std::span<double>(&flops_per_s, 1), 0).wait(/*sleep_when_idle=*/true);
  return GemmPeak{flops_per_s, kHostPeakN, DType::f32};
}

}  // namespace origami
