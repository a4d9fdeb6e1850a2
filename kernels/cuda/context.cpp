// CUDA execution state (kernels/cuda/blas.h lists what a context owns): each
// context has its own stream, cuBLAS and cuBLASLt handles used on it, and the
// BLAS scratch, so ops of one context run in issue order and two contexts
// can overlap.
#include "kernels/allocator.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/context.h"

namespace origami::cuda {

namespace {

constexpr size_t kGroupedPointerBytes = 3 * kMaxGroupedProblems * sizeof(void*);

}  // namespace

ExecContext::CudaState* create_state(int device_index) {
  auto* s = new ExecContext::CudaState;
  s->device = device_index;
  CUDA_CHECK(cudaSetDevice(device_index));
  CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublas().create(&s->blas));
  CUBLAS_CHECK(cublas().set_stream(s->blas, s->stream));
  TrackedAllocator& allocator = TrackedAllocator::of(Device::cuda(device_index));
  s->workspace_bytes = kBlasWorkspaceBytes;
  s->workspace = allocator.allocate(s->workspace_bytes, MemCategory::workspace);
  // After set_stream, which resets the handle to cuBLAS's own pool. The
  // handle's default math mode stays: fp32 GEMMs in fp32, no TF32.
  CUBLAS_CHECK(cublas().set_workspace(s->blas, s->workspace, s->workspace_bytes));
  CUBLAS_CHECK(cublas().lt_create(&s->lt));
  s->grouped_pointers = static_cast<void**>(allocator.allocate(kGroupedPointerBytes, MemCategory::workspace));
  return s;
}

// No checks: this also runs at process exit, when the runtime may be gone.
void destroy_state(ExecContext::CudaState* s) {
  if (s == nullptr) return;
  cudaSetDevice(s->device);
  cudaStreamSynchronize(s->stream);  // nothing queued may still use the handles or the scratch
  for (auto& [key, plan] : s->plans) destroy_plan(plan);
  cublas().lt_destroy(s->lt);
  cublas().destroy(s->blas);
  TrackedAllocator& allocator = TrackedAllocator::of(Device::cuda(s->device));
  allocator.release(s->grouped_pointers, kGroupedPointerBytes, MemCategory::workspace);
  allocator.release(s->workspace, s->workspace_bytes, MemCategory::workspace);
  cudaStreamDestroy(s->stream);
  delete s;
}

void* stream_of(const ExecContext::CudaState* s) { return s->stream; }
void* blas_of(const ExecContext::CudaState* s) { return s->blas; }

void synchronize(const ExecContext::CudaState* s) {
  CUDA_CHECK(cudaSetDevice(s->device));
  CUDA_CHECK(cudaStreamSynchronize(s->stream));
}

ExecContext::CudaState& state_of(const ExecContext& ctx) {
  ExecContext::CudaState* s = ctx.cuda_state();
  ORIGAMI_CHECK(s != nullptr, "a CUDA op on a ", to_string(ctx.device()), " context (no CUDA state)");
  return *s;
}

}  // namespace origami::cuda
