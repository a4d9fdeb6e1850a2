// The CUDA half of ExecContext (kernels/cuda/context.cpp): a non-blocking
// stream, cuBLAS and cuBLASLt handles and the BLAS scratch, per context
// (kernels/cuda/blas.h defines the state). Host-only declarations, so that
// kernels/context.cpp includes this in any build.
#pragma once
#include "kernels/context.h"

namespace origami::cuda {

ExecContext::CudaState* create_state(int device_index);
void destroy_state(ExecContext::CudaState* state);
void* stream_of(const ExecContext::CudaState* state);
void* blas_of(const ExecContext::CudaState* state);
void synchronize(const ExecContext::CudaState* state);

}  // namespace origami::cuda
