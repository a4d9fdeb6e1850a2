// CUDA elementwise ops and fp64 reductions (kernels/elementwise.h): axpy,
// scale_inplace, sum_squares, sum_squares_add, sum, sum_add, cast.
//
// Elementwise: grid-stride over 8-element packs (kernels/cuda/pack.cuh) when
// every pointer is 16-byte aligned, the < 8 leftover elements (or all of
// them, unaligned) by a scalar loop. T is f32 or bf16 (x and y share it);
// the CPU twin takes f32 only. axpy is one fmaf per element, as the CPU's
// contracted `y += a·x` (GCC -O3 -march=native emits vfmadd): bitwise equal.
//
// sum / sum_squares: fp64 terms, as the CPU (a float squared is exact in
// fp64). Deterministic two-pass reduction: a fixed partition of [0, n) into
// blocks of `chunk` elements (a function of n only, a multiple of 8 so every
// block's packs stay aligned), each thread of a block summing fixed groups
// of 8 of its slice in order (the same order packed or not: the result does
// not depend on alignment), then cub::BlockReduce's fixed tree; one block
// then reduces the partials in order. The CPU sums per-thread contiguous blocks: the order
// differs, so results agree to fp64 rounding (n·eps64 of Σ|terms|), not bit
// for bit. The host waits for the result (the op returns it), except in
// sum_squares_add and sum_add, whose last block adds the total into a device
// f64 (one thread: fp64 `acc + total`, as the CPU's host add).
//
// cast: f32 → bf16 with the CPU's integer rounding formula (nearest even;
// any NaN becomes the canonical 0x7FFF, as kernels/elementwise.h and the CPU
// twin say), bf16 → f32 exact: bitwise the CPU.
#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace origami::cuda {

namespace {

constexpr int kThreads = 256;

// Blocks for a packed-or-scalar grid-stride loop over n elements.
unsigned elementwise_grid(int64_t n, bool packed) { return grid_for(packed ? n / kPack : n, kThreads); }

template <class T> __global__ void axpy_kernel(float a, const T* x, T* y, int64_t n, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  int64_t scalar_from = 0;
  if (packed) {
    const int64_t packs = n / kPack;
    for (int64_t p = i0; p < packs; p += stride) {
      float xv[kPack], yv[kPack];
      load_pack(x + p * kPack, xv);
      load_pack(y + p * kPack, yv);
#pragma unroll
      for (int k = 0; k < kPack; ++k) yv[k] = fmaf(a, xv[k], yv[k]);
      store_pack(y + p * kPack, yv);
    }
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) y[i] = from_f32<T>(fmaf(a, to_f32(x[i]), to_f32(y[i])));
}

template <class T> __global__ void scale_kernel(T* y, float a, int64_t n, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  int64_t scalar_from = 0;
  if (packed) {
    const int64_t packs = n / kPack;
    for (int64_t p = i0; p < packs; p += stride) {
      float v[kPack];
      load_pack(y + p * kPack, v);
#pragma unroll
      for (int k = 0; k < kPack; ++k) v[k] *= a;
      store_pack(y + p * kPack, v);
    }
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) y[i] = from_f32<T>(to_f32(y[i]) * a);
}

// ---- fp64 reductions

constexpr int64_t kMaxPartials = 1024;
constexpr int64_t kMinChunk = int64_t{kThreads} * kPack;  // a block's slice: at least one pack per thread

// The partition of [0, n): block b sums [b·chunk, min(n, (b+1)·chunk)).
struct Partition {
  int64_t chunk, blocks;
};
Partition partition_of(int64_t n) {
  int64_t chunk = (n + kMaxPartials - 1) / kMaxPartials;
  chunk = std::max(kMinChunk, (chunk + kPack - 1) / kPack * kPack);
  return {chunk, (n + chunk - 1) / chunk};
}

template <bool Square> __device__ __forceinline__ double term(float v) {
  const double d = static_cast<double>(v);
  return Square ? d * d : d;
}

// Thread t sums the groups of 8 elements g = t, t + kThreads, ... of its
// block's slice, each group's elements in order (kernels/cuda/pack.cuh), so
// the order is the same on the packed and the scalar path.
template <class T, bool Square>
__global__ void __launch_bounds__(kThreads)
    partial_sums_kernel(const T* __restrict__ x, int64_t n, int64_t chunk, bool packed, double* __restrict__ partial) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  double s = 0.0;
  for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kPack; i < end; i += kThreads * kPack) {
    float v[kPack];
    const int count = load_upto(x + i, end - i, packed, v);
#pragma unroll
    for (int k = 0; k < kPack; ++k)
      if (k < count) s += term<Square>(v[k]);
  }
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const double total = Reduce(temp).Sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads) final_sum_kernel(const double* __restrict__ partial, int64_t count,
                                                              bool accumulate, double* __restrict__ out) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) s += partial[i];
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const double total = Reduce(temp).Sum(s);
  if (threadIdx.x == 0) *out = accumulate ? *out + total : total;
}

