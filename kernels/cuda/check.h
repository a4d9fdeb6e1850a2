// CUDA_CHECK / CUBLAS_CHECK: the CUDA members of the engine's one error
// family (kernels/check.h): file:line, rank, the call and the library's own
// error name and text, then the whole job aborts. CUDA_CHECK alone, without
// cuBLAS, is kernels/cuda/cuda_check.h (comm/ uses it).
#pragma once
#include <cublas_v2.h>

#include "kernels/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cublas_library.h"

#define CUBLAS_CHECK(call)                                                                           \
  do {                                                                                               \
    const cublasStatus_t origami_cublas_rc_ = (call);                                                \
    if (origami_cublas_rc_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                    \
      ::origami::fail_check(__FILE__, __LINE__, #call,                                               \
                            ::origami::detail::concat(::origami::cuda::cublas().status_name(origami_cublas_rc_), ": ", \
                                                      ::origami::cuda::cublas().status_string(origami_cublas_rc_)));   \
  } while (0)
