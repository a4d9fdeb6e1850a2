// CPU SwiGLU activation: h = silu(g) ⊙ u and its backward. Elementwise over
// flat [T, F] buffers; σ uses the vectorized exp_fast, since at small hidden
// sizes a scalar expf per element is a visible share of the MLP's time.
#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"

namespace origami::cpu {

namespace {

inline float sigmoid(float g) { return 1.0f / (1.0f + cpu::exp_fast(-g)); }

void check_same(const Tensor& t, const Tensor& ref, const char* name) {
  check_shape(t, ref.shape(), name);
  ORIGAMI_CHECK(t.dtype() == DType::f32, name, " must be f32");
}

}  // namespace

void swiglu_forward(const ExecContext& ctx, const Tensor& gate_TF, const Tensor& up_TF, Tensor& h_TF) {
  check_same(gate_TF, gate_TF, "swiglu gate");
  check_same(up_TF, gate_TF, "swiglu up");
  check_same(h_TF, gate_TF, "swiglu h");
  const int64_t n = gate_TF.numel();
  const float* __restrict g = gate_TF.f32();
  const float* __restrict u = up_TF.f32();
  float* __restrict h = h_TF.f32();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) h[i] = g[i] * sigmoid(g[i]) * u[i];
}

// d silu(g)/dg = σ(g)·(1 + g·(1 − σ(g))).
void swiglu_backward(const ExecContext& ctx, const Tensor& dh_TF, const Tensor& gate_TF, const Tensor& up_TF,
                     Tensor& dgate_TF, Tensor& dup_TF) {
  check_same(gate_TF, gate_TF, "swiglu gate");
  check_same(up_TF, gate_TF, "swiglu up");
  check_same(dh_TF, gate_TF, "swiglu dh");
  check_same(dgate_TF, gate_TF, "swiglu dgate");
  check_same(dup_TF, gate_TF, "swiglu dup");
  const int64_t n = gate_TF.numel();
  const float* __restrict dh = dh_TF.f32();
  const float* __restrict g = gate_TF.f32();
  const float* __restrict u = up_TF.f32();
  float* __restrict dg = dgate_TF.f32();
  float* __restrict du = dup_TF.f32();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    du[i] = dh[i] * g[i] * s;
    dg[i] = dh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

}  // namespace origami::cpu
