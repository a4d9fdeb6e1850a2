// The dispatch layer's helpers (kernels/dispatch.cpp, dispatch_moe.cpp
// only): the device rule every op checks, the CPU thread scope, and the
// bf16 widening that runs the f32 CPU kernels on bf16 data.
#pragma once
#include <omp.h>

#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/dispatch.h"
#if ORIGAMI_WITH_CUDA
#include "kernels/cuda/ops.h"
#define ORIGAMI_ON_CUDA(op) cuda::op
#else
#define ORIGAMI_ON_CUDA(op) (::origami::dispatch_detail::without_cuda(#op), cpu::op)
#endif

namespace origami::dispatch_detail {

[[maybe_unused]] [[noreturn]] inline void without_cuda(const char* op) {
  ORIGAMI_CHECK(false, op, " on a CUDA context: built without CUDA");
  __builtin_unreachable();
}

// True when the op runs on the CUDA backend; an internal error when a tensor
// is elsewhere than the context's device.
inline bool on_cuda(const ExecContext& ctx, const char* op, std::initializer_list<OpArg> args) {
  const Device device = ctx.device();
  for (const OpArg& a : args)
    if (a.tensor->defined() && !(a.tensor->device() == device)) [[unlikely]]
      ORIGAMI_CHECK(false, device_mismatch(op, device, args));
  return !device.is_host();
}

// CPU implementations run with the context's OpenMP thread count (oneDNN
// reads the same setting); the caller's is restored afterwards.
class CpuThreads {
 public:
  // Also the kernel scope of the host stand-in (HostKernelScope): the CPU
  // implementation that runs while this is held may touch its tensors'
  // elements, whichever host device they are on.
  explicit CpuThreads(const ExecContext& ctx) : saved_(omp_get_max_threads()) {
    if (saved_ != ctx.threads()) omp_set_num_threads(ctx.threads());
  }
  ~CpuThreads() {
    if (omp_get_max_threads() != saved_) omp_set_num_threads(saved_);
  }
  CpuThreads(const CpuThreads&) = delete;
  CpuThreads& operator=(const CpuThreads&) = delete;

 private:
  int saved_;
  HostKernelScope kernel_;
};

// bf16 data on the host. The CPU kernels are f32 only, so a call whose data
// is bf16 runs them on exact f32 widenings of its bf16 arguments and rounds
// each one it writes back to bf16 (nearest even) when the call returns: per
// element what a CUDA kernel does (load bf16, compute in f32, store
// rounded), at one copy per argument, so the bf16 recipe runs and is tested
// on CPU ranks. It keeps the CUDA dtype rule (kernels/cuda/README.md): one
// data dtype per call, a wide output (GEMM results, rmsnorm's dw) f32 or
// the data dtype; statistics, indices and the AdamW master weights are not
// data and stay as they are (the CPU kernels check them f32 / i32).
class HostBf16 {
 public:
  HostBf16(const ExecContext& ctx, const char* op) : ctx_(ctx), op_(op) {}
  ~HostBf16() {
    for (auto& [dst, wide] : written_) cpu::cast(ctx_, *wide, *dst);
  }
  HostBf16(const HostBf16&) = delete;
  HostBf16& operator=(const HostBf16&) = delete;

  const Tensor& in(const Tensor& t) { return admit(t, "an input", false) ? widened(t) : t; }
  Tensor& out(Tensor& t) { return admit(t, "an output", false) ? written(t) : t; }
  Tensor& wide_out(Tensor& t) { return admit(t, "an output", true) ? written(t) : t; }

 private:
  // True when `t` is bf16 data to widen; checks the call's one data dtype
  // (the CPU kernels check which dtypes they take).
  bool admit(const Tensor& t, const char* role, bool wide) {
    if (!t.defined()) return false;
    const DType dt = t.dtype();
    if (!(wide && dt == DType::f32)) {
      if (!data_) data_ = dt;
      ORIGAMI_CHECK(*data_ == dt, op_, ": ", role, " is ", to_string(dt), " but the call's data is ", to_string(*data_),
                    " (one data dtype per call)");
    }
    return dt == DType::bf16;
  }
  Tensor& widened(const Tensor& t) {
    Tensor& w = copies_.emplace_back(ctx_.empty(t.shape(), DType::f32, MemCategory::workspace));
    cpu::cast(ctx_, t, w);
    return w;
  }
  Tensor& written(Tensor& t) {
    Tensor& w = widened(t);  // read too: in-place ops and accumulating (beta = 1) calls
    written_.emplace_back(&t, &w);
    return w;
  }

  const ExecContext& ctx_;
  const char* op_;
  std::optional<DType> data_;
  std::deque<Tensor> copies_;  // stable addresses for the references handed out
  std::vector<std::pair<Tensor*, Tensor*>> written_;
};

}  // namespace origami::dispatch_detail
