// Tensor: dtype, shape, device and a view (element offset) into shared,
// contiguous, tracked storage. Tensors are cheap handles; copying one shares
// the storage. Every op takes contiguous row-major views; a rank > 2 tensor
// passed where a matrix is expected reads as [prod(leading dims), last dim].
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kernels/allocator.h"
#include "kernels/check.h"

namespace origami {

enum class DType : int { f32, bf16, i32, i64, u8 };
size_t dtype_size(DType dt);
std::string_view to_string(DType dt);

enum class DeviceKind : int { cpu, cuda };
struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {}; }
  bool operator==(const Device&) const = default;
};

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_string(const Shape& s);

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }

// Owns one tracked allocation; freed (and un-counted) when the last Tensor
// referencing it goes away.
class Storage {
 public:
  Storage(size_t bytes, MemCategory category, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, MemCategory category, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype, MemCategory category, Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_->device(); }
  MemCategory category() const { return storage_->category(); }
  const Shape& shape() const { return shape_; }
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int i) const { return shape_.at(i < 0 ? i + dim() : i); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  // Rows and columns when read as a matrix: [prod(leading), last].
  int64_t rows() const {
    int64_t r = 1;
    for (int i = 0; i + 1 < dim(); ++i) r *= shape_[i];
    return r;
  }
  int64_t cols() const { return dim() == 0 ? 1 : shape_.back(); }

  template <class T> T* data() const {
    ORIGAMI_CHECK(defined(), "data() on an undefined tensor");
    ORIGAMI_CHECK(dtype_ == dtype_of<T>(), "tensor is ", to_string(dtype_), ", accessed as ", to_string(dtype_of<T>()));
    return static_cast<T*>(storage_->data()) + offset_;
  }
  float* f32() const { return data<float>(); }
  int32_t* i32() const { return data<int32_t>(); }
  void* raw() const { return static_cast<char*>(storage_->data()) + offset_ * dtype_size(dtype_); }

  // Same storage, new shape with the same element count.
  Tensor view(Shape shape) const;
  // Rows [start, start + count) along dim 0, sharing storage.
  Tensor slice(int64_t start, int64_t count) const;
  // A flat view of `numel` elements starting at element `offset` of this view.
  Tensor flat_view(int64_t offset, int64_t numel, Shape shape) const;

  void fill_zero();
  void copy_from(const Tensor& src);  // same numel and dtype; host only for now

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  DType dtype_ = DType::f32;
};

// Shape assertions with readable messages.
void check_shape(const Tensor& t, const Shape& expected, const char* name);

}  // namespace origami
