// Shared pieces of the CUDA MoE ops (moe_topk.cu, moe_ops.cu, moe_permute.cu,
// moe_stats.cu): the device-side form of the CPU twins' internal checks, and
// warp reductions over a fixed butterfly tree.
#pragma once
#include "kernels/cpu/ops.h"  // kMoeNormEps: the one definition of the 1e-20 guard
#include "kernels/cuda/common.cuh"

// glibc's assert handler, which nvcc implements on the device; declared
// here as CCCL does (cuda/std/__cccl/assert.h), since nvcc hides its own
// declaration from user code and <assert.h> drops it under NDEBUG.
extern "C" __host__ __device__ void __assert_fail(const char* assertion, const char* file, unsigned int line,
                                                  const char* function) noexcept __attribute__((__noreturn__));

// An internal check on device data (an expert index out of range, more kept
// slots than rows): what the CPU twin checks with ORIGAMI_CHECK, which a
// kernel cannot throw. A device-side assert prints the condition with
// file:line, kernel, block and thread; the launch fails with cudaErrorAssert,
// the context is unusable after it, and the next CUDA_CHECK on the stream
// aborts the job (CUDA_CHECK's policy for any device fault). Unlike assert()
// it stays on under NDEBUG, as the CPU's checks do.
#define ORIGAMI_DEVICE_CHECK(cond, what)                                        \
  do {                                                                          \
    if (!(cond)) [[unlikely]]                                                   \
      __assert_fail(what, __FILE__, static_cast<unsigned>(__LINE__), __func__); \
  } while (0)

namespace origami::cuda::moe {

constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr float kNormEps = cpu::kMoeNormEps;

// Butterfly (xor) reductions: every lane ends with the same, bitwise equal
// value (each level adds the same two operands, in either order), and the
// tree depends only on the lane layout, so results are reproducible.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFullWarp, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(kFullWarp, v, off));
  return v;
}

// One warp's index and the warp count of a grid-stride loop over warps.
__device__ __forceinline__ int64_t warp_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}
__device__ __forceinline__ int64_t warp_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x / 32; }

inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace origami::cuda::moe
