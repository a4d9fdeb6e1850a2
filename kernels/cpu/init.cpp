// Layout-independent parameter init: Philox4x32-10 counter-based RNG, one
// counter per global element, so out[j] depends only on (seed, name,
// global_offset + j) and shards generated separately equal slices of the whole.
// Normal samples use one Box-Muller draw per element (the cosine branch) from
// two 53-bit uniforms, computed in double and rounded once.
#include <cmath>
#include <numbers>

#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

inline double uniform53(uint32_t hi, uint32_t lo) {  // [0, 1)
  const uint64_t bits = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}

}  // namespace

void init_normal(const ExecContext& ctx, Tensor& out, uint64_t seed, std::string_view name, int64_t global_offset,
                 float std) {
  ORIGAMI_CHECK(out.defined() && out.dtype() == DType::f32, "init_normal fills an f32 tensor");
  ORIGAMI_CHECK(global_offset >= 0, "init_normal global_offset must be >= 0, got ", global_offset);
  const uint64_t h = name_hash(name);
  const std::array<uint32_t, 2> key{static_cast<uint32_t>(h), static_cast<uint32_t>(h >> 32)};
  const uint32_t seed_lo = static_cast<uint32_t>(seed), seed_hi = static_cast<uint32_t>(seed >> 32);
  const int64_t n = out.numel();
  float* d = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t i = static_cast<uint64_t>(global_offset + j);
    const auto r = philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), seed_lo, seed_hi}, key);
    const double u1 = 1.0 - uniform53(r[0], r[1]);  // (0, 1]: log stays finite
    const double u2 = uniform53(r[2], r[3]);
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    d[j] = static_cast<float>(static_cast<double>(std) * z);
  }
}

void init_constant(const ExecContext& ctx, Tensor& out, float value) {
  ORIGAMI_CHECK(out.defined() && out.dtype() == DType::f32, "init_constant fills an f32 tensor");
  const int64_t n = out.numel();
  float* d = out.f32();
#pragma omp parallel for simd schedule(static)
  for (int64_t j = 0; j < n; ++j) d[j] = value;
}

}  // namespace origami::cpu

namespace origami {

uint64_t name_hash(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kW0;
      key[1] += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    cpu::mulhilo(kM0, ctr[0], hi0, lo0);
    cpu::mulhilo(kM1, ctr[2], hi1, lo1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

}  // namespace origami
