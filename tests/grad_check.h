// Finite-difference helpers for module gradient tests. Modules run in fp32,
// so checks are directional: for a random direction U, the analytic
// derivative <∇f, U> is compared with the central difference
// (f(x + hU) − f(x − hU)) / 2h, where f = Σ out ⊙ R (R fixed random) is summed
// in fp64. h = 1e-3: at h = 1e-2 the O(h²) truncation of softmax-heavy
// objectives already reached 1–5% (measured), while at 1e-3 the worst
// relative error seen is 2.5e-3, from fp32 rounding (~1e-7·|f| / h) on small
// derivatives. A 1e-2 relative tolerance still separates a correct gradient
// from a wrong one, which is off by O(1) (a dropped term, a transposed
// product, a sign).
#pragma once
#include <gtest/gtest.h>

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
// Returns the central-difference directional derivative along u.
inline double directional_fd(Tensor& x, const Tensor& u, double h, const std::function<double()>& f) {
  Tensor saved = Tensor::empty(x.shape(), DType::f32, MemCategory::workspace);
  saved.copy_from(x);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = saved.f32()[i] + static_cast<float>(h) * u.f32()[i];
  const double fp = f();
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = saved.f32()[i] - static_cast<float>(h) * u.f32()[i];
  const double fm = f();
  x.copy_from(saved);
  return (fp - fm) / (2 * h);
}

// Checks <grad, u> against the central difference for a fresh random u.
// The tolerance is rtol·max(|numeric|, abs_floor): abs_floor covers the fp32
// noise of f itself divided by 2h, which dominates small derivatives.
inline void expect_directional_grad(const char* what, Tensor& x, const Tensor& grad, std::mt19937& rng,
                                    const std::function<double()>& f, double h = 1e-3, double rtol = 1e-2,
                                    double abs_floor = 1e-3) {
  Tensor u = random_tensor(x.shape(), rng);
  const double analytic = dot(grad, u);
  const double numeric = directional_fd(x, u, h, f);
  EXPECT_GT(std::abs(analytic), 1e-6) << what << ": gradient is (near) zero; the check would be vacuous";
  EXPECT_NEAR(analytic, numeric, rtol * std::max(std::abs(numeric), abs_floor))
      << what << ": analytic " << analytic << " vs finite difference " << numeric;
}

}  // namespace origami::testing
