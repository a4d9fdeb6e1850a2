// The CUDA half of ExecContext (kernels/cuda/context.cu): a non-blocking
// stream and a cuBLAS handle bound to it, per context.
#pragma once
#include "kernels/context.h"

namespace origami::cuda {

ExecContext::CudaState* create_state(int device_index);
void destroy_state(ExecContext::CudaState* state);
void* stream_of(const ExecContext::CudaState* state);
void* blas_of(const ExecContext::CudaState* state);
void synchronize(const ExecContext::CudaState* state);

}  // namespace origami::cuda
