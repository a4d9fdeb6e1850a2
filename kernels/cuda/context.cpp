// CUDA execution state (kernels/cuda/blas.h lists what a context owns): each
// context has its own stream, cuBLAS and cuBLASLt handles used on it, and the
// BLAS scratch, so ops of one context run in issue order and two contexts
// can overlap.
//
// read_later's pool: pinned buffers (cudaHostAlloc, rounded up to 4 KiB)
// with one event each. A read takes a free buffer big enough, or makes one,
// queues the copy and records the event; the buffer returns to the pool when
// the read's last reference goes. All reads of a pool are on its context's
// stream, so a buffer reused while an abandoned copy into it is still in
// flight is written again only after that copy (stream order).
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/allocator.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/context.h"

namespace origami::cuda {

namespace {

constexpr size_t kGroupedPointerBytes = 3 * kMaxGroupedProblems * sizeof(void*);
constexpr size_t kReadbackGranule = 4096;

struct PinnedBuffer {
  void* host = nullptr;
  size_t bytes = 0;
  cudaEvent_t done = nullptr;
};

}  // namespace

struct ReadbackPool {
  std::mutex mu;  // guards free
  std::vector<PinnedBuffer> free;
  // No checks: the last reference may go at process exit.
  ~ReadbackPool() {
    for (const PinnedBuffer& b : free) {
      cudaEventDestroy(b.done);
      cudaFreeHost(b.host);
    }
  }
};

struct PendingRead {
  std::shared_ptr<ReadbackPool> pool;
  PinnedBuffer buffer;
  PendingRead(std::shared_ptr<ReadbackPool> p, PinnedBuffer b) : pool(std::move(p)), buffer(b) {}
  PendingRead(const PendingRead&) = delete;
  PendingRead& operator=(const PendingRead&) = delete;
  ~PendingRead() {
    const std::lock_guard<std::mutex> lock(pool->mu);
    pool->free.push_back(buffer);
  }
};

std::shared_ptr<PendingRead> read_later(ExecContext::CudaState* s, const void* src, size_t bytes) {
  ORIGAMI_CHECK(s != nullptr && s->readback, "read_later on a context without CUDA state");
  ReadbackPool& pool = *s->readback;
  PinnedBuffer buffer;
  {
    const std::lock_guard<std::mutex> lock(pool.mu);
    const auto fits = std::find_if(pool.free.begin(), pool.free.end(),
                                   [bytes](const PinnedBuffer& b) { return b.bytes >= bytes; });
    if (fits != pool.free.end()) {
      buffer = *fits;
      pool.free.erase(fits);
    }
  }
  if (buffer.host == nullptr) {
    buffer.bytes = (bytes + kReadbackGranule - 1) / kReadbackGranule * kReadbackGranule;
    CUDA_CHECK(cudaSetDevice(s->device));
    CUDA_CHECK(cudaHostAlloc(&buffer.host, buffer.bytes, cudaHostAllocDefault));
    CUDA_CHECK(cudaEventCreateWithFlags(&buffer.done, cudaEventDisableTiming));
  }
  auto read = std::make_shared<PendingRead>(s->readback, buffer);  // owns the buffer from here
  CUDA_CHECK(cudaMemcpyAsync(buffer.host, src, bytes, cudaMemcpyDefault, s->stream));
  CUDA_CHECK(cudaEventRecord(buffer.done, s->stream));
  return read;
}

void finish_read(const PendingRead& read, void* dst, size_t bytes) {
  ORIGAMI_CHECK(bytes <= read.buffer.bytes, "finish_read of ", bytes, " bytes from a ", read.buffer.bytes,
                "-byte buffer");
  CUDA_CHECK(cudaEventSynchronize(read.buffer.done));
  std::memcpy(dst, read.buffer.host, bytes);
}

ExecContext::CudaState* create_state(int device_index) {
  auto* s = new ExecContext::CudaState;
  s->device = device_index;
  CUDA_CHECK(cudaSetDevice(device_index));
  CUDA_CHECK(cudaDeviceGetAttribute(&s->multiprocessors, cudaDevAttrMultiProcessorCount, device_index));
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
  s->readback = std::make_shared<ReadbackPool>();
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
