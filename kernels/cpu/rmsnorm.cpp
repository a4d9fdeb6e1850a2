// CPU RMSNorm forward/backward (fp32). Rows are independent and split over
// OpenMP threads; dw is reduced from per-thread partials held in the caller's
// workspace, combined in thread order so a given thread count is bitwise
// reproducible (no float atomics).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

void check_rows(const Tensor& x, const Tensor& w, const char* what) {
  ORIGAMI_CHECK(x.defined() && w.defined(), what, " on an undefined tensor");
  ORIGAMI_CHECK(x.dtype() == DType::f32 && w.dtype() == DType::f32, what, " is fp32 on CPU");
  check_shape(w, {x.cols()}, "rmsnorm weight");
}

}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD,
                     Tensor& rstd_T) {
  check_rows(x_TD, w_D, "rmsnorm_forward");
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  check_shape(y_TD, x_TD.shape(), "rmsnorm y");
  ORIGAMI_CHECK(rstd_T.numel() == T && rstd_T.dtype() == DType::f32, "rmsnorm rstd has ",
                shape_string(rstd_T.shape()), ", expected ", T, " f32 elements");
  const float* x = x_TD.f32();
  const float* w = w_D.f32();
  float* y = y_TD.f32();
  float* rstd = rstd_T.f32();

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict xr = x + t * D;
    float* __restrict yr = y + t * D;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    rstd[t] = r;
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r * w[i];
  }
}

size_t rmsnorm_backward_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  return static_cast<size_t>(ctx.threads()) * static_cast<size_t>(D) * sizeof(float);
}

// With x̂ = x·r:  dx = r·(w⊙dy) − x·r³/D · Σ(w⊙dy⊙x),  dw += Σ_t dy⊙x̂.
void rmsnorm_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                      const Tensor& rstd_T, Tensor& dx_TD, Tensor& dw_D, Tensor& workspace) {
  check_rows(x_TD, w_D, "rmsnorm_backward");
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  check_shape(dy_TD, x_TD.shape(), "rmsnorm dy");
  check_shape(dx_TD, x_TD.shape(), "rmsnorm dx");
  check_shape(dw_D, {D}, "rmsnorm dw");
  ORIGAMI_CHECK(rstd_T.numel() == T, "rmsnorm rstd has ", rstd_T.numel(), " elements, expected ", T);
  ORIGAMI_CHECK(workspace.defined(), "rmsnorm_backward without a workspace");
  const int64_t floats = static_cast<int64_t>(workspace.nbytes() / sizeof(float));
  const int64_t fit = floats / std::max<int64_t>(D, 1);
  const int nthr = static_cast<int>(std::min<int64_t>(ctx.threads(), fit));
  ORIGAMI_CHECK(nthr >= 1, "rmsnorm workspace has ", workspace.nbytes(), " bytes, needs at least ", D * 4);
  const float* dy = dy_TD.f32();
  const float* x = x_TD.f32();
  const float* w = w_D.f32();
  const float* rstd = rstd_T.f32();
  float* dx = dx_TD.f32();
  float* dw = dw_D.f32();
  float* partial = static_cast<float*>(workspace.raw());
  int used = 1;

#pragma omp parallel num_threads(nthr)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    used = nt;
    float* __restrict pw = partial + static_cast<int64_t>(tid) * D;
    for (int64_t i = 0; i < D; ++i) pw[i] = 0.0f;
    // Static contiguous row blocks: the partial a thread holds is a fixed
    // function of (tid, nt), which keeps the reduction order fixed.
    const int64_t t0 = T * tid / nt, t1 = T * (tid + 1) / nt;
    for (int64_t t = t0; t < t1; ++t) {
      const float* __restrict dyr = dy + t * D;
      const float* __restrict xr = x + t * D;
      float* __restrict dxr = dx + t * D;
      const float r = rstd[t];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < D; ++i) dot += w[i] * dyr[i] * xr[i];
      const float c = dot * r * r * r / static_cast<float>(D);
      for (int64_t i = 0; i < D; ++i) {
        dxr[i] = r * w[i] * dyr[i] - xr[i] * c;
        pw[i] += dyr[i] * xr[i] * r;
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < D; ++i) {
    float s = 0.0f;
    for (int k = 0; k < used; ++k) s += partial[static_cast<int64_t>(k) * D + i];
    dw[i] += s;
  }
}

