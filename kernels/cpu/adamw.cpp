// CPU AdamW on a flat fp32 shard, in the operation order of PyTorch's
// single-tensor torch.optim.AdamW so results match it to rounding:
//   p *= 1 − lr·wd;  m.lerp_(g, 1−β1);  v = β2·v + (1−β2)·g²;
//   p −= (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)
// Bias corrections are computed in double, as Python does, then rounded.
// adamw_update_fused is those calls one after another (its contract is to
// equal them bit for bit, which the CUDA kernel meets in one pass).
#include <cmath>

#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

// a·b + c rounded once where the target has FMA instructions (GCC's
// __FP_FAST_FMA: x86-64 at -march=native on any recent CPU, every aarch64;
// the fused multiply-adds GCC formed in the scalar loop, which the CUDA
// kernel mirrors, kernels/cuda/adamw.cu), twice elsewhere. Spelled out since
// the loop vectorizes (this file builds without sqrtf's errno) and the
// vectorized loop contracted fewer; -ffp-contract=off keeps GCC from fusing
// anything else.
template <class T> T mul_add(T a, T b, T c) {
#if defined(__FP_FAST_FMA) && defined(__FP_FAST_FMAF)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace

void adamw_update(const ExecContext& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWStep& s) {
  ORIGAMI_CHECK(param.defined() && param.dtype() == DType::f32, "adamw param must be f32");
  const int64_t n = param.numel();
  const Tensor* state[] = {&grad, &exp_avg, &exp_avg_sq};
  for (const Tensor* t : state)
    ORIGAMI_CHECK(t->defined() && t->dtype() == DType::f32 && t->numel() == n, "adamw tensors must be f32 with ", n,
                  " elements; got ", shape_string(t->shape()));
  ORIGAMI_CHECK(s.step >= 1, "adamw step is 1-based, got ", s.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(s.beta1), static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(s.beta2), static_cast<double>(s.step));
  const float step_size = static_cast<float>(static_cast<double>(s.lr) / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = static_cast<float>(mul_add(-static_cast<double>(s.lr), static_cast<double>(s.weight_decay), 1.0));
  const float w1 = 1.0f - s.beta1, b2 = s.beta2, w2 = 1.0f - s.beta2, eps = s.eps;
  float* __restrict p = param.f32();
  const float* __restrict g = grad.f32();
  float* __restrict m = exp_avg.f32();
  float* __restrict v = exp_avg_sq.f32();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = mul_add(w1, gi - m[i], m[i]);  // torch lerp with weight < 0.5
    const float vi = mul_add(v[i], b2, w2 * gi * gi);
    m[i] = mi;
    v[i] = vi;
    p[i] = mul_add(-(mi / (std::sqrt(vi) / bc2_sqrt + eps)), step_size, p[i] * decay);
  }
}

// f32 only: the dispatch widens a bf16 grad and param (and scales a bf16
// grad in bf16 first, so the rounding of scale_inplace is kept).
void adamw_update_fused(const ExecContext& ctx, Tensor& master, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                        Tensor& param, std::span<const AdamWSegment> segments, float grad_scale, const AdamWStep& s) {
  if (grad_scale != 1.0f) cpu::scale_inplace(ctx, grad, grad_scale);
  AdamWStep step = s;
  for (const AdamWSegment& seg : segments) {
    if (seg.numel == 0) continue;
    const auto part = [&](const Tensor& t) { return t.flat_view(seg.begin, seg.numel, {seg.numel}); };
    Tensor p = part(master), g = part(grad), m = part(exp_avg), v = part(exp_avg_sq);
    step.weight_decay = seg.weight_decay;
    cpu::adamw_update(ctx, p, g, m, v, step);
    if (!param.defined()) continue;
    Tensor out = part(param);
    cpu::cast(ctx, p, out);
  }
}

}  // namespace origami::cpu
