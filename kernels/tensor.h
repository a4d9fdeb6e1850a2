// Tensor: dtype, shape, device and a view (element offset) into shared,
// contiguous, tracked storage. Tensors are cheap handles; copying one shares
// the storage. Every op takes contiguous row-major views; a rank > 2 tensor
// passed where a matrix is expected reads as [prod(leading dims), last dim].
// Storage comes from its device's tracked allocator. Host code reads
// elements (data<T>(), f32(), i32(), raw()) of host tensors only: a device
// tensor read on the host is a clear error, not a segfault. The host
// stand-in device cpu:1 (ExecContext::host_stand_in) is host memory whose
// elements only the CPU kernels touch (inside a HostKernelScope, which the
// dispatch opens), as only the CUDA kernels touch a GPU's: engine code that
// reads or writes a training-path tensor's elements outside a named host
// point fails on the stand-in as it would on the GPU; and its new tensors
// hold garbage (NaN, or negative integers), as a GPU's do, until written.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kernels/allocator.h"
#include "kernels/check.h"
#include "kernels/device.h"

namespace origami {

enum class DType : int { f32, bf16, i32, i64, u8, f64 };
size_t dtype_size(DType dt);
std::string_view to_string(DType dt);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_string(const Shape& s);

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
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

// While one is open, host element access to the stand-in device's tensors
// is allowed: the CPU kernels' own (the dispatch opens one around each CPU
// implementation; OpenMP workers inside it count as inside). Process-wide,
// not per thread, since the host drives ops from one thread and a kernel's
// workers are other threads.
class HostKernelScope {
 public:
  HostKernelScope();
  ~HostKernelScope();
  HostKernelScope(const HostKernelScope&) = delete;
  HostKernelScope& operator=(const HostKernelScope&) = delete;
  static bool open();
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

  // Host element access (checked: defined, host-resident, dtype; on the
  // stand-in device, inside a kernel).
  template <class T> T* data() const {
    ORIGAMI_CHECK(defined(), "data() on an undefined tensor");
    ORIGAMI_CHECK(dtype_ == dtype_of<T>(), "tensor is ", to_string(dtype_), ", accessed as ", to_string(dtype_of<T>()));
    if (storage_->device() != Device::cpu()) [[unlikely]]
      check_host_access();
    return static_cast<T*>(storage_->data()) + offset_;
  }
  float* f32() const { return data<float>(); }
  int32_t* i32() const { return data<int32_t>(); }
  void* raw() const {
    ORIGAMI_CHECK(defined(), "raw() on an undefined tensor");
    if (storage_->device() != Device::cpu()) [[unlikely]]
      check_host_access();
    return address();
  }
  // The first element's address on the tensor's own device (device code and
  // copies; never dereferenced on the host unless device() is the host).
  void* address() const { return static_cast<char*>(storage_->data()) + offset_ * dtype_size(dtype_); }

  // Same storage, new shape with the same element count.
  Tensor view(Shape shape) const;
  // Rows [start, start + count) along dim 0, sharing storage.
  Tensor slice(int64_t start, int64_t count) const;
  // A flat view of `numel` elements starting at element `offset` of this view.
  Tensor flat_view(int64_t offset, int64_t numel, Shape shape) const;

  // A copy on `device` (same shape, dtype and ledger category); synchronous.
  Tensor to(Device device) const;
  // This tensor when it lives on plain cpu, else a copy there (from a GPU or
  // the host stand-in): what the named host points (checkpoint, export) read.
  Tensor on_host() const { return device() == Device::cpu() ? *this : to(Device::cpu()); }
  // The host f32 image of an f32 or bf16 tensor (bf16 widened exactly; an
  // f32 host tensor is itself), and its inverse: overwrite with a host f32
  // tensor's elements, rounded to nearest even when this one is bf16. The
  // named host points of the bf16 recipe's working copies (checkpoint
  // loads, export). Synchronous.
  Tensor on_host_f32() const;
  void assign_f32(const Tensor& host_f32);
  // Overwrite with zeros / with src's elements (same numel and dtype, any two
  // devices); synchronous. Both dispatch to the backend of the memory.
  void fill_zero();
  void copy_from(const Tensor& src);

 private:
  void check_host_access() const;  // off plain cpu: the stand-in inside a kernel only
  [[noreturn]] void fail_host_access() const;
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  DType dtype_ = DType::f32;
};

// Shape assertions with readable messages.
void check_shape(const Tensor& t, const Shape& expected, const char* name);
// Defined, of that dtype, of that shape.
void check_f32(const Tensor& t, const Shape& expected, const char* name);
void check_i32(const Tensor& t, const Shape& expected, const char* name);

}  // namespace origami
