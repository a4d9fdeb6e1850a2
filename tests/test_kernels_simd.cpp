// The CPU kernels' vectorized exp (kernels/cpu/simd.h) against std::exp in
// double, scalar and vf16 forms: accuracy over the whole clamped range, exact
// zero for masked (-inf) and underflowing inputs, and the horizontal
// reductions the attention rows rely on.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "kernels/cpu/simd.h"
#include "test_seed.h"

namespace origami::cpu {
namespace {

TEST(ExpFast, RelativeErrorBelow2e7OverTheRange) {
  std::mt19937 g(testing::test_seed(1));
  std::uniform_real_distribution<float> u(-87.0f, 88.0f);
  double worst = 0.0;
  for (int i = 0; i < 200000; ++i) {
    const float x = i < 1000 ? -10.0f + 0.02f * i : u(g);  // dense near 0 too
    const double want = std::exp(static_cast<double>(x));
    const float got = exp_fast(x);
    worst = std::max(worst, std::abs(got - want) / want);
  }
  // Cephes expf's documented bound is ~1.5e-7 (about 2 ulp) on this range.
  EXPECT_LT(worst, 2e-7);
  EXPECT_EQ(exp_fast(0.0f), 1.0f);
}

TEST(ExpFast, MaskedAndUnderflowingInputsGiveExactZero) {
  EXPECT_EQ(exp_fast(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(exp_fast(-87.31f), 0.0f);
  EXPECT_EQ(exp_fast(-1e30f), 0.0f);
  EXPECT_GT(exp_fast(-87.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(exp_fast(1e30f)));  // saturates instead of inf/NaN
}

TEST(ExpFast, VectorFormMatchesScalarFormLaneByLane) {
  std::mt19937 g(testing::test_seed(2));
  std::uniform_real_distribution<float> u(-90.0f, 90.0f);
  float in[kVecLanes], out[kVecLanes];
  for (int rep = 0; rep < 1000; ++rep) {
    for (float& x : in) x = u(g);
    in[3] = -std::numeric_limits<float>::infinity();
    store(out, exp_fast(load(in)));
    for (int l = 0; l < kVecLanes; ++l) {
      // Same operation sequence; only FMA contraction may differ: 1 ulp.
      const float s = exp_fast(in[l]);
      ASSERT_NEAR(out[l], s, 1.2e-7f * s) << "lane " << l << " x=" << in[l];
    }
  }
}

TEST(Horizontal, MaxAndSumOfAllLanes) {
  float v[kVecLanes];
  double sum = 0.0;
  for (int l = 0; l < kVecLanes; ++l) {
    v[l] = static_cast<float>((l * 7) % 16) - 3.5f;  // max 11.5 sits at a middle lane
    sum += v[l];
  }
  EXPECT_EQ(hmax(load(v)), 11.5f);
  EXPECT_EQ(hsum(load(v)), sum);  // halves sum exactly
}

}  // namespace
}  // namespace origami::cpu
