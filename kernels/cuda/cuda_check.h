// CUDA_CHECK: the CUDA runtime's member of the engine's one error family
// (kernels/check.h): file:line, rank, the call and the runtime's error name
// and text, then the whole job aborts. Plain host C++ may include it (the
// NCCL backend in comm/ does); cuBLAS's CUBLAS_CHECK is kernels/cuda/check.h.
#pragma once
#include <cuda_runtime.h>

#include "kernels/check.h"

#define CUDA_CHECK(call)                                                                                              \
  do {                                                                                                                \
    const cudaError_t origami_cuda_rc_ = (call);                                                                      \
    if (origami_cuda_rc_ != cudaSuccess) [[unlikely]]                                                                 \
      ::origami::fail_check(                                                                                          \
          __FILE__, __LINE__, #call,                                                                                  \
          ::origami::detail::concat(cudaGetErrorName(origami_cuda_rc_), ": ", cudaGetErrorString(origami_cuda_rc_))); \
  } while (0)
