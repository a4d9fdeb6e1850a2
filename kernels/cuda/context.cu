// CUDA execution state: each context owns a stream and a cuBLAS handle on
// that stream, so ops of one context run in issue order and two contexts
// can overlap.
#include "kernels/cuda/check.h"
#include "kernels/cuda/context.h"

namespace origami {

struct ExecContext::CudaState {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
};

namespace cuda {

ExecContext::CudaState* create_state(int device_index) {
  auto* s = new ExecContext::CudaState;
  s->device = device_index;
  CUDA_CHECK(cudaSetDevice(device_index));
  CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublas().create(&s->blas));
  CUBLAS_CHECK(cublas().set_stream(s->blas, s->stream));
  return s;
}

void destroy_state(ExecContext::CudaState* s) {
  if (s == nullptr) return;
  cudaSetDevice(s->device);
  cudaStreamSynchronize(s->stream);
  cublas().destroy(s->blas);
  cudaStreamDestroy(s->stream);
  delete s;
}

void* stream_of(const ExecContext::CudaState* s) { return s->stream; }
void* blas_of(const ExecContext::CudaState* s) { return s->blas; }

void synchronize(const ExecContext::CudaState* s) {
  CUDA_CHECK(cudaSetDevice(s->device));
  CUDA_CHECK(cudaStreamSynchronize(s->stream));
}

}  // namespace cuda
}  // namespace origami
