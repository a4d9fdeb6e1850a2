// bf16 on the host: the rounding rule every backend shares (CPU cast, the
// CPU's bf16 emulation, MPI's bf16 reductions), bit for bit the CUDA one.
#pragma once
#include <cstdint>
#include <cstring>

namespace origami {

// Round to nearest even on the upper 16 bits. Any NaN becomes the canonical
// 0x7FFF, as CUDA's cvt.rn.bf16.f32 gives (rounding a payload could carry
// it into infinity), so both backends agree bit for bit.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// Exact.
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace origami
