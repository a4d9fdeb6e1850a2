// CUDA AdamW (kernels/adamw.h): one fused elementwise pass over a flat
// parameter unit — param, exp_avg, exp_avg_sq f32 (the master state), grad
// f32 or bf16 (read-only, widened exactly).
//
// The CPU twin's formula and operation order: the scalars (bias corrections
// in double, then rounded) are computed on the host by the same expressions,
// and each element repeats the CPU's arithmetic, whose fused multiply-adds
// kernels/cpu/adamw.cpp writes out (std::fma where the target has FMA
// instructions: x86-64 at -march=native on any recent CPU, aarch64):
//   m' = fmaf(w1, g − m, m)                       m + w1·(g − m)
//   v' = fmaf(v, β2, (w2·g)·g)                    v·β2 + w2·g·g
//   p' = fmaf(−(m' / (sqrtf(v')/√bc2 + eps)), step_size, p·decay)
// sqrtf and the divisions are IEEE (nvcc's default -prec-sqrt/-prec-div), so
// f32 results are bitwise the CPU's when it has FMA; a CPU build without
// rounds each of those twice, an ulp or so away.
//
// Grid-stride over 8-element packs when all four pointers are 16-byte
// aligned, the leftover (or, unaligned, every) element by a scalar loop.
//
// adamw_update_fused: the same per-element update after the gradient's
// scaling (one IEEE multiply, __fmul_rn so it never merges into the update's
// fmas, rounded to the gradient's dtype as scale_kernel stores it) and before
// the working copy's rounding (bf16_bits, as `cast`): bitwise the three
// kernels. One launch per kMaxSegments segments: each block takes one chunk
// of kChunk elements of one segment (so one weight decay), its threads
// groups of 8 (packed when every pointer is 16-byte aligned at the
// segment's start; chunks start a multiple of 8 after it).
#include <cmath>
#include <limits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace origami::cuda {

namespace {

constexpr int kThreads = 256;

struct Scalars {
  float step_size, bc2_sqrt, decay, w1, b2, w2, eps;
};

// 1 − lr·wd as the CPU build computes it: one fma in double (its mul_add;
// nvcc's host pass would not contract it).
float decay_of(float lr, float weight_decay) {
  return static_cast<float>(std::fma(-static_cast<double>(lr), static_cast<double>(weight_decay), 1.0));
}

__device__ __forceinline__ void update(const Scalars& s, float g, float& p, float& m, float& v) {
  m = fmaf(s.w1, g - m, m);  // torch lerp with weight < 0.5
  v = fmaf(v, s.b2, s.w2 * g * g);
  p = fmaf(-(m / (sqrtf(v) / s.bc2_sqrt + s.eps)), s.step_size, p * s.decay);
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                 float* __restrict__ exp_avg_sq, int64_t n, Scalars s, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  int64_t scalar_from = 0;
  if (packed) {
    const int64_t packs = n / kPack;
    for (int64_t q = i0; q < packs; q += stride) {
      const int64_t i = q * kPack;
      float p[kPack], g[kPack], m[kPack], v[kPack];
      load_pack(param + i, p);
      load_pack(grad + i, g);
      load_pack(exp_avg + i, m);
      load_pack(exp_avg_sq + i, v);
#pragma unroll
      for (int k = 0; k < kPack; ++k) update(s, g[k], p[k], m[k], v[k]);
      store_pack(param + i, p);
      store_pack(exp_avg + i, m);
      store_pack(exp_avg_sq + i, v);
    }
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    update(s, to_f32(grad[i]), p, m, v);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

constexpr int kMaxSegments = 32;
constexpr int64_t kChunk = int64_t{kThreads} * kPack * 4;

struct SegmentTable {  // a kernel parameter: ~0.9 KB
  int count = 0;
  int64_t begin[kMaxSegments], end[kMaxSegments];
  int64_t first_chunk[kMaxSegments + 1];  // block b runs segment i when first_chunk[i] <= b < first_chunk[i + 1]
  float decay[kMaxSegments];
  bool packed[kMaxSegments];
};

template <class G, bool kCast>
__global__ void __launch_bounds__(kThreads)
    adamw_fused_kernel(float* __restrict__ master, G* __restrict__ grad, float* __restrict__ exp_avg,
                       float* __restrict__ exp_avg_sq, bf16* __restrict__ param, const SegmentTable t, Scalars s,
                       float grad_scale) {
  const int64_t chunk = blockIdx.x;
  int seg = 0;
  while (seg + 1 < t.count && t.first_chunk[seg + 1] <= chunk) ++seg;
  const int64_t lo = t.begin[seg] + (chunk - t.first_chunk[seg]) * kChunk;
  const int64_t hi = lo + kChunk < t.end[seg] ? lo + kChunk : t.end[seg];
  s.decay = t.decay[seg];
  const bool packed = t.packed[seg], scaled = grad_scale != 1.0f;
  for (int64_t i = lo + static_cast<int64_t>(threadIdx.x) * kPack; i < hi; i += int64_t{kThreads} * kPack) {
    float p[kPack], g[kPack], m[kPack], v[kPack];
    const int count = load_upto(master + i, hi - i, packed, p);
    load_upto(grad + i, hi - i, packed, g);
    load_upto(exp_avg + i, hi - i, packed, m);
    load_upto(exp_avg_sq + i, hi - i, packed, v);
    if (scaled) {
#pragma unroll
      for (int k = 0; k < kPack; ++k) g[k] = to_f32(from_f32<G>(__fmul_rn(g[k], grad_scale)));
      store_upto(grad + i, count, packed, g);
    }
#pragma unroll
    for (int k = 0; k < kPack; ++k) update(s, g[k], p[k], m[k], v[k]);  // the tail's zeros stay finite
    store_upto(master + i, count, packed, p);
    store_upto(exp_avg + i, count, packed, m);
    store_upto(exp_avg_sq + i, count, packed, v);
    if constexpr (kCast) store_bf16_bits_upto(param + i, count, packed, p);
  }
}

// The CPU twin's scalars, expression for expression.
Scalars scalars_of(const AdamWStep& s) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(s.beta1), static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(s.beta2), static_cast<double>(s.step));
  return {static_cast<float>(static_cast<double>(s.lr) / bc1), static_cast<float>(std::sqrt(bc2)),
          decay_of(s.lr, s.weight_decay), 1.0f - s.beta1, s.beta2, 1.0f - s.beta2, s.eps};
}

}  // namespace

