// Internal to the CPU kernels: a 16-float vector type (GNU vector extension;
// one AVX-512 register, lowered to narrower registers elsewhere) and a
// vectorizable exp. GCC only vectorizes std::exp under -ffast-math, which we
// do not use, and its auto-vectorizer left the attention row reductions
// scalar, so the hottest loops are written on vf16 directly.
// exp: Cephes expf, Cody-Waite reduction by ln2 and a degree-6 polynomial;
// relative error < 2e-7 over the clamped range.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

namespace origami::cpu {

using vf16 = float __attribute__((vector_size(64)));
using vi16 = int32_t __attribute__((vector_size(64)));
inline constexpr int kVecLanes = 16;

inline vf16 splat(float x) { return vf16{} + x; }
inline vi16 splat_i(int32_t x) { return vi16{} + x; }
inline vf16 load(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vi16 load_i(const int32_t* p) {
  vi16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
inline vf16 vmax(vf16 a, vf16 b) { return a > b ? a : b; }

inline float hmax(vf16 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float hsum(vf16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// exp(x) for finite x and -inf, lane-wise. Exactly 0 for x < -87.3 (masked
// scores, stored as -inf, contribute nothing); saturates near 2.4e38 for
// x > 88.3 (callers feed max-subtracted arguments, or silu's −g).
inline vf16 exp_fast(vf16 x) {
  const vf16 xc = vmax(x < 88.3f ? x : splat(88.3f), splat(-87.3f));
  // Round to nearest with the 1.5·2^23 trick: plain float ops.
  const vf16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  vf16 r = xc - n * 0.693359375f;  // ln2 split so n·hi is exact
  r = r + n * 2.12194440e-4f;
  vf16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf16 y = p * r * r + r + 1.0f;
  // n ∈ [-126, 127], so the biased exponent is a normal one.
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  const vf16 two_n = (vf16)bits;  // GNU vector cast: reinterprets the bits
  return x < -87.3f ? splat(0.0f) : y * two_n;
}

// Scalar form with the same arithmetic, for loops the compiler vectorizes
// itself (elementwise ops under `omp simd`).
inline float exp_fast(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : y * two_n;
}

}  // namespace origami::cpu
