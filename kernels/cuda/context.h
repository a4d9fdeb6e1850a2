// The CUDA half of ExecContext (kernels/cuda/context.cpp): a non-blocking
// stream, cuBLAS and cuBLASLt handles and the BLAS scratch, per context
// (kernels/cuda/blas.h defines the state). Host-only declarations, so that
// kernels/context.cpp includes this in any build.
#pragma once
#include <cstddef>
#include <memory>

#include "kernels/context.h"

namespace origami::cuda {

ExecContext::CudaState* create_state(int device_index);
void destroy_state(ExecContext::CudaState* state);
void* stream_of(const ExecContext::CudaState* state);
void* blas_of(const ExecContext::CudaState* state);
void synchronize(const ExecContext::CudaState* state);
// ExecContext::read_later's CUDA half: queues `bytes` from device (or host)
// address `src` on the state's stream into a pinned buffer of its pool, and
// an event after the copy. The buffer returns to the pool with the last
// reference; a later read reuses it only behind this one on the same
// stream, so an abandoned read is never overwritten while in flight.
std::shared_ptr<PendingRead> read_later(ExecContext::CudaState* state, const void* src, size_t bytes);
// Waits for the read's event (not its stream), then copies its bytes to dst.
void finish_read(const PendingRead& read, void* dst, size_t bytes);

}  // namespace origami::cuda
