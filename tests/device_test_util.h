// What the device tests share (tests/test_kernels_device.cpp,
// tests/test_kernels_cuda_ops.cpp): fresh random host inputs, a bitwise
// comparison, and the CudaDevice fixture, which skips naming what is
// missing (the build's CUDA, or a device) rather than failing.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "kernels/device.h"
#include "kernels/tensor.h"
#include "test_seed.h"

namespace origami::testing {

// N(0, 1) floats: never all zeros, no exact cancellations.
inline Tensor random_host(Shape shape, uint32_t seed, MemCategory cat = MemCategory::activation) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32, cat);
  std::mt19937 rng(testing::test_seed(seed));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Why the CUDA half cannot run here, or "" when it can.
inline std::string no_cuda_reason() {
  if (!built_with_cuda()) return "built without CUDA (-DORIGAMI_CUDA=OFF or no toolkit)";
  if (cuda_device_count() == 0) return "built with CUDA, but this machine has no CUDA device (" + cuda_unavailable_reason() + ")";
  return "";
}

class CudaDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = no_cuda_reason();
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
};

}  // namespace origami::testing
