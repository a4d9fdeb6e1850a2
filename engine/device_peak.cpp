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

GemmPeak measure_alone(const ExecContext& ctx) {
  const bool gpu = !ctx.device().is_host();
  // Large enough to reach the device's rate (H200: 8192³ bf16 ≈ 1.1 TFLOP,
  // ~2 ms), small enough to cost a fraction of a second at start-up (host:
  // 1024³ fp32 ≈ 2.1 GFLOP, ~10 ms on two AVX-512 cores).
  GemmPeak peak;
  peak.n = gpu ? 8192 : kHostPeakN;
  peak.dtype = gpu ? DType::bf16 : DType::f32;
  const int64_t n = peak.n;
  auto operand = [&](const char* name) {
    Tensor x = ctx.empty({n, n}, DType::f32, MemCategory::workspace);
    init_normal(ctx, x, /*seed=*/1, name, 0, 1.0f);
    if (peak.dtype == DType::f32) return x;
    Tensor y = ctx.empty({n, n}, peak.dtype, MemCategory::workspace);
    cast(ctx, x, y);
    return y;
  };
  const Tensor A = operand("peak.A"), B = operand("peak.B");
  Tensor C = ctx.empty({n, n}, peak.dtype, MemCategory::workspace);  // one dtype per gemm call
  using Clock = std::chrono::steady_clock;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {  // the first warms up (handles, JIT, clocks)
    ctx.synchronize();
    const auto t0 = Clock::now();
    gemm(ctx, A, Trans::no, B, Trans::yes, C);
    ctx.synchronize();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (rep > 0 && s > 0) best = std::max(best, 2.0 * static_cast<double>(n) * n * n / s);
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
