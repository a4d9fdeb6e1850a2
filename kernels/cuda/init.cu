// CUDA layout-independent init (kernels/init.h): init_normal, init_constant,
// into f32 (the CPU twin's dtype) or bf16.
//
// init_normal is kernels/cpu/init.cpp element for element: Philox4x32-10
// with counter {lo(i), hi(i), lo(seed), hi(seed)} for global element i and
// key {lo, hi} of name_hash(name) (hashed on the host), two 53-bit uniforms,
// one Box-Muller draw (the cosine branch) in double, std · z rounded once to
// float (and, for bf16, that float once more to nearest even). The integer
// part is exact; the double part uses the device's log and cos (within 1 and
// 2 ulp of glibc's, sqrt exact), so a sample's double differs from the CPU's
// by a few ulp at most and its float is bitwise the CPU's except when the
// double lies within those ulp of a float rounding boundary (~1e-8 per
// element), and then one float ulp away. One thread per element,
// grid-stride: the work is the double math, the stores are coalesced.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace origami::cuda {

namespace {

constexpr int kThreads = 256;

struct Key {
  uint32_t lo, hi;
};

// Random123's philox4x32 with 10 rounds, as origami::philox4x32_10.
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, Key key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.lo += kW0;
      key.hi += kW1;
    }
    const uint32_t hi0 = __umulhi(kM0, ctr.x), lo0 = kM0 * ctr.x;
    const uint32_t hi1 = __umulhi(kM1, ctr.z), lo1 = kM1 * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.lo, lo1, hi0 ^ ctr.w ^ key.hi, lo0);
  }
  return ctr;
}

__device__ __forceinline__ double uniform53(uint32_t hi, uint32_t lo) {  // [0, 1)
  const uint64_t bits = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    normal_kernel(T* __restrict__ out, int64_t n, uint64_t first, uint32_t seed_lo, uint32_t seed_hi, Key key,
                  double sd) {
  constexpr double kTwoPi = 2.0 * 3.141592653589793;  // 2.0 * std::numbers::pi, exact
  for (int64_t j = thread_index(); j < n; j += thread_stride()) {
    const uint64_t i = first + static_cast<uint64_t>(j);
    const uint4 r = philox4x32_10(
        make_uint4(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), seed_lo, seed_hi), key);
    const double u1 = 1.0 - uniform53(r.x, r.y);  // (0, 1]: log stays finite
    const double u2 = uniform53(r.z, r.w);
    const double z = sqrt(-2.0 * log(u1)) * cos(kTwoPi * u2);
    out[j] = from_f32<T>(static_cast<float>(sd * z));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) constant_kernel(T* out, int64_t n, float value, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  int64_t scalar_from = 0;
  if (packed) {
    float v[kPack];
#pragma unroll
    for (int k = 0; k < kPack; ++k) v[k] = value;
    const int64_t packs = n / kPack;
    for (int64_t p = i0; p < packs; p += stride) store_pack(out + p * kPack, v);
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) out[i] = from_f32<T>(value);
}

void check_out(const Tensor& out, const char* what) {
  ORIGAMI_CHECK(out.defined() && is_float_data(out.dtype()), what, " fills an f32 or bf16 tensor, got ",
                out.defined() ? to_string(out.dtype()) : std::string_view("an undefined one"));
}

}  // namespace

void init_normal(const ExecContext& ctx, Tensor& out, uint64_t seed, std::string_view name, int64_t global_offset,
                 float std) {
  check_out(out, "init_normal");
  ORIGAMI_CHECK(global_offset >= 0, "init_normal global_offset must be >= 0, got ", global_offset);
  const int64_t n = out.numel();
  if (n == 0) return;
  const uint64_t h = name_hash(name);
  const Key key{static_cast<uint32_t>(h), static_cast<uint32_t>(h >> 32)};
  with_data_type(out.dtype(), [&]<class T>() {
    normal_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
        dev<T>(out, "out"), n, static_cast<uint64_t>(global_offset), static_cast<uint32_t>(seed),
        static_cast<uint32_t>(seed >> 32), key, static_cast<double>(std));
    CUDA_CHECK_LAUNCH();
  });
}

void init_constant(const ExecContext& ctx, Tensor& out, float value) {
  check_out(out, "init_constant");
  const int64_t n = out.numel();
  if (n == 0) return;
  with_data_type(out.dtype(), [&]<class T>() {
    T* d = dev<T>(out, "out");
    const bool packed = aligned16(d);
    constant_kernel<T><<<grid_for(packed ? n / kPack : n, kThreads), kThreads, 0, stream_of(ctx)>>>(d, n, value,
                                                                                                     packed);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace origami::cuda
