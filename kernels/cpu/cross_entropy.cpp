// CPU token cross-entropy (fp32 logits, one row per token). Backward may run
// in place (dlogits aliasing logits): each element is read once and then
// overwritten, so pointers here are deliberately not restrict-qualified
// across the two buffers.
#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/simd.h"

namespace origami {

namespace {

void check_args(const Tensor& logits_TV, const Tensor& targets_T, const char* what) {
  ORIGAMI_CHECK(logits_TV.defined() && logits_TV.dtype() == DType::f32 && logits_TV.dim() >= 1, what,
                " logits must be f32 [T, V]");
  ORIGAMI_CHECK(targets_T.defined() && targets_T.dtype() == DType::i32, what, " targets must be i32");
  check_shape(targets_T, {logits_TV.rows()}, "cross-entropy targets");
}

}  // namespace

void cross_entropy_forward(const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T, Tensor& lse_T) {
  check_args(logits_TV, targets_T, "cross_entropy_forward");
  const int64_t T = logits_TV.rows(), V = logits_TV.cols();
  ORIGAMI_CHECK(loss_T.numel() == T && loss_T.dtype() == DType::f32, "cross-entropy loss has ",
                shape_string(loss_T.shape()), ", expected ", T, " f32 elements");
  ORIGAMI_CHECK(lse_T.numel() == T && lse_T.dtype() == DType::f32, "cross-entropy lse has ",
                shape_string(lse_T.shape()), ", expected ", T, " f32 elements");
  const float* logits = logits_TV.f32();
  const int32_t* targets = targets_T.i32();
  float* loss = loss_T.f32();
  float* lse_out = lse_T.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int32_t y = targets[t];
    ORIGAMI_CHECK(y >= 0 && y < V, "cross-entropy target ", y, " of token ", t, " is outside [0, ", V, ")");
    const float* __restrict x = logits + t * V;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[i]);
    // Each term is <= 1, so a float sum of V terms stays accurate to ~V·ulp
    // worst case; the partial sums of a simd reduction do better in practice.
    float se = 0.0f;
#pragma omp simd reduction(+ : se)
    for (int64_t i = 0; i < V; ++i) se += cpu::exp_fast(x[i] - mx);
    const float lse = mx + std::log(se);
    lse_out[t] = lse;
    loss[t] = lse - x[y];
  }
}

void cross_entropy_backward(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& lse_T, float grad_scale,
                            Tensor& dlogits_TV) {
  check_args(logits_TV, targets_T, "cross_entropy_backward");
  const int64_t T = logits_TV.rows(), V = logits_TV.cols();
  check_shape(dlogits_TV, logits_TV.shape(), "cross-entropy dlogits");
  ORIGAMI_CHECK(dlogits_TV.dtype() == DType::f32, "cross-entropy dlogits must be f32");
  ORIGAMI_CHECK(lse_T.numel() == T, "cross-entropy lse has ", lse_T.numel(), " elements, expected ", T);
  const float* logits = logits_TV.f32();
  const int32_t* targets = targets_T.i32();
  const float* lse = lse_T.f32();
  float* dlogits = dlogits_TV.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int32_t y = targets[t];
    ORIGAMI_CHECK(y >= 0 && y < V, "cross-entropy target ", y, " of token ", t, " is outside [0, ", V, ")");
    const float* x = logits + t * V;
    float* d = dlogits + t * V;
    const float l = lse[t];
    const float x_y = x[y];  // read before the row is overwritten (in-place case)
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) d[i] = cpu::exp_fast(x[i] - l) * grad_scale;
    d[y] = (cpu::exp_fast(x_y - l) - 1.0f) * grad_scale;
  }
}

}  // namespace origami