// The two halves of rmsnorm_backward (kernels/rmsnorm.h). Each repeats the
// fused kernel's arithmetic expression for expression — dx per row, dw from
// per-thread partials over the same static row blocks, combined in thread
// order — so the pair is bitwise the fused kernel at the same thread count.
void rmsnorm_backward_input(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                            const Tensor& rstd_T, Tensor& dx_TD) {
  check_rows(x_TD, w_D, "rmsnorm_backward_input");
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  check_shape(dy_TD, x_TD.shape(), "rmsnorm dy");
  check_shape(dx_TD, x_TD.shape(), "rmsnorm dx");
  ORIGAMI_CHECK(rstd_T.numel() == T, "rmsnorm rstd has ", rstd_T.numel(), " elements, expected ", T);
  const float* dy = dy_TD.f32();
  const float* x = x_TD.f32();
  const float* w = w_D.f32();
  const float* rstd = rstd_T.f32();
  float* dx = dx_TD.f32();

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict dyr = dy + t * D;
    const float* __restrict xr = x + t * D;
    float* __restrict dxr = dx + t * D;
    const float r = rstd[t];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < D; ++i) dot += w[i] * dyr[i] * xr[i];
    const float c = dot * r * r * r / static_cast<float>(D);
    for (int64_t i = 0; i < D; ++i) dxr[i] = r * w[i] * dyr[i] - xr[i] * c;
  }
}

size_t rmsnorm_backward_weight_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  return cpu::rmsnorm_backward_workspace_bytes(ctx, T, D);  // the same per-thread partials
}

void rmsnorm_backward_weight(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                             Tensor& dw_D, Tensor& workspace) {
  ORIGAMI_CHECK(x_TD.defined() && dy_TD.defined() && rstd_T.defined() && dw_D.defined(),
                "rmsnorm_backward_weight on an undefined tensor");
  ORIGAMI_CHECK(x_TD.dtype() == DType::f32 && dw_D.dtype() == DType::f32, "rmsnorm_backward_weight is fp32 on CPU");
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  check_shape(dy_TD, x_TD.shape(), "rmsnorm dy");
  check_shape(dw_D, {D}, "rmsnorm dw");
  ORIGAMI_CHECK(rstd_T.numel() == T, "rmsnorm rstd has ", rstd_T.numel(), " elements, expected ", T);
  ORIGAMI_CHECK(workspace.defined(), "rmsnorm_backward_weight without a workspace");
  const int64_t floats = static_cast<int64_t>(workspace.nbytes() / sizeof(float));
  const int64_t fit = floats / std::max<int64_t>(D, 1);
  const int nthr = static_cast<int>(std::min<int64_t>(ctx.threads(), fit));
  ORIGAMI_CHECK(nthr >= 1, "rmsnorm workspace has ", workspace.nbytes(), " bytes, needs at least ", D * 4);
  const float* dy = dy_TD.f32();
  const float* x = x_TD.f32();
  const float* rstd = rstd_T.f32();
  float* dw = dw_D.f32();
  float* partial = static_cast<float*>(workspace.raw());
  int used = 1;

#pragma omp parallel num_threads(nthr)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    used = nt;
    float* __restrict pw = partial + static_cast<int64_t>(tid) * D;
    for (int64_t i = 0; i < D; ++i) pw[i] = 0.0f;
    const int64_t t0 = T * tid / nt, t1 = T * (tid + 1) / nt;  // rmsnorm_backward's blocks
    for (int64_t t = t0; t < t1; ++t) {
      const float* __restrict dyr = dy + t * D;
      const float* __restrict xr = x + t * D;
      const float r = rstd[t];
      for (int64_t i = 0; i < D; ++i) pw[i] += dyr[i] * xr[i] * r;
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < D; ++i) {
    float s = 0.0f;
    for (int k = 0; k < used; ++k) s += partial[static_cast<int64_t>(k) * D + i];
    dw[i] += s;
  }
}

}  // namespace origami::cpu
