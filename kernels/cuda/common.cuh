// Shared pieces of the CUDA ops (kernels/cuda/*.cu): the context's stream,
// checked launches, typed device pointers, and the one dtype rule.
//
// dtype rule (kernels/cuda/README.md): an op call has one data dtype T, f32
// or bf16, shared by all its activation, parameter and gradient tensors;
// statistics (rstd, lse, losses, router scores and weights, stats, maxima,
// sums) are always f32; indices i32. Kernels load T, compute in f32 (fp64
// where the CPU twin does), and store T rounded to nearest even. GEMM and
// grouped GEMM may write an f32 C from bf16 A/B (fp32 accumulation kept).
//
// Determinism: no floating-point atomics anywhere; a reduction's order is a
// function of its shape and launch configuration only (CUB block reductions,
// fixed partitions), so every op is bitwise reproducible run to run.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/context.h"
#include "kernels/cuda/check.h"
#include "kernels/tensor.h"

// After every kernel launch: a bad configuration or an earlier asynchronous
// fault shows here, at the launch's file:line.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace origami::cuda {

using bf16 = __nv_bfloat16;

inline cudaStream_t stream_of(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream()); }

template <class T> constexpr DType device_dtype() {
  if constexpr (std::is_same_v<T, bf16>)
    return DType::bf16;
  else
    return dtype_of<T>();
}

// The tensor's first element on its device, typed; checks the dtype.
template <class T> T* dev(const Tensor& t, const char* what) {
  ORIGAMI_CHECK(t.defined(), what, " is undefined");
  constexpr DType want = device_dtype<std::remove_const_t<T>>();
  ORIGAMI_CHECK(t.dtype() == want, what, " is ", to_string(t.dtype()), ", expected ", to_string(want));
  return static_cast<T*>(t.address());
}

// The call's data dtype: f32 or bf16, else an internal error naming the op.
inline bool is_float_data(DType dt) { return dt == DType::f32 || dt == DType::bf16; }
inline void check_data_dtype(const char* op, const Tensor& t, const char* what) {
  ORIGAMI_CHECK(is_float_data(t.dtype()), op, ": ", what, " is ", to_string(t.dtype()), "; CUDA ops take f32 or bf16");
}
inline void check_same_dtype(const char* op, const Tensor& a, const char* a_name, const Tensor& b, const char* b_name) {
  ORIGAMI_CHECK(a.dtype() == b.dtype(), op, ": ", a_name, " is ", to_string(a.dtype()), " but ", b_name, " is ",
                to_string(b.dtype()), " (one data dtype per call)");
}

// Runs `body` with T = float or bf16 for the data dtype `dt`:
//   with_data_type(x.dtype(), [&]<class T>() { kernel<T><<<...>>>(...); });
template <class Body> void with_data_type(DType dt, Body&& body) {
  if (dt == DType::f32)
    body.template operator()<float>();
  else if (dt == DType::bf16)
    body.template operator()<bf16>();
  else
    ORIGAMI_CHECK(false, "CUDA ops take f32 or bf16 data, got ", to_string(dt));
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

// Blocks for a grid-stride loop over n elements.
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535 * 8) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, max_blocks));
}

}  // namespace origami::cuda