// Queues the sum of x's (squared) terms into *out (added to it with
// `accumulate`) on ctx's stream. n > 0.
template <bool Square>
void reduce_into(const ExecContext& ctx, const Tensor& x, double* out, bool accumulate) {
  const int64_t n = x.numel();
  const Partition part = partition_of(n);
  Tensor ws = ctx.workspace(static_cast<size_t>(part.blocks) * sizeof(double));  // partials, fp64
  auto* partial = static_cast<double*>(ws.address());
  cudaStream_t stream = stream_of(ctx);
  with_data_type(x.dtype(), [&]<class T>() {
    const T* xs = dev<const T>(x, "x");
    partial_sums_kernel<T, Square><<<static_cast<unsigned>(part.blocks), kThreads, 0, stream>>>(
        xs, n, part.chunk, aligned16(xs), partial);
    CUDA_CHECK_LAUNCH();
  });
  final_sum_kernel<<<1, kThreads, 0, stream>>>(partial, part.blocks, accumulate, out);
  CUDA_CHECK_LAUNCH();
}

template <bool Square> double reduce(const ExecContext& ctx, const Tensor& x, const char* what) {
  ORIGAMI_CHECK(x.defined(), what, " of an undefined tensor");
  check_data_dtype(what, x, "x");
  if (x.numel() == 0) return 0.0;
  Tensor result_dev = ctx.workspace(sizeof(double));
  reduce_into<Square>(ctx, x, static_cast<double*>(result_dev.address()), false);
  double result = 0.0;
  cudaStream_t stream = stream_of(ctx);
  CUDA_CHECK(cudaMemcpyAsync(&result, result_dev.address(), sizeof(double), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // the device-to-host point: the op returns the value
  return result;
}

// ---- cast

// bf16_bits (kernels/cuda/pack.cuh): the CPU's rounding, bit for bit.
__global__ void f32_to_bf16_kernel(const float* __restrict__ src, bf16* __restrict__ dst, int64_t n, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  auto* out = reinterpret_cast<uint16_t*>(dst);
  int64_t scalar_from = 0;
  if (packed) {
    const int64_t packs = n / kPack;
    for (int64_t p = i0; p < packs; p += stride) {
      float v[kPack];
      load_pack(src + p * kPack, v);
      uint32_t w[kPack / 2];
#pragma unroll
      for (int k = 0; k < kPack / 2; ++k) w[k] = bf16_bits(v[2 * k]) | (bf16_bits(v[2 * k + 1]) << 16);
      *reinterpret_cast<uint4*>(out + p * kPack) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) out[i] = static_cast<uint16_t>(bf16_bits(src[i]));
}

__global__ void bf16_to_f32_kernel(const bf16* __restrict__ src, float* __restrict__ dst, int64_t n, bool packed) {
  const int64_t i0 = thread_index(), stride = thread_stride();
  int64_t scalar_from = 0;
  if (packed) {
    const int64_t packs = n / kPack;
    for (int64_t p = i0; p < packs; p += stride) {
      float v[kPack];
      load_pack(src + p * kPack, v);
      store_pack(dst + p * kPack, v);
    }
    scalar_from = packs * kPack;
  }
  for (int64_t i = scalar_from + i0; i < n; i += stride) dst[i] = __bfloat162float(src[i]);
}

}  // namespace

void axpy(const ExecContext& ctx, float a, const Tensor& x, Tensor& y) {
  ORIGAMI_CHECK(x.defined() && y.defined(), "axpy on an undefined tensor");
  check_data_dtype("axpy", y, "y");
  check_same_dtype("axpy", y, "y", x, "x");
  ORIGAMI_CHECK(y.numel() == x.numel(), "axpy: ", shape_string(y.shape()), " vs ", shape_string(x.shape()));
  const int64_t n = y.numel();
  if (n == 0) return;
  with_data_type(y.dtype(), [&]<class T>() {
    const T* xs = dev<const T>(x, "x");
    T* ys = dev<T>(y, "y");
    const bool packed = aligned16(xs) && aligned16(ys);
    axpy_kernel<T><<<elementwise_grid(n, packed), kThreads, 0, stream_of(ctx)>>>(a, xs, ys, n, packed);
    CUDA_CHECK_LAUNCH();
  });
}

void scale_inplace(const ExecContext& ctx, Tensor& y, float a) {
  ORIGAMI_CHECK(y.defined(), "scale_inplace on an undefined tensor");
  check_data_dtype("scale_inplace", y, "y");
  const int64_t n = y.numel();
  if (n == 0) return;
  with_data_type(y.dtype(), [&]<class T>() {
    T* ys = dev<T>(y, "y");
    const bool packed = aligned16(ys);
    scale_kernel<T><<<elementwise_grid(n, packed), kThreads, 0, stream_of(ctx)>>>(ys, a, n, packed);
    CUDA_CHECK_LAUNCH();
  });
}

double sum_squares(const ExecContext& ctx, const Tensor& x) { return reduce<true>(ctx, x, "sum_squares"); }

void sum_squares_add(const ExecContext& ctx, const Tensor& x, Tensor& acc) {
  ORIGAMI_CHECK(x.defined(), "sum_squares_add of an undefined tensor");
  check_data_dtype("sum_squares_add", x, "x");
  if (x.numel() == 0) return;
  reduce_into<true>(ctx, x, dev<double>(acc, "acc"), true);
}

double sum(const ExecContext& ctx, const Tensor& x) { return reduce<false>(ctx, x, "sum"); }

void sum_add(const ExecContext& ctx, const Tensor& x, Tensor& acc) {
  ORIGAMI_CHECK(x.defined(), "sum_add of an undefined tensor");
  check_data_dtype("sum_add", x, "x");
  if (x.numel() == 0) return;
  reduce_into<false>(ctx, x, dev<double>(acc, "acc"), true);
}

void cast(const ExecContext& ctx, const Tensor& src, Tensor& dst) {
  ORIGAMI_CHECK(src.defined() && dst.defined(), "cast of an undefined tensor");
  ORIGAMI_CHECK(src.numel() == dst.numel(), "cast: ", shape_string(src.shape()), " into ", shape_string(dst.shape()));
  ORIGAMI_CHECK(is_float_data(src.dtype()) && is_float_data(dst.dtype()), "cast converts between f32 and bf16, not ",
                to_string(src.dtype()), " to ", to_string(dst.dtype()));
  const int64_t n = src.numel();
  if (n == 0) return;
  cudaStream_t stream = stream_of(ctx);
  if (src.dtype() == dst.dtype()) {
    CUDA_CHECK(cudaMemcpyAsync(dst.address(), src.address(), src.nbytes(), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (src.dtype() == DType::f32) {
    const float* s = dev<const float>(src, "src");
    bf16* d = dev<bf16>(dst, "dst");
    const bool packed = aligned16(s) && aligned16(d);
    f32_to_bf16_kernel<<<elementwise_grid(n, packed), kThreads, 0, stream>>>(s, d, n, packed);
  } else {
    const bf16* s = dev<const bf16>(src, "src");
    float* d = dev<float>(dst, "dst");
    const bool packed = aligned16(s) && aligned16(d);
    bf16_to_f32_kernel<<<elementwise_grid(n, packed), kThreads, 0, stream>>>(s, d, n, packed);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace origami::cuda
