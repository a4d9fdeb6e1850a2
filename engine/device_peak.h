// The compute device's dense-GEMM rate, measured once at start-up: the peak
// that a run's MFU is a fraction of (the step line, metrics.jsonl). Measured,
// not looked up from a datasheet, so MFU means the same on any machine:
// CUDA: an n×n×n GEMM with bf16 inputs and fp32 accumulation (the tensor-core
// rate a bf16 run can reach, whichever precision this run trains in); host:
// fp32 (oneDNN sgemm on the context's threads, the CPU engine's only
// precision). The best of a few timed repetitions after a warm-up (on a GPU
// a quarter of a second of GEMMs, since its clocks ramp up under load).
//
// Host ranks of one node share its cores, so one of them (the node's first)
// measures, alone, on the threads each rank runs, and every rank of the node
// takes that figure: measured by all at once, ranks oversubscribing the
// cores would time each other's contention, not the machine (and 8 ranks on
// 2 cores spent 0.7 s of every start-up doing it). Each GPU rank has a
// device of its own and measures it.
#pragma once
#include <cstdint>

#include "comm/communicator.h"
#include "kernels/context.h"

namespace origami {

struct GemmPeak {
  double flops_per_s = 0;
  int64_t n = 0;  // the GEMM's size
  DType dtype = DType::f32;
};

// Collective over `node` (the ranks on this node; null: this rank alone) when
// ctx is a host device.
GemmPeak measure_gemm_peak(const ExecContext& ctx, comm::Communicator* node);

}  // namespace origami
