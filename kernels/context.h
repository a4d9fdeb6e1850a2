// ExecContext: where and how ops run (ARCHITECTURE.md §2) — the device, its
// stream and BLAS handle, the CPU thread count, and workspace. One per rank,
// created by whoever drives the ops (trainer, bench, tests) and handed down
// explicitly to every op; nothing in kernels/ keeps a global one.
// Workspace is two-phase, CUB style: an op that needs scratch exposes a
// `<op>_workspace_bytes(ctx, ...)` query (sized by this context's threads,
// never the OpenMP runtime's), the caller takes that many bytes from
// workspace() and passes them in; the op never allocates behind it.
#pragma once
#include <cstddef>
#include <memory>

#include "kernels/device.h"
#include "kernels/tensor.h"

namespace origami {

namespace cuda {
struct PendingRead;  // kernels/cuda/context.cpp
}  // namespace cuda

// A device-to-host read queued on a context's stream and taken later
// (ExecContext::read_later). get() waits for the point of the stream the
// read was queued at, not for what was queued after it, so a read taken
// after a later synchronization of that stream costs no wait. Copies share
// the read; the first get() waits, later ones return the same tensor.
class HostRead {
 public:
  HostRead() = default;
  bool defined() const { return host_.defined(); }
  // The source's elements as they were when the read was queued, in a host
  // tensor of its shape, dtype and ledger category.
  const Tensor& get();
  // get()'s one element, of an f64 [1] read (a loss or norm accumulator).
  double scalar_f64();

 private:
  friend class ExecContext;
  Tensor host_;
  std::shared_ptr<cuda::PendingRead> pending_;  // CUDA until get(): the pinned copy and its event
};

class ExecContext {
 public:
  // Host ops on `threads` OpenMP threads (oneDNN included), >= 1.
  static ExecContext cpu(int threads);
  // A host context whose device is the stand-in cpu:1: host memory and the
  // CPU implementations, but a device of its own, so the dispatch's device
  // rule fails at the first op that meets a tensor allocated on plain cpu.
  // A whole training run on it proves, without a GPU, that every buffer of
  // the training path is allocated on the context's device (the GPU run
  // needs exactly that). For tests (ORIGAMI_HOST_STAND_IN=1 in the trainer).
  static ExecContext host_stand_in(int threads);
  // Ops on CUDA device `device_index` (its own stream and cuBLAS handle);
  // host-side work keeps `host_threads`. A UserError naming the reason when
  // the build has no CUDA backend or the device does not exist.
  static ExecContext cuda(int device_index, int host_threads = 1);

  ExecContext(ExecContext&&) noexcept;
  ExecContext& operator=(ExecContext&&) noexcept;
  ~ExecContext();

  Device device() const { return device_; }
  int threads() const { return threads_; }
  // The training path's data dtype (the recipe, ARCHITECTURE.md §6): what
  // the parameter store holds and modules allocate activations in, f32
  // (the default) or bf16. Statistics (norm rstd, log-sum-exps, losses,
  // router logits, scores and weights) are f32 whatever it is.
  DType data_dtype() const { return data_dtype_; }
  void set_data_dtype(DType dtype);  // checked: f32 or bf16
  // cudaStream_t / cublasHandle_t of a CUDA context; null on the host.
  void* stream() const;
  void* blas() const;

  // `bytes` of scratch on this context's device, tracked as workspace, freed
  // with the returned tensor (u8 [bytes]).
  Tensor workspace(size_t bytes) const;
  // A new tensor on this context's device: how every module above kernels/
  // allocates, so that one code path serves the host and the GPU.
  Tensor empty(Shape shape, DType dtype, MemCategory category) const;
  // empty() in the data dtype: activations, their gradients, data buffers.
  Tensor empty_data(Shape shape, MemCategory category = MemCategory::activation) const {
    return empty(std::move(shape), data_dtype_, category);
  }
  // zeros and fill_zero run on this context's stream on CUDA (ordered with
  // its ops, no device synchronization, unlike Tensor::zeros/fill_zero).
  Tensor zeros(Shape shape, DType dtype, MemCategory category) const;
  void fill_zero(Tensor& t) const;
  // Writes src's elements into dst (same numel and dtype; each on this
  // context's device or the host) in this context's stream order: on CUDA a
  // device-to-device copy is queued on the stream and the host goes on; a
  // copy with a host side waits for this stream alone, since the host reads
  // or frees its memory next. Never the whole device, as Tensor::copy_from
  // does: a device-wide wait on the training path would also wait for the
  // communication stream's prefetches and reductions, and undo their overlap.
  void copy(const Tensor& dst, const Tensor& src) const;
  // A copy of t on `device` (this context's or the host) by copy(), in t's
  // ledger category.
  Tensor to(const Tensor& t, Device device) const;
  // src (on this context's device or the host) read into host memory in
  // this context's stream order, without waiting: on CUDA the copy goes to
  // pinned memory (a pool of the context's, reused) and an event marks it;
  // HostRead::get waits for that event alone. For small values the host
  // needs later in the step (the router's totals): taken after the next
  // host copy the step makes anyway, they add no synchronization of their
  // own. On the host the copy is made at once.
  HostRead read_later(const Tensor& src) const;
  // Waits until every op issued through this context has finished.
  void synchronize() const;

  struct CudaState;  // stream, handles, BLAS scratch (kernels/cuda/blas.h)
  // The CUDA backend's state of this context; null on the host. For
  // kernels/cuda/ alone (its definition is visible only there).
  CudaState* cuda_state() const { return cuda_.get(); }

 private:
  ExecContext(Device device, int threads);
  Device device_;
  int threads_ = 1;
  DType data_dtype_ = DType::f32;
  std::unique_ptr<CudaState, void (*)(CudaState*)> cuda_;
};

}  // namespace origami
