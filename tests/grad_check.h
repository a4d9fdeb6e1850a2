// Finite-difference helpers for module gradient tests. Modules run in fp32,
// so checks are directional: for a random direction U, the analytic
// derivative <∇f, U> is compared with a finite difference of
// f = Σ out ⊙ R (R fixed random), summed in fp64.
//
// The difference is the central one Richardson-extrapolated,
// (4·D(h) − D(2h)) / 3 with D(h) = (f(x + hU) − f(x − hU)) / 2h, whose
// truncation is O(h⁴), not O(h²): U is N(0, 1) in every element, so on
// tensors of small elements (an embedding at init_std) a step of h = 1e-3 is
// several percent of x, and the plain central difference was 3.4% off on
// fresh inputs (extrapolated: 0.22%). A larger h does not help: over
// 2h = 2e-2 softmax curvature and routing flips dominate (errors > 100%).
//
// What remains is fp32 rounding of f divided by h, which dominates small
// derivatives and differs by module (Σ|out·R| sets it, not |f|). So the check
// measures it: the same estimate at steps 0.8h, 0.9h, 1.1h changes truncation
// by ~h⁴ only, and their spread is the rounding noise. Tolerance:
// rtol·|numeric| + 3·spread. Over 40 fresh seeds of every FD test (7,600
// checks) the error never exceeded spread + 1e-2 relative, nor 3·spread.
// A wrong gradient is off by O(1) (a dropped term, a transposed product, a
// sign), far outside both, as long as the noise term stays below |numeric|
// (then a sign error, off by 2·|numeric|, cannot pass). A check whose noise
// is larger retries with a fresh direction (<∇f, U> is |∇f|·z, z ~ N(0, 1):
// 8% of draws fall below 0.1·|∇f|), then once more at 4h, a quarter of the
// noise (a tensor whose whole gradient is small: an expert few tokens
// reach), and fails if it is still noise-dominated rather than passing
// vacuously.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "kernels/tensor.h"

namespace origami::testing {

inline void fill_normal(Tensor& t, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> d(0.0f, stddev);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(rng);
}

inline Tensor random_tensor(Shape shape, std::mt19937& rng, float stddev = 1.0f,
                            MemCategory cat = MemCategory::activation) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32, cat);
  fill_normal(t, rng, stddev);
  return t;
}

// Token windows [B, S1] with ids uniform in [0, V).
inline Tensor random_tokens(int64_t B, int64_t S1, int64_t V, std::mt19937& rng) {
  Tensor t = Tensor::empty({B, S1}, DType::i32, MemCategory::activation);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(V - 1));
  for (int64_t i = 0; i < t.numel(); ++i) t.i32()[i] = d(rng);
  return t;
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a.f32()[i]) * b.f32()[i];
  return s;
}

// f() evaluates the scalar objective at the current contents of x.
// Returns the directional derivative along u, Richardson-extrapolated from
// central differences at h and 2h; x is restored.
inline double directional_fd(Tensor& x, const Tensor& u, double h, const std::function<double()>& f) {
  Tensor saved = Tensor::empty(x.shape(), DType::f32, MemCategory::workspace);
  saved.copy_from(x);
  auto at = [&](double step) {
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = saved.f32()[i] + static_cast<float>(step) * u.f32()[i];
    return f();
  };
  const double d_h = (at(h) - at(-h)) / (2 * h);
  const double d_2h = (at(2 * h) - at(-2 * h)) / (4 * h);
  x.copy_from(saved);
  return (4 * d_h - d_2h) / 3;
}

// Checks <grad, u> against the finite difference for a fresh random u.
inline void expect_directional_grad(const char* what, Tensor& x, const Tensor& grad, std::mt19937& rng,
                                    const std::function<double()>& f, double h = 1e-3, double rtol = 1e-2) {
  SCOPED_TRACE(what);  // names the tensor in failures raised inside f
  double analytic = 0, numeric = 0, noise = 0;
  for (double step : {h, h, 4 * h}) {
    const Tensor u = random_tensor(x.shape(), rng);
    analytic = dot(grad, u);
    numeric = directional_fd(x, u, step, f);
    double lo = numeric, hi = numeric;
    for (double scale : {0.8, 0.9, 1.1}) {
      const double v = directional_fd(x, u, scale * step, f);
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
    noise = hi - lo;
    if (3 * noise < std::abs(numeric)) break;
  }
  EXPECT_GT(std::abs(analytic), 1e-6) << what << ": gradient is (near) zero; the check would be vacuous";
  EXPECT_LT(3 * noise, std::abs(numeric)) << what << ": the finite difference " << numeric << " is noise-dominated ("
                                          << noise << ") in every direction tried, at h and 4h; the check could not "
                                          << "tell a sign error";
  EXPECT_NEAR(analytic, numeric, rtol * std::abs(numeric) + 3 * noise)
      << what << ": analytic " << analytic << " vs finite difference " << numeric << " (rounding noise " << noise
      << ")";
}

}  // namespace origami::testing
