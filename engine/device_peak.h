// The compute device's dense-GEMM rate, measured once at start-up: the peak
// that a run's MFU is a fraction of (the step line, metrics.jsonl). Measured,
// not looked up from a datasheet, so MFU means the same on any machine:
// CUDA: an n×n×n GEMM with bf16 inputs and fp32 accumulation (the tensor-core
// rate a bf16 run can reach, whichever precision this run trains in); host:
// fp32 (oneDNN sgemm on the context's threads, the CPU engine's only
// precision). The best of a few timed repetitions after a warm-up.
#pragma once
#include <cstdint>

#include "kernels/context.h"

namespace origami {

struct GemmPeak {
  double flops_per_s = 0;
  int64_t n = 0;  // the GEMM's size
  DType dtype = DType::f32;
};

GemmPeak measure_gemm_peak(const ExecContext& ctx);

}  // namespace origami
