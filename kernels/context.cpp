// ExecContext (see context.h).
#include "kernels/context.h"

#include <algorithm>

#include "kernels/cuda/context.h"
#include "kernels/cuda/memory.h"

namespace origami {

namespace {
void no_state(ExecContext::CudaState*) {}
}  // namespace

ExecContext::ExecContext(Device device, int threads)
    : device_(device), threads_(std::max(1, threads)), cuda_(nullptr, no_state) {}

ExecContext::ExecContext(ExecContext&&) noexcept = default;
ExecContext& ExecContext::operator=(ExecContext&&) noexcept = default;
ExecContext::~ExecContext() = default;

ExecContext ExecContext::cpu(int threads) {
  ORIGAMI_CHECK(threads >= 1, "a CPU context needs at least one thread, got ", threads);
  return ExecContext(Device::cpu(), threads);
}

ExecContext ExecContext::host_stand_in(int threads) {
  ORIGAMI_CHECK(threads >= 1, "a CPU context needs at least one thread, got ", threads);
  return ExecContext(Device{DeviceKind::cpu, 1}, threads);
}

ExecContext ExecContext::cuda(int device_index, int host_threads) {
  if (!built_with_cuda())
    ORIGAMI_USER_ERROR("cuda:", device_index,
                       " requested, but origami was built without CUDA (configure with "
                       "-DORIGAMI_CUDA=ON on a machine with the CUDA toolkit)");
  const int count = cuda_device_count();
  if (device_index < 0 || device_index >= count)
    ORIGAMI_USER_ERROR("cuda:", device_index, " requested, but this process sees ", count, " CUDA device(s)",
                       count == 0 ? " (" + cuda_unavailable_reason() + ")" : "");
  ExecContext ctx(Device::cuda(device_index), host_threads);
#if ORIGAMI_WITH_CUDA
  ctx.cuda_ = std::unique_ptr<CudaState, void (*)(CudaState*)>(cuda::create_state(device_index), cuda::destroy_state);
#endif
  return ctx;
}

void* ExecContext::stream() const {
#if ORIGAMI_WITH_CUDA
  if (cuda_) return cuda::stream_of(cuda_.get());
#endif
  return nullptr;
}

void* ExecContext::blas() const {
#if ORIGAMI_WITH_CUDA
  if (cuda_) return cuda::blas_of(cuda_.get());
#endif
  return nullptr;
}

Tensor ExecContext::workspace(size_t bytes) const {
  return Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, MemCategory::workspace, device_);
}

void ExecContext::set_data_dtype(DType dtype) {
  ORIGAMI_CHECK(dtype == DType::f32 || dtype == DType::bf16, "a data dtype of ", to_string(dtype),
                ": the recipes are f32 and bf16");
  data_dtype_ = dtype;
}

Tensor ExecContext::empty(Shape shape, DType dtype, MemCategory category) const {
  return Tensor::empty(std::move(shape), dtype, category, device_);
}

Tensor ExecContext::zeros(Shape shape, DType dtype, MemCategory category) const {
  Tensor t = empty(std::move(shape), dtype, category);
  fill_zero(t);
  return t;
}

void ExecContext::fill_zero(Tensor& t) const {
  ORIGAMI_CHECK(t.defined() && t.device() == device_, "fill_zero of a tensor on ",
                t.defined() ? to_string(t.device()) : "(none)", " on a context of ", to_string(device_));
  if (t.numel() == 0) return;
#if ORIGAMI_WITH_CUDA
  if (cuda_) return cuda::fill_zero_on(t.address(), t.nbytes(), cuda::stream_of(cuda_.get()));
#endif
  t.fill_zero();
}

void ExecContext::copy(const Tensor& dst, const Tensor& src) const {
  ORIGAMI_CHECK(dst.defined() && src.defined(), "copy with an undefined tensor");
  ORIGAMI_CHECK(dst.numel() == src.numel() && dst.dtype() == src.dtype(), "copy of ", shape_string(src.shape()), " ",
                to_string(src.dtype()), " into ", shape_string(dst.shape()), " ", to_string(dst.dtype()));
  for (const Device d : {dst.device(), src.device()})
    ORIGAMI_CHECK(d == device_ || d.is_host(), "copy from ", to_string(src.device()), " to ", to_string(dst.device()),
                  " on a context of ", to_string(device_), ": each side is the context's device or the host");
  if (dst.numel() == 0) return;
#if ORIGAMI_WITH_CUDA
  if (cuda_) {
    const bool host_side = dst.device().is_host() || src.device().is_host();
    return cuda::copy_on(dst.address(), src.address(), dst.nbytes(), cuda::stream_of(cuda_.get()), host_side);
  }
#endif
  Tensor(dst).copy_from(src);  // host memory on both sides
}

Tensor ExecContext::to(const Tensor& t, Device device) const {
  ORIGAMI_CHECK(t.defined(), "to(", to_string(device), ") of an undefined tensor");
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.category(), device);
  copy(out, t);
  return out;
}

HostRead ExecContext::read_later(const Tensor& src) const {
  ORIGAMI_CHECK(src.defined(), "read_later of an undefined tensor");
  ORIGAMI_CHECK(src.device() == device_ || src.device().is_host(), "read_later of a tensor on ",
                to_string(src.device()), " on a context of ", to_string(device_));
  HostRead r;
  r.host_ = Tensor::empty(src.shape(), src.dtype(), src.category(), Device::cpu());
  if (src.numel() == 0) return r;
#if ORIGAMI_WITH_CUDA
  if (cuda_) {
    r.pending_ = cuda::read_later(cuda_.get(), src.address(), src.nbytes());
    return r;
  }
#endif
  r.host_.copy_from(src);  // host memory on both sides
  return r;
}

const Tensor& HostRead::get() {
  ORIGAMI_CHECK(host_.defined(), "HostRead::get of a read never queued");
#if ORIGAMI_WITH_CUDA
  if (pending_) {
    cuda::finish_read(*pending_, host_.address(), host_.nbytes());
    pending_.reset();
  }
#endif
  return host_;
}

double HostRead::scalar_f64() {
  const Tensor& t = get();
  ORIGAMI_CHECK(t.dtype() == DType::f64 && t.numel() == 1, "HostRead::scalar_f64 of ", to_string(t.dtype()), " ",
                shape_string(t.shape()), ", not f64 [1]");
  return t.data<double>()[0];
}

void ExecContext::synchronize() const {
#if ORIGAMI_WITH_CUDA
  if (cuda_) cuda::synchronize(cuda_.get());
#endif
}

}  // namespace origami
