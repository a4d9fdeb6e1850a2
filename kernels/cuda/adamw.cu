// CUDA AdamW (kernels/adamw.h): one fused elementwise pass over a flat
// parameter unit — param, exp_avg, exp_avg_sq f32 (the master state), grad
// f32 or bf16 (read-only, widened exactly).
//
// The CPU twin's formula and operation order: the scalars (bias corrections
// in double, then rounded) are computed on the host by the same expressions,
// and each element repeats the CPU's arithmetic with the FMAs GCC forms for
// it at -O3 -march=native (checked in its assembly: the loop stays scalar
// because of sqrtf's errno branch):
//   m' = fmaf(w1, g − m, m)                       m + w1·(g − m)
//   v' = fmaf(v, β2, (w2·g)·g)                    v·β2 + w2·g·g
//   p' = fmaf(−(m' / (sqrtf(v')/√bc2 + eps)), step_size, p·decay)
// sqrtf and the divisions are IEEE (nvcc's default -prec-sqrt/-prec-div), so
// f32 results are bitwise the CPU's wherever its compiler contracts the same
// way; elsewhere they differ by an ulp or so.
//
// Grid-stride over 8-element packs when all four pointers are 16-byte
// aligned, the leftover (or, unaligned, every) element by a scalar loop.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace origami::cuda {

namespace {

constexpr int kThreads = 256;

struct Scalars {
  float step_size, bc2_sqrt, decay, w1, b2, w2, eps;
};

__device__ __forceinline__ void update(const Scalars& s, float g, float& p, float& m, float& v) {
  m = fmaf(s.w1, g - m, m);  // torch lerp with weight < 0.5
  v = fmaf(v, s.b2, s.w2 * g * g);
  p = fmaf(-(m / (sqrtf(v) / s.bc2_sqrt + s.eps)), s.step_size, p * s.decay);
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                 float* __restrict__ exp_avg_sq, int64_t n, Scalars s, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  int64_t scalar_from = 0;
  if (packed) {
    const int64_t packs = n / kPack;
    for (int64_t q = i0; q < packs; q += stride) {
      const int64_t i = q * kPack;
      float p[kPack], g[kPack], m[kPack], v[kPack];
      load_pack(param + i, p);
      load_pack(grad + i, g);
      load_pack(exp_avg + i, m);
      load_pack(exp_avg_sq + i, v);
#pragma unroll
      for (int k = 0; k < kPack; ++k) update(s, g[k], p[k], m[k], v[k]);
      store_pack(param + i, p);
      store_pack(exp_avg + i, m);
      store_pack(exp_avg_sq + i, v);
    }
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    update(s, to_f32(grad[i]), p, m, v);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace

void adamw_update(const ExecContext& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWStep& s) {
  ORIGAMI_CHECK(param.defined() && param.dtype() == DType::f32, "adamw param must be f32");
  const int64_t n = param.numel();
  ORIGAMI_CHECK(grad.defined() && is_float_data(grad.dtype()) && grad.numel() == n,
                "adamw grad must be f32 or bf16 with ", n, " elements; got ",
                grad.defined() ? shape_string(grad.shape()) + " " + std::string(to_string(grad.dtype()))
                               : std::string("an undefined tensor"));
  const Tensor* state[] = {&exp_avg, &exp_avg_sq};
  for (const Tensor* t : state)
    ORIGAMI_CHECK(t->defined() && t->dtype() == DType::f32 && t->numel() == n, "adamw tensors must be f32 with ", n,
                  " elements; got ", t->defined() ? shape_string(t->shape()) : std::string("an undefined tensor"));
  ORIGAMI_CHECK(s.step >= 1, "adamw step is 1-based, got ", s.step);
  // The CPU twin's scalars, expression for expression.
  const double bc1 = 1.0 - std::pow(static_cast<double>(s.beta1), static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(s.beta2), static_cast<double>(s.step));
  const Scalars k{static_cast<float>(static_cast<double>(s.lr) / bc1),
                  static_cast<float>(std::sqrt(bc2)),
                  // 1 − lr·wd as the CPU build computes it: contracted to one fma in double
                  // (vfnmadd132sd at -march=native; nvcc's host pass has no -march to do that).
                  static_cast<float>(std::fma(-static_cast<double>(s.lr), static_cast<double>(s.weight_decay), 1.0)),
                  1.0f - s.beta1,
                  s.beta2,
                  1.0f - s.beta2,
                  s.eps};
  if (n == 0) return;
  with_data_type(grad.dtype(), [&]<class G>() {
    float* p = dev<float>(param, "param");
    const G* g = dev<const G>(grad, "grad");
    float* m = dev<float>(exp_avg, "exp_avg");
    float* v = dev<float>(exp_avg_sq, "exp_avg_sq");
    const bool packed = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v);
    adamw_kernel<G><<<grid_for(packed ? n / kPack : n, kThreads), kThreads, 0, stream_of(ctx)>>>(p, g, m, v, n, k,
                                                                                                  packed);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace origami::cuda
