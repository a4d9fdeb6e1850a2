// Packs: eight consecutive f32 or bf16 elements moved with 16-byte accesses
// (two float4 for f32, one uint4 for bf16) and widened to float, the vector
// path of the dense kernels (elementwise, rmsnorm, rope, swiglu, adamw, init).
// Invariant of every call: the address is 16-byte aligned. A kernel takes the
// packed path only when every pointer it touches is (aligned16) and the
// packed index is a multiple of kPack, with a scalar loop for the tail.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace origami::cuda {

constexpr int kPack = 8;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// bf16 ↔ float on raw bits: widening is exact (the bf16 is the float's top half).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

// The CPU's bf16 rounding (kernels/cpu/elementwise.cpp), bit for bit, as
// `cast` makes it: a NaN becomes 0x7FFF whatever its sign and payload, as the
// CPU and __float2bfloat16_rn give (keeping sign and payload bits, as (u >> 16) | 0x40
// did, turned the default NaN 0x7FC00000 into 0x7FC0, a negative one into 0xFFC0).
__device__ __forceinline__ uint32_t bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void load_pack(const float* p, float (&v)[kPack]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void load_pack(const bf16* p, float (&v)[kPack]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  v[0] = bf16_lo(u.x), v[1] = bf16_hi(u.x), v[2] = bf16_lo(u.y), v[3] = bf16_hi(u.y);
  v[4] = bf16_lo(u.z), v[5] = bf16_hi(u.z), v[6] = bf16_lo(u.w), v[7] = bf16_hi(u.w);
}

__device__ __forceinline__ void store_pack(float* p, const float (&v)[kPack]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Each element rounded to nearest even (__float2bfloat16_rn), as from_f32<bf16>.
__device__ __forceinline__ void store_pack(bf16* p, const float (&v)[kPack]) {
  *reinterpret_cast<uint4*>(p) =
      make_uint4(bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]), bf16_pair(v[4], v[5]), bf16_pair(v[6], v[7]));
}

// The first min(left, kPack) elements at p into v (the rest 0), returning
// that count: one packed load when `packed` (p 16-byte aligned) and a whole
// pack remains, else scalar loads. Reductions walk their data in these
// groups of 8 whichever way it is loaded, so their order, and so their
// result, does not depend on the pointers' alignment.
template <class T>
__device__ __forceinline__ int load_upto(const T* p, int64_t left, bool packed, float (&v)[kPack]) {
  if (packed && left >= kPack) {
    load_pack(p, v);
    return kPack;
  }
  const int count = left < kPack ? static_cast<int>(left) : kPack;
#pragma unroll
  for (int k = 0; k < kPack; ++k) v[k] = k < count ? to_f32(p[k]) : 0.0f;
  return count;
}

// Stores v[0, count) at p, as load_upto loaded it.
template <class T> __device__ __forceinline__ void store_upto(T* p, int count, bool packed, const float (&v)[kPack]) {
  if (packed && count == kPack) {
    store_pack(p, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPack; ++k)
    if (k < count) p[k] = from_f32<T>(v[k]);
}

// v[0, count) at p rounded as bf16_bits (the `cast` kernel's rounding).
__device__ __forceinline__ void store_bf16_bits_upto(bf16* p, int count, bool packed, const float (&v)[kPack]) {
  auto* out = reinterpret_cast<uint16_t*>(p);
  if (packed && count == kPack) {
    uint32_t w[kPack / 2];
#pragma unroll
    for (int k = 0; k < kPack / 2; ++k) w[k] = bf16_bits(v[2 * k]) | (bf16_bits(v[2 * k + 1]) << 16);
    *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPack; ++k)
    if (k < count) out[k] = static_cast<uint16_t>(bf16_bits(v[k]));
}

// One grid-stride thread's first index and stride, in int64 (sizes pass 2^31).
__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

}  // namespace origami::cuda
