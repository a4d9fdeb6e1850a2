// CPU token cross-entropy (fp32 logits, one row per token). Backward may run
// in place (dlogits aliasing logits): each element is read once and then
// overwritten, so pointers here are deliberately not restrict-qualified
// across the two buffers.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"

namespace origami::cpu {

namespace {

void check_args(const Tensor& logits_TV, const Tensor& targets_T, const char* what) {
  ORIGAMI_CHECK(logits_TV.defined() && logits_TV.dtype() == DType::f32 && logits_TV.dim() >= 1, what,
                " logits must be f32 [T, V]");
  ORIGAMI_CHECK(targets_T.defined() && targets_T.dtype() == DType::i32, what, " targets must be i32");
  check_shape(targets_T, {logits_TV.rows()}, "cross-entropy targets");
}

}  // namespace

void cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T,
                           Tensor& lse_T) {
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

void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                            const Tensor& lse_T, float grad_scale, Tensor& dlogits_TV) {
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

// The vocab-parallel pieces keep the exact arithmetic of the loop they
// replaced in dense/tensor_parallel.cpp (std::exp, fp64 sums in column
// order), so tp > 1 losses stay bitwise what they were.

void cross_entropy_local_max(const ExecContext& ctx, const Tensor& logits_TV, Tensor& max_T) {
  ORIGAMI_CHECK(logits_TV.defined() && logits_TV.dtype() == DType::f32, "cross_entropy_local_max: logits must be f32");
  const int64_t T = logits_TV.rows(), Vr = logits_TV.dim() == 0 ? 1 : logits_TV.shape().back();
  ORIGAMI_CHECK(max_T.dtype() == DType::f32 && max_T.numel() == T, "cross_entropy_local_max: max_T must be f32 [", T,
                "], got ", shape_string(max_T.shape()));
  const float* logits = T > 0 && Vr > 0 ? logits_TV.f32() : nullptr;
  float* mx = max_T.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < Vr; ++i) m = std::max(m, logits[t * Vr + i]);
    mx[t] = m;
  }
}

void cross_entropy_local_sums(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                              const Tensor& max_T, int64_t vocab_start, int64_t vocab, Tensor& sums_2T) {
  const int64_t T = logits_TV.rows(), Vr = logits_TV.shape().back();
  ORIGAMI_CHECK(targets_T.dtype() == DType::i32 && targets_T.numel() == T, "cross_entropy_local_sums: targets ",
                shape_string(targets_T.shape()), " should be i32 [", T, "]");
  ORIGAMI_CHECK(max_T.dtype() == DType::f32 && max_T.numel() == T, "cross_entropy_local_sums: max_T should be f32 [",
                T, "]");
  ORIGAMI_CHECK(sums_2T.dtype() == DType::f64 && sums_2T.numel() == 2 * T,
                "cross_entropy_local_sums: sums_2T should be f64 [2, ", T, "], got ", shape_string(sums_2T.shape()));
  const float* logits = T > 0 && Vr > 0 ? logits_TV.f32() : nullptr;
  const int32_t* targets = targets_T.i32();
  const float* mx = max_T.f32();
  double* sums = sums_2T.data<double>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int32_t y = targets[t];
    ORIGAMI_CHECK(y >= 0 && y < vocab, "cross-entropy target ", y, " of token ", t, " is outside [0, ", vocab, ")");
    const float* x = logits + t * Vr;
    double se = 0.0;
    for (int64_t i = 0; i < Vr; ++i) se += std::exp(static_cast<double>(x[i] - mx[t]));
    sums[t] = se;
    const int64_t local = y - vocab_start;
    sums[T + t] = local >= 0 && local < Vr ? x[local] : 0.0;
  }
}

void cross_entropy_finish(const ExecContext& ctx, const Tensor& max_T, const Tensor& sums_2T, Tensor& loss_T,
                          Tensor& lse_T) {
  const int64_t T = max_T.numel();
  ORIGAMI_CHECK(sums_2T.dtype() == DType::f64 && sums_2T.numel() == 2 * T, "cross_entropy_finish: sums_2T should be f64 [2, ", T, "]");
  ORIGAMI_CHECK(loss_T.dtype() == DType::f32 && loss_T.numel() == T && lse_T.dtype() == DType::f32 && lse_T.numel() == T,
                "cross_entropy_finish: loss_T and lse_T should be f32 [", T, "]");
  const float* mx = max_T.f32();
  const double* sums = sums_2T.data<double>();
  float* lse = lse_T.f32();
  float* loss = loss_T.f32();
  for (int64_t t = 0; t < T; ++t) {
    const double l = static_cast<double>(mx[t]) + std::log(sums[t]);
    lse[t] = static_cast<float>(l);
    loss[t] = static_cast<float>(l - sums[T + t]);
  }
}

void cross_entropy_local_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                                  const Tensor& lse_T, int64_t vocab_start, float grad_scale, Tensor& dlogits_TV) {
  const int64_t T = logits_TV.rows(), Vr = logits_TV.shape().back();
  check_shape(dlogits_TV, logits_TV.shape(), "cross-entropy dlogits");
  ORIGAMI_CHECK(targets_T.numel() == T && lse_T.numel() == T, "cross_entropy_local_backward: ", T,
                " rows, but targets ", targets_T.numel(), " and lse ", lse_T.numel());
  const float* x_all = T > 0 && Vr > 0 ? logits_TV.f32() : nullptr;
  float* d_all = T > 0 && Vr > 0 ? dlogits_TV.f32() : nullptr;
  const float* lse = lse_T.f32();
  const int32_t* targets = targets_T.i32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = x_all + t * Vr;
    float* row = d_all + t * Vr;
    for (int64_t i = 0; i < Vr; ++i) row[i] = std::exp(x[i] - lse[t]) * grad_scale;
    const int64_t local = targets[t] - vocab_start;
    if (local >= 0 && local < Vr) row[local] -= grad_scale;
  }
}

}  // namespace origami::cpu
