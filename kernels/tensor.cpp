// Tensor and Storage: tracked, contiguous, row-major buffers with views.
// Fill and copy pick the backend by where the memory lives: host memset /
// memmove, or the CUDA runtime (kernels/cuda/memory.h) when either side is a
// device.
#include "kernels/tensor.h"

#include <atomic>
#include <cstring>
#include <sstream>

#include "kernels/bf16.h"
#include "kernels/cuda/memory.h"

namespace origami {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::f64: return 8;
  }
  return 0;
}

std::string_view to_string(DType dt) {
  switch (dt) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::f64: return "f64";
  }
  return "?";
}

int64_t shape_numel(const Shape& s) {
  // Config validation bounds every configured size; a product that still
  // leaves int64 is a bug, never a silently small buffer.
  int64_t n = 1;
  for (int64_t d : s) ORIGAMI_CHECK(d >= 0 && checked_mul(n, d, &n), "element count of ", shape_string(s), " overflows int64");
  return n;
}

std::string shape_string(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

Storage::Storage(size_t bytes, MemCategory category, Device device)
    : bytes_(bytes), category_(category), device_(device) {
  data_ = TrackedAllocator::of(device).allocate(bytes, category);
}

Storage::~Storage() { TrackedAllocator::of(device_).release(data_, bytes_, category_); }

Tensor Tensor::empty(Shape shape, DType dtype, MemCategory category, Device device) {
  for (int64_t d : shape) ORIGAMI_CHECK(d >= 0, "negative dimension in ", shape_string(shape));
  int64_t bytes = 0;
  ORIGAMI_CHECK(checked_mul(shape_numel(shape), static_cast<int64_t>(dtype_size(dtype)), &bytes), "bytes of ",
                shape_string(shape), " ", to_string(dtype), " overflow int64");
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(bytes), category, device);
  // The host stand-in's new memory is garbage, as a GPU's is (cudaMalloc
  // and the caching allocator's reused blocks): NaN in every float dtype and
  // in the workspace's bytes, a large negative value in the integer ones.
  // Host memory is often zero when fresh, which would hide a read of
  // elements nothing wrote; on the stand-in it shows.
  if (device.is_host() && device.index != 0 && bytes > 0) {
    const bool integer = dtype == DType::i32 || dtype == DType::i64;
    std::memset(t.address(), integer ? 0xA5 : 0xFF, static_cast<size_t>(bytes));
  }
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, MemCategory category, Device device) {
  Tensor t = empty(std::move(shape), dtype, category, device);
  t.fill_zero();
  return t;
}