void adamw_update(const ExecContext& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWStep& s) {
  ORIGAMI_CHECK(param.defined() && param.dtype() == DType::f32, "adamw param must be f32");
  const int64_t n = param.numel();
  ORIGAMI_CHECK(grad.defined() && is_float_data(grad.dtype()) && grad.numel() == n,
                "adamw grad must be f32 or bf16 with ", n, " elements; got ",
                grad.defined() ? shape_string(grad.shape()) + " " + std::string(to_string(grad.dtype()))
                               : std::string("an undefined tensor"));
  const Tensor* state[] = {&exp_avg, &exp_avg_sq};
  for (const Tensor* t : state)
    ORIGAMI_CHECK(t->defined() && t->dtype() == DType::f32 && t->numel() == n, "adamw tensors must be f32 with ", n,
                  " elements; got ", t->defined() ? shape_string(t->shape()) : std::string("an undefined tensor"));
  ORIGAMI_CHECK(s.step >= 1, "adamw step is 1-based, got ", s.step);
  const Scalars k = scalars_of(s);
  if (n == 0) return;
  with_data_type(grad.dtype(), [&]<class G>() {
    float* p = dev<float>(param, "param");
    const G* g = dev<const G>(grad, "grad");
    float* m = dev<float>(exp_avg, "exp_avg");
    float* v = dev<float>(exp_avg_sq, "exp_avg_sq");
    const bool packed = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v);
    adamw_kernel<G><<<grid_for(packed ? n / kPack : n, kThreads), kThreads, 0, stream_of(ctx)>>>(p, g, m, v, n, k,
                                                                                                  packed);
    CUDA_CHECK_LAUNCH();
  });
}

// Checked by the dispatch: dtypes, sizes, the segments' tiling.
void adamw_update_fused(const ExecContext& ctx, Tensor& master, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                        Tensor& param, std::span<const AdamWSegment> segments, float grad_scale, const AdamWStep& s) {
  const Scalars k = scalars_of(s);
  with_data_type(grad.dtype(), [&]<class G>() {
    float* p = dev<float>(master, "master");
    G* g = dev<G>(grad, "grad");
    float* m = dev<float>(exp_avg, "exp_avg");
    float* v = dev<float>(exp_avg_sq, "exp_avg_sq");
    bf16* w = param.defined() ? dev<bf16>(param, "param") : nullptr;
    SegmentTable t;
    int64_t chunks = 0;
    const auto launch = [&] {
      if (t.count == 0) return;
      t.first_chunk[t.count] = chunks;
      ORIGAMI_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "adamw_update_fused: ", chunks, " chunks");
      const auto blocks = static_cast<unsigned>(chunks);
      if (w)
        adamw_fused_kernel<G, true><<<blocks, kThreads, 0, stream_of(ctx)>>>(p, g, m, v, w, t, k, grad_scale);
      else
        adamw_fused_kernel<G, false><<<blocks, kThreads, 0, stream_of(ctx)>>>(p, g, m, v, w, t, k, grad_scale);
      CUDA_CHECK_LAUNCH();
      t.count = 0;
      chunks = 0;
    };
    for (const AdamWSegment& seg : segments) {
      if (seg.numel == 0) continue;
      if (t.count == kMaxSegments) launch();
      const int i = t.count++;
      t.begin[i] = seg.begin;
      t.end[i] = seg.begin + seg.numel;
      t.first_chunk[i] = chunks;
      chunks += (seg.numel + kChunk - 1) / kChunk;
      t.decay[i] = decay_of(s.lr, seg.weight_decay);
      const int64_t b = seg.begin;
      t.packed[i] =
          aligned16(p + b) && aligned16(g + b) && aligned16(m + b) && aligned16(v + b) && (!w || aligned16(w + b));
    }
    launch();
  });
}

}  // namespace origami::cuda
