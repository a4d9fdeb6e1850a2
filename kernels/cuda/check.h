// CUDA_CHECK / CUBLAS_CHECK: the CUDA members of the engine's one error
// family (kernels/check.h): file:line, rank, the call and the runtime's own
// error name and text, then the whole job aborts.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/check.h"
#include "kernels/cuda/cublas_library.h"

#define CUDA_CHECK(call)                                                                                              \
  do {                                                                                                                \
    const cudaError_t origami_cuda_rc_ = (call);                                                                      \
    if (origami_cuda_rc_ != cudaSuccess) [[unlikely]]                                                                 \
      ::origami::fail_check(                                                                                          \
          __FILE__, __LINE__, #call,                                                                                  \
          ::origami::detail::concat(cudaGetErrorName(origami_cuda_rc_), ": ", cudaGetErrorString(origami_cuda_rc_))); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                           \
  do {                                                                                               \
    const cublasStatus_t origami_cublas_rc_ = (call);                                                \
    if (origami_cublas_rc_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                    \
      ::origami::fail_check(__FILE__, __LINE__, #call,                                               \
                            ::origami::detail::concat(::origami::cuda::cublas().status_name(origami_cublas_rc_), ": ", \
                                                      ::origami::cuda::cublas().status_string(origami_cublas_rc_)));   \
  } while (0)
