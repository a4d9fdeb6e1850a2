// CPU elementwise ops and fp64 reductions. Reductions sum fixed contiguous
// blocks per thread, then the block sums in order: bitwise reproducible for a
// given thread count (an OpenMP reduction clause combines in arbitrary order).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/bf16.h"
#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

void check_pair(const Tensor& y, const Tensor& x, const char* what) {
  ORIGAMI_CHECK(y.defined() && x.defined() && y.dtype() == DType::f32 && x.dtype() == DType::f32, what,
                " takes f32 tensors");
  ORIGAMI_CHECK(y.numel() == x.numel(), what, ": ", shape_string(y.shape()), " vs ", shape_string(x.shape()));
}

constexpr int kMaxThreads = 256;

template <class F>
double reduce(const ExecContext& ctx, const Tensor& x, const char* what, F term) {
  ORIGAMI_CHECK(x.defined() && x.dtype() == DType::f32, what, " takes an f32 tensor");
  const int64_t n = x.numel();
  const float* d = x.f32();
  double partial[kMaxThreads] = {};
  const int nthr = std::min(ctx.threads(), kMaxThreads);
  int used = 1;
#pragma omp parallel num_threads(nthr)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    if (tid == 0) used = nt;
    const int64_t i0 = n * tid / nt, i1 = n * (tid + 1) / nt;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += term(static_cast<double>(d[i]));
    partial[tid] = s;
  }
  double total = 0.0;
  for (int k = 0; k < used; ++k) total += partial[k];
  return total;
}

}  // namespace

void axpy(const ExecContext& ctx, float a, const Tensor& x, Tensor& y) {
  check_pair(y, x, "axpy");
  const int64_t n = y.numel();
  const float* xs = x.f32();
  float* ys = y.f32();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) ys[i] += a * xs[i];
}

void scale_inplace(const ExecContext& ctx, Tensor& y, float a) {
  ORIGAMI_CHECK(y.defined() && y.dtype() == DType::f32, "scale_inplace takes an f32 tensor");
  const int64_t n = y.numel();
  float* ys = y.f32();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) ys[i] *= a;
}

double sum_squares(const ExecContext& ctx, const Tensor& x) {
  return reduce(ctx, x, "sum_squares", [](double v) { return v * v; });
}

// acc: f64 [1], checked by the dispatch (kernels/dispatch.cpp) for both backends.
void sum_squares_add(const ExecContext& ctx, const Tensor& x, Tensor& acc) {
  acc.data<double>()[0] += cpu::sum_squares(ctx, x);
}

double sum(const ExecContext& ctx, const Tensor& x) {
  return reduce(ctx, x, "sum", [](double v) { return v; });
}

// acc: as sum_squares_add's.
void sum_add(const ExecContext& ctx, const Tensor& x, Tensor& acc) { acc.data<double>()[0] += cpu::sum(ctx, x); }

void cast(const ExecContext& ctx, const Tensor& src, Tensor& dst) {
  ORIGAMI_CHECK(src.defined() && dst.defined(), "cast of an undefined tensor");
  ORIGAMI_CHECK(src.numel() == dst.numel(), "cast: ", shape_string(src.shape()), " into ", shape_string(dst.shape()));
  const auto floating = [](DType d) { return d == DType::f32 || d == DType::bf16; };
  ORIGAMI_CHECK(floating(src.dtype()) && floating(dst.dtype()), "cast converts between f32 and bf16, not ",
                to_string(src.dtype()), " to ", to_string(dst.dtype()));
  const int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) {
    if (n) std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
  if (src.dtype() == DType::f32) {
    const float* s = src.f32();
    auto* d = static_cast<uint16_t*>(dst.raw());
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(s[i]);
  } else {
    const auto* s = static_cast<const uint16_t*>(src.raw());
    float* d = dst.f32();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_value(s[i]);
  }
}

}  // namespace origami::cpu