Tensor Tensor::view(Shape shape) const {
  ORIGAMI_CHECK(shape_numel(shape) == numel(), "view ", shape_string(shape), " of ", shape_string(shape_));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice(int64_t start, int64_t count) const {
  ORIGAMI_CHECK(dim() >= 1 && start >= 0 && count >= 0 && start + count <= shape_[0], "slice [", start, ", ",
                start + count, ") of ", shape_string(shape_));
  Tensor t = *this;
  t.offset_ += start * (numel() / std::max<int64_t>(shape_[0], 1));
  t.shape_[0] = count;
  return t;
}

Tensor Tensor::flat_view(int64_t offset, int64_t n, Shape shape) const {
  ORIGAMI_CHECK(offset >= 0 && n >= 0 && offset + n <= numel() && shape_numel(shape) == n, "flat_view at ", offset,
                " of ", n, " elements as ", shape_string(shape), " in ", shape_string(shape_));
  Tensor t = *this;
  t.offset_ += offset;
  t.shape_ = std::move(shape);
  return t;
}

namespace {
std::atomic<int> host_kernel_depth{0};
}  // namespace

HostKernelScope::HostKernelScope() { host_kernel_depth.fetch_add(1, std::memory_order_relaxed); }
HostKernelScope::~HostKernelScope() { host_kernel_depth.fetch_sub(1, std::memory_order_relaxed); }
bool HostKernelScope::open() { return host_kernel_depth.load(std::memory_order_relaxed) > 0; }

void Tensor::check_host_access() const {
  if (device().is_host() && HostKernelScope::open()) return;
  fail_host_access();
}

void Tensor::fail_host_access() const {
  ORIGAMI_CHECK(false, "host access to the elements of a ", to_string(dtype_), " ", shape_string(shape_), " tensor on ",
                to_string(device()), " (copy it to the host with to(Device::cpu()) first",
                device().is_host() ? "; the host stand-in's elements are its kernels' alone, as a GPU's are)" : ")");
  __builtin_unreachable();
}

Tensor Tensor::to(Device target) const {
  ORIGAMI_CHECK(defined(), "to(", to_string(target), ") of an undefined tensor");
  Tensor t = empty(shape_, dtype_, category(), target);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::on_host_f32() const {
  ORIGAMI_CHECK(defined() && (dtype_ == DType::f32 || dtype_ == DType::bf16), "on_host_f32 of ",
                defined() ? to_string(dtype_) : std::string_view("an undefined tensor"), "; it widens f32 or bf16");
  if (dtype_ == DType::f32) return on_host();
  const Tensor words = on_host();
  Tensor wide = empty(shape_, DType::f32, category(), Device::cpu());
  const auto* w = static_cast<const uint16_t*>(words.address());
  float* f = static_cast<float*>(wide.address());
  for (int64_t i = 0; i < numel(); ++i) f[i] = bf16_value(w[i]);
  return wide;
}

void Tensor::assign_f32(const Tensor& host_f32) {
  ORIGAMI_CHECK(defined() && host_f32.defined() && host_f32.dtype() == DType::f32 && host_f32.device().is_host() &&
                    host_f32.numel() == numel(),
                "assign_f32 takes a host f32 tensor of ", numel(), " elements");
  if (dtype_ == DType::f32) return copy_from(host_f32);
  ORIGAMI_CHECK(dtype_ == DType::bf16, "assign_f32 into ", to_string(dtype_), "; it rounds into f32 or bf16");
  Tensor words = empty(shape_, DType::bf16, category(), Device::cpu());
  const float* f = static_cast<const float*>(host_f32.address());
  auto* w = static_cast<uint16_t*>(words.address());
  for (int64_t i = 0; i < numel(); ++i) w[i] = bf16_bits(f[i]);
  copy_from(words);
}

void Tensor::fill_zero() {
  ORIGAMI_CHECK(defined(), "fill_zero of an undefined tensor");
  if (numel() == 0) return;
  if (device().is_host()) {
    std::memset(address(), 0, nbytes());
  } else {
#if ORIGAMI_WITH_CUDA
    cuda::fill_zero(address(), nbytes(), device().index);
#endif
  }
}

void Tensor::copy_from(const Tensor& src) {
  ORIGAMI_CHECK(defined() && src.defined(), "copy_from with an undefined tensor");
  ORIGAMI_CHECK(src.numel() == numel() && src.dtype() == dtype(), "copy_from ", shape_string(src.shape()), " ",
                to_string(src.dtype()), " into ", shape_string(shape_), " ", to_string(dtype_));
  if (numel() == 0) return;
  if (device().is_host() && src.device().is_host()) {
    std::memmove(address(), src.address(), nbytes());
  } else {
#if ORIGAMI_WITH_CUDA
    cuda::copy(address(), device(), src.address(), src.device(), nbytes());
#endif
  }
}

void check_shape(const Tensor& t, const Shape& expected, const char* name) {
  ORIGAMI_CHECK(t.defined(), name, " is undefined");
  ORIGAMI_CHECK(t.shape() == expected, name, " has shape ", shape_string(t.shape()), ", expected ",
                shape_string(expected));
}

void check_f32(const Tensor& t, const Shape& expected, const char* name) {
  ORIGAMI_CHECK(t.defined() && t.dtype() == DType::f32, name, " must be a defined f32 tensor");
  check_shape(t, expected, name);
}

void check_i32(const Tensor& t, const Shape& expected, const char* name) {
  ORIGAMI_CHECK(t.defined() && t.dtype() == DType::i32, name, " must be a defined i32 tensor");
  check_shape(t, expected, name);
}

}  // namespace origami
