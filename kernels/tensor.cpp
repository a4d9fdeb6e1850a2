// Tensor and Storage: tracked, contiguous, row-major buffers with views.
#include "kernels/tensor.h"

#include <cstring>
#include <sstream>

namespace origami {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
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
  ORIGAMI_CHECK(device.kind == DeviceKind::cpu, "device allocations go through the CUDA backend");
  data_ = TrackedAllocator::host().allocate_host(bytes, category);
}

Storage::~Storage() { TrackedAllocator::host().release_host(data_, bytes_, category_); }

Tensor Tensor::empty(Shape shape, DType dtype, MemCategory category, Device device) {
  for (int64_t d : shape) ORIGAMI_CHECK(d >= 0, "negative dimension in ", shape_string(shape));
  int64_t bytes = 0;
  ORIGAMI_CHECK(checked_mul(shape_numel(shape), static_cast<int64_t>(dtype_size(dtype)), &bytes), "bytes of ",
                shape_string(shape), " ", to_string(dtype), " overflow int64");
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(bytes), category, device);
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

void Tensor::fill_zero() {
  if (numel() > 0) std::memset(raw(), 0, nbytes());
}

void Tensor::copy_from(const Tensor& src) {
  ORIGAMI_CHECK(src.numel() == numel() && src.dtype() == dtype(), "copy_from ", shape_string(src.shape()), " ",
                to_string(src.dtype()), " into ", shape_string(shape_), " ", to_string(dtype_));
  if (numel() > 0) std::memmove(raw(), src.raw(), nbytes());
}

void check_shape(const Tensor& t, const Shape& expected, const char* name) {
  ORIGAMI_CHECK(t.defined(), name, " is undefined");
  ORIGAMI_CHECK(t.shape() == expected, name, " has shape ", shape_string(t.shape()), ", expected ",
                shape_string(expected));
}

}  // namespace origami
