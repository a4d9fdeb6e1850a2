// The CUDA half of ExecContext's state (created and destroyed by
// kernels/cuda/context.cpp) and the cuBLASLt helpers that gemm.cu and
// grouped_gemm.cu share. Included by kernels/cuda sources, and by
// tests/test_kernels_cuda_ops.cpp, which reads the plan cache's size.
//
// A context owns, once, for its lifetime:
//  - its stream, and a cuBLAS and a cuBLASLt handle used on it;
//  - one 32 MiB workspace from the tracked allocator (MemCategory::workspace)
//    that both handles share: every cuBLAS/cuBLASLt call of a context runs on
//    its one stream, so one call's scratch is dead before the next call's
//    kernels start. A workspace of our own per stream is also what cuBLAS's
//    reproducibility note asks for (its default pool is shared between
//    streams, and with concurrent streams it may pick other kernels);
//  - the cuBLASLt plans (descriptors and the heuristic's algorithm) by shape,
//    built on first use: a step repeats the same shapes;
//  - the grouped GEMM's device arrays of A, B and C pointers;
//  - the pinned host buffers of read_later (kernels/cuda/context.cpp), kept
//    for reuse: cudaHostAlloc costs far more than the small reads it serves.
// Ops never allocate: they use these.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>

#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami::cuda {

struct ReadbackPool;  // kernels/cuda/context.cpp

inline constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
// Problems one grouped cuBLAS call covers (the pointer arrays' length); a call
// with more runs in several (kernels/cuda/grouped_gemm.cu).
inline constexpr int kMaxGroupedProblems = 2048;

// Plans kept per context before the cache starts over (~1 KB of host memory
// each): the dense shapes of a step are a handful; the grouped GEMM's
// single matmuls (coarse experts' products, and the per-problem fallback)
// add one per distinct row count and product. Mixtral-sized experts see
// row counts over a range some hundreds wide in each of their nine
// products (three per projection), a few thousand plans, which must fit
// without a restart for the cache to reach its steady state.
inline constexpr size_t kMaxLtPlans = 16384;

// A cuBLASLt matmul in cuBLAS's column-major terms (row-major callers swap
// operands: Cᵀ = op(B)ᵀ·op(A)ᵀ): D = C = alpha·op_a(a)·op_b(b) + beta·C, with
// op_a(a) [m, k], op_b(b) [k, n], c [m, n]; a and b of dtype `ab`, c of `c`
// (ab, or f32 when ab is bf16). m, n, k >= 1. fp32 compute, never TF32.
struct LtMatmul {
  cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  DType ab = DType::f32, c_type = DType::f32;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
};

// What selects a plan: everything the heuristic sees (shapes, types, the
// pointers' alignments), nothing it does not (alpha, beta, the pointers).
struct LtKey {
  int32_t ab = 0, c_type = 0, op_a = 0, op_b = 0;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0;
  bool operator==(const LtKey&) const = default;
};
struct LtKeyHash {
  size_t operator()(const LtKey& k) const;
};
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // c is D's layout too (in place)
  cublasLtMatmulAlgo_t algo{};
};
void destroy_plan(LtPlan& plan);

// Runs `mm` on the context's stream through its cached plan (built on a miss).
void lt_matmul(ExecContext::CudaState& s, const LtMatmul& mm);

// C_i = beta·C_i for the `elems` contiguous elements at base + offsets[i]
// elements, every i; beta = 0 writes zeros (NaNs in C do not survive, the
// BLAS rule). dtype f32 or bf16. The K = 0 product and the weight gradient's
// unused groups.
void scale_matrices(cudaStream_t stream, DType dt, void* base, int64_t elems, std::span<const int64_t> offsets,
                    float beta);

// The context's state; an internal error for a context that has none (CPU).
ExecContext::CudaState& state_of(const ExecContext& ctx);

}  // namespace origami::cuda

namespace origami {

struct ExecContext::CudaState {
  int device = 0;
  int multiprocessors = 1;  // the device's SM count (grouped GEMM's schedule)
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // kBlasWorkspaceBytes, 256-byte aligned, shared by blas and lt
  size_t workspace_bytes = 0;
  // Device [3][kMaxGroupedProblems]: A, B, C pointers of one grouped call.
  void** grouped_pointers = nullptr;
  // Guards the fill-then-launch of `grouped_pointers`, so two host threads
  // sharing a context cannot interleave them (after the launch, the stream
  // orders every later use). Taken before plans_mu, never after.
  std::mutex grouped_mu;
  bool grouped_mixed_unsupported = false;  // cuBLAS refused bf16 A/B with f32 C (guarded by grouped_mu)
  std::mutex plans_mu;  // guards `plans`
  std::unordered_map<cuda::LtKey, cuda::LtPlan, cuda::LtKeyHash> plans;
  // Shared with the reads still held, which return their buffers to it.
  std::shared_ptr<cuda::ReadbackPool> readback;
};

}  // namespace origami
