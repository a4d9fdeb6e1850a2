// CPU rotary position embedding (rotate-half), in place on [B, S, H, hd].
// Angles are formed in double (θ^(−2i/hd) · pos) and rounded once to float
// cos/sin: positions reach 10⁵ under long context, where a float angle would
// already be off by ~10⁻².
#include <cmath>

#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

// Stack tables: no allocation behind the caller's back, and hd is small.
constexpr int64_t kMaxHalf = 512;

// sign = +1 rotates by +angle (forward); −1 by −angle (the inverse and the
// adjoint, since a rotation matrix is orthogonal).
void rotate(Tensor& x_BSHd, const Tensor& pos_S, float theta, double sign, const char* what) {
  ORIGAMI_CHECK(x_BSHd.defined() && x_BSHd.dim() == 4 && x_BSHd.dtype() == DType::f32, what,
                " expects an f32 [B, S, H, hd] tensor, got ", shape_string(x_BSHd.shape()));
  const int64_t B = x_BSHd.size(0), S = x_BSHd.size(1), H = x_BSHd.size(2), hd = x_BSHd.size(3);
  ORIGAMI_CHECK(hd % 2 == 0 && hd / 2 <= kMaxHalf, what, " head_dim ", hd, " must be even and <= ", 2 * kMaxHalf);
  check_shape(pos_S, {S}, "rope positions");
  ORIGAMI_CHECK(pos_S.dtype() == DType::i32, "rope positions must be i32");
  ORIGAMI_CHECK(theta > 0.0f, what, " theta must be positive, got ", theta);
  const int64_t half = hd / 2;
  const int32_t* pos = pos_S.i32();
  float* x = x_BSHd.f32();
  double inv_freq[kMaxHalf];
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(hd));

#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    float cs[kMaxHalf], sn[kMaxHalf];
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos[s]) * inv_freq[i];
      cs[i] = static_cast<float>(std::cos(angle));
      sn[i] = static_cast<float>(sign * std::sin(angle));
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        float* __restrict lo = x + ((b * S + s) * H + h) * hd;
        float* __restrict hi = lo + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = lo[i], c = hi[i];
          lo[i] = a * cs[i] - c * sn[i];
          hi[i] = c * cs[i] + a * sn[i];
        }
      }
  }
}

}  // namespace

void rope_forward(const ExecContext& ctx, Tensor& x_BSHd, const Tensor& pos_S, float theta) {
  rotate(x_BSHd, pos_S, theta, 1.0, "rope_forward");
}

void rope_backward(const ExecContext& ctx, Tensor& dx_BSHd, const Tensor& pos_S, float theta) {
  rotate(dx_BSHd, pos_S, theta, -1.0, "rope_backward");
}

}  // namespace origami::cpu
