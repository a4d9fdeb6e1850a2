// CPU RMSNorm forward/backward (fp32). Rows are independent and split over
// OpenMP threads; dw is reduced from per-thread partials held in the caller's
// workspace, combined in thread order so a given thread count is bitwise
// reproducible (no float atomics).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "kernels/cpu/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cpu {

namespace {

// The CPU's kernels are f32 (op_shapes checks the shapes).
void check_fp32(const char* op, std::initializer_list<const Tensor*> data) {
  for (const Tensor* t : data) ORIGAMI_CHECK(t->dtype() == DType::f32, op, " is fp32 on CPU");
}

// The threads whose dw partials (D floats each) the workspace holds, at
// most the context's.
int partial_threads(const ExecContext& ctx, const Tensor& workspace, int64_t D, const char* op) {
  ORIGAMI_CHECK(workspace.defined(), op, " without a workspace");
  const int64_t floats = static_cast<int64_t>(workspace.nbytes() / sizeof(float));
  const int64_t fit = floats / std::max<int64_t>(D, 1);
  const int nthr = static_cast<int>(std::min<int64_t>(ctx.threads(), fit));
  ORIGAMI_CHECK(nthr >= 1, op, ": the workspace has ", workspace.nbytes(), " bytes, needs at least ", D * 4);
  return nthr;
}

}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD,
                     Tensor& rstd_T) {
  const RmsnormDims dims = rmsnorm_forward_shapes(x_TD, w_D, y_TD, rstd_T);
  const int64_t T = dims.T, D = dims.D;
  check_fp32("rmsnorm_forward", {&x_TD, &w_D, &y_TD});
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
  const RmsnormDims dims = rmsnorm_backward_shapes("rmsnorm_backward", dy_TD, x_TD, rstd_T,
                                                   {.w_D = &w_D, .dx_TD = &dx_TD, .dw_D = &dw_D});
  const int64_t T = dims.T, D = dims.D;
  check_fp32("rmsnorm_backward", {&dy_TD, &x_TD, &w_D, &dx_TD, &dw_D});
  const int nthr = partial_threads(ctx, workspace, D, "rmsnorm_backward");
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
  const RmsnormDims dims =
      rmsnorm_backward_shapes("rmsnorm_backward_input", dy_TD, x_TD, rstd_T, {.w_D = &w_D, .dx_TD = &dx_TD});
  const int64_t T = dims.T, D = dims.D;
  check_fp32("rmsnorm_backward_input", {&dy_TD, &x_TD, &w_D, &dx_TD});
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
  const RmsnormDims dims =
      rmsnorm_backward_shapes("rmsnorm_backward_weight", dy_TD, x_TD, rstd_T, {.dw_D = &dw_D});
  const int64_t T = dims.T, D = dims.D;
  check_fp32("rmsnorm_backward_weight", {&dy_TD, &x_TD, &dw_D});
  const int nthr = partial_threads(ctx, workspace, D, "rmsnorm_backward_weight");
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
