// CPU token cross-entropy (fp32 logits, one row per token). Backward may run
// in place (dlogits aliasing logits): each element is read once and then
// overwritten, so pointers here are deliberately not restrict-qualified
// across the two buffers.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/op_shapes.h"

namespace origami::cpu {

namespace {
// The CPU's kernels are f32 (op_shapes checks the rest).
void check_f32_logits(const char* op, const Tensor& logits_TV, const Tensor* dlogits_TV = nullptr) {
  ORIGAMI_CHECK(logits_TV.dtype() == DType::f32 && (!dlogits_TV || dlogits_TV->dtype() == DType::f32), op,
                ": the CPU's logits and dlogits are f32");
}
}  // namespace

void cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T,
                           Tensor& lse_T) {
  const CrossEntropyDims dims = cross_entropy_forward_shapes(logits_TV, targets_T, loss_T, lse_T);
  const int64_t T = dims.T, V = dims.V;
  check_f32_logits("cross_entropy_forward", logits_TV);
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
  const CrossEntropyDims dims = cross_entropy_backward_shapes(logits_TV, targets_T, lse_T, dlogits_TV);
  const int64_t T = dims.T, V = dims.V;
  check_f32_logits("cross_entropy_backward", logits_TV, &dlogits_TV);
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
  const CrossEntropyDims dims = cross_entropy_local_max_shapes(logits_TV, max_T);
  const int64_t T = dims.T, Vr = dims.V;
  check_f32_logits("cross_entropy_local_max", logits_TV);
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
  const CrossEntropyDims dims = cross_entropy_local_sums_shapes(logits_TV, targets_T, max_T, sums_2T);
  const int64_t T = dims.T, Vr = dims.V;
  check_f32_logits("cross_entropy_local_sums", logits_TV);
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
  const int64_t T = cross_entropy_finish_shapes(max_T, sums_2T, loss_T, lse_T);
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
  const CrossEntropyDims dims = cross_entropy_local_backward_shapes(logits_TV, targets_T, lse_T, dlogits_TV);
  const int64_t T = dims.T, Vr = dims.V;
  check_f32_logits("cross_entropy_local_backward", logits_TV, &dlogits_TV);
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
