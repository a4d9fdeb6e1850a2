// CUDA token cross-entropy (kernels/cross_entropy.h): the whole-row forward
// and backward and the vocab-parallel pieces, logits f32 or bf16, every
// statistic f32 (sums f64), arithmetic in fp32 (fp64 where the CPU twin
// kernels/cpu/cross_entropy.cpp sums in fp64).
//
// One block of 512 threads per token row (grid-stride over rows): V runs to
// ~256k, so each thread strides over the row with 16-byte loads (two in
// flight), after a scalar head up to the first 16-byte boundary and before
// a scalar tail, since a row of odd V starts anywhere.
//
// Forward reads the row once: each thread keeps an online (max, Σ exp(x −
// max)) pair, rescaled when its max grows; the pairs meet in a
// cub::BlockReduce (a fixed tree over thread indices), so the result is a
// function of the shape only and bitwise reproducible. The CPU takes the
// max first and then sums in its simd lanes' order: the two agree to
// rounding, not bitwise. exp is expf (full precision, <= 2 ulp) throughout;
// the CPU's whole-row ops use its exp_fast (~2e-7), its vocab-parallel ops
// std::exp. local_sums adds expf of the fp32 difference in fp64 (the CPU
// takes the fp64 exp of the same fp32 difference), so each term differs by
// a few float ulps at most and the sums by their order.
//
// Backward maps each element through the thread that reads it, so
// dlogits may alias logits (in place): every element is read, then written,
// by one thread, and no element is read after another's write.
//
// A target outside its range is a checked internal error on the CPU. Here
// the check runs on the device (no host sync on the loss path): the block
// prints the CPU's message and traps, and the next CUDA call of the job
// fails at its CUDA_CHECK.
#include <cub/block/block_reduce.cuh>

#include <cfloat>
#include <cmath>
#include <limits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

constexpr int kThreads = 512;

template <class T> constexpr int kPack = 16 / static_cast<int>(sizeof(T));
template <class T> struct alignas(16) Pack16 { T v[kPack<T>]; };

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20)); }

// Elements before x's first 16-byte boundary, at most n.
template <class T> __device__ __forceinline__ int64_t head_of(const T* x, int64_t n) {
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x) % 16) / static_cast<int64_t>(sizeof(T));
  return mis == 0 ? 0 : std::min<int64_t>(n, kPack<T> - mis);
}

// Calls f(i, x[i] as float) for every i in [0, n), each thread its strided share.
template <class T, class F> __device__ __forceinline__ void for_each_col(const T* x, int64_t n, F&& f) {
  constexpr int W = kPack<T>;
  const int64_t head = head_of(x, n);
  for (int64_t i = threadIdx.x; i < head; i += kThreads) f(i, to_f32(x[i]));
  const int64_t n_vec = (n - head) / W;
  const auto* v = reinterpret_cast<const Pack16<T>*>(x + head);
  int64_t j = threadIdx.x;
  for (; j + kThreads < n_vec; j += 2 * kThreads) {
    const Pack16<T> a = v[j], b = v[j + kThreads];
#pragma unroll
    for (int k = 0; k < W; ++k) f(head + j * W + k, to_f32(a.v[k]));
#pragma unroll
    for (int k = 0; k < W; ++k) f(head + (j + kThreads) * W + k, to_f32(b.v[k]));
  }
  if (j < n_vec) {
    const Pack16<T> a = v[j];
#pragma unroll
    for (int k = 0; k < W; ++k) f(head + j * W + k, to_f32(a.v[k]));
  }
  for (int64_t i = head + n_vec * W + threadIdx.x; i < n; i += kThreads) f(i, to_f32(x[i]));
}

// y[i] = g(i, x[i] as float) for every i in [0, n); x and y may be the same
// row. Packed when both rows sit equally far from a 16-byte boundary.
template <class T, class G> __device__ __forceinline__ void map_cols(const T* x, T* y, int64_t n, G&& g) {
  constexpr int W = kPack<T>;
  if ((reinterpret_cast<uintptr_t>(x) - reinterpret_cast<uintptr_t>(y)) % 16 != 0) {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) y[i] = from_f32<T>(g(i, to_f32(x[i])));
    return;
  }
  const int64_t head = head_of(x, n);
  for (int64_t i = threadIdx.x; i < head; i += kThreads) y[i] = from_f32<T>(g(i, to_f32(x[i])));
  const int64_t n_vec = (n - head) / W;
  const auto* xv = reinterpret_cast<const Pack16<T>*>(x + head);
  auto* yv = reinterpret_cast<Pack16<T>*>(y + head);
  int64_t j = threadIdx.x;
  for (; j + kThreads < n_vec; j += 2 * kThreads) {
    Pack16<T> a = xv[j], b = xv[j + kThreads];
#pragma unroll
    for (int k = 0; k < W; ++k) a.v[k] = from_f32<T>(g(head + j * W + k, to_f32(a.v[k])));
#pragma unroll
    for (int k = 0; k < W; ++k) b.v[k] = from_f32<T>(g(head + (j + kThreads) * W + k, to_f32(b.v[k])));
    yv[j] = a;
    yv[j + kThreads] = b;
  }
  if (j < n_vec) {
    Pack16<T> a = xv[j];
#pragma unroll
    for (int k = 0; k < W; ++k) a.v[k] = from_f32<T>(g(head + j * W + k, to_f32(a.v[k])));
    yv[j] = a;
  }
  for (int64_t i = head + n_vec * W + threadIdx.x; i < n; i += kThreads) y[i] = from_f32<T>(g(i, to_f32(x[i])));
}

// The CPU's check of a target, on the device: report and stop the job.
__device__ __forceinline__ void check_target(int32_t y, int64_t limit, int64_t token) {
  if (y < 0 || y >= limit) {
    printf("cross-entropy target %d of token %lld is outside [0, %lld)\n", y, static_cast<long long>(token),
           static_cast<long long>(limit));
    __trap();
  }
}

// A running max m and Σ exp(x − m) of the elements seen. m starts at
// −FLT_MAX, not −inf, so that −inf logits add exp(−inf) = 0 instead of NaN.
struct MaxSum {
  float m, s;
  __device__ __forceinline__ void add(float x) {
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
};
struct CombineMaxSum {
  __device__ __forceinline__ MaxSum operator()(const MaxSum& a, const MaxSum& b) const {
    const float m = fmaxf(a.m, b.m);
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
  }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ double operator()(double a, double b) const { return a + b; }
};

// ---------------------------------------------------------------- kernels

template <class T> __global__ void __launch_bounds__(kThreads)
    forward_rows(const T* __restrict__ logits, const int32_t* __restrict__ targets, int64_t T_, int64_t V,
                 float* __restrict__ loss, float* __restrict__ lse) {
  using Reduce = cub::BlockReduce<MaxSum, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const T* x = logits + t * V;
    MaxSum ms{-FLT_MAX, 0.0f};
    for_each_col(x, V, [&](int64_t, float v) { ms.add(v); });
    ms = Reduce(tmp).Reduce(ms, CombineMaxSum{});
    if (threadIdx.x == 0) {
      const int32_t y = targets[t];
      check_target(y, V, t);
      const float l = ms.m + logf(ms.s);
      lse[t] = l;
      loss[t] = l - to_f32(x[y]);
    }
    __syncthreads();  // tmp is reused by the next row
  }
}

template <class T> __global__ void __launch_bounds__(kThreads)
    backward_rows(const T* logits, const int32_t* __restrict__ targets, const float* __restrict__ lse, int64_t T_,
                  int64_t V, float grad_scale, T* dlogits) {
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const int64_t y = targets[t];
    if (threadIdx.x == 0) check_target(static_cast<int32_t>(y), V, t);
    const float l = lse[t];
    map_cols(logits + t * V, dlogits + t * V, V,
             [&](int64_t i, float v) { return (expf(v - l) - (i == y ? 1.0f : 0.0f)) * grad_scale; });
  }
}

template <class T> __global__ void __launch_bounds__(kThreads)
    local_max_rows(const T* __restrict__ logits, int64_t T_, int64_t Vr, float* __restrict__ max_out) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    float m = -std::numeric_limits<float>::infinity();
    for_each_col(logits + t * Vr, Vr, [&](int64_t, float v) { m = fmaxf(m, v); });
    m = Reduce(tmp).Reduce(m, MaxOp{});
    if (threadIdx.x == 0) max_out[t] = m;
    __syncthreads();
  }
}

template <class T> __global__ void __launch_bounds__(kThreads)
    local_sums_rows(const T* __restrict__ logits, const int32_t* __restrict__ targets, const float* __restrict__ mx,
                    int64_t T_, int64_t Vr, int64_t vocab_start, int64_t vocab, double* __restrict__ sums) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const T* x = logits + t * Vr;
    const float m = mx[t];
    double se = 0.0;
    for_each_col(x, Vr, [&](int64_t, float v) { se += static_cast<double>(expf(v - m)); });
    se = Reduce(tmp).Reduce(se, SumOp{});
    if (threadIdx.x == 0) {
      const int32_t y = targets[t];
      check_target(y, vocab, t);
      sums[t] = se;
      const int64_t local = y - vocab_start;
      sums[T_ + t] = local >= 0 && local < Vr ? static_cast<double>(to_f32(x[local])) : 0.0;
    }
    __syncthreads();
  }
}

__global__ void finish_tokens(const float* __restrict__ mx, const double* __restrict__ sums, int64_t T_,
                              float* __restrict__ loss, float* __restrict__ lse) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < T_;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double l = static_cast<double>(mx[t]) + log(sums[t]);
    lse[t] = static_cast<float>(l);
    loss[t] = static_cast<float>(l - sums[T_ + t]);
  }
}

template <class T> __global__ void __launch_bounds__(kThreads)
    local_backward_rows(const T* logits, const int32_t* __restrict__ targets, const float* __restrict__ lse, int64_t T_,
                        int64_t Vr, int64_t vocab_start, float grad_scale, T* dlogits) {
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const int64_t local = targets[t] - vocab_start;  // off this shard when outside [0, Vr): no column matches
    const float l = lse[t];
    // The CPU writes exp(·)·scale, then subtracts scale at the target: the same two roundings.
    map_cols(logits + t * Vr, dlogits + t * Vr, Vr, [&](int64_t i, float v) {
      const float p = expf(v - l) * grad_scale;
      return i == local ? p - grad_scale : p;
    });
  }
}

// ---------------------------------------------------------------- checks

// Data dtypes, CUDA's rule (op_shapes checks the shapes): logits f32 or
// bf16, dlogits the same.
void check_logits_dtype(const char* op, const Tensor& logits_TV, const Tensor* dlogits_TV = nullptr) {
  check_data_dtype(op, logits_TV, "logits");
  if (dlogits_TV) check_same_dtype(op, logits_TV, "logits", *dlogits_TV, "dlogits");
}

}  // namespace

void cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T,
                           Tensor& lse_T) {
  const CrossEntropyDims dims = cross_entropy_forward_shapes(logits_TV, targets_T, loss_T, lse_T);
  const int64_t T = dims.T, V = dims.V;
  check_logits_dtype("cross_entropy_forward", logits_TV);
  if (T == 0) return;
  with_data_type(logits_TV.dtype(), [&]<class T_>() {
    forward_rows<T_><<<row_blocks(T), kThreads, 0, stream_of(ctx)>>>(
        dev<const T_>(logits_TV, "logits"), dev<const int32_t>(targets_T, "targets"), T, V, dev<float>(loss_T, "loss"),
        dev<float>(lse_T, "lse"));
    CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                            const Tensor& lse_T, float grad_scale, Tensor& dlogits_TV) {
  const CrossEntropyDims dims = cross_entropy_backward_shapes(logits_TV, targets_T, lse_T, dlogits_TV);
  const int64_t T = dims.T, V = dims.V;
  check_logits_dtype("cross_entropy_backward", logits_TV, &dlogits_TV);
  if (T == 0) return;
  with_data_type(logits_TV.dtype(), [&]<class T_>() {
    // Not restrict: dlogits may alias logits.
    backward_rows<T_><<<row_blocks(T), kThreads, 0, stream_of(ctx)>>>(
        static_cast<const T_*>(logits_TV.address()), dev<const int32_t>(targets_T, "targets"),
        dev<const float>(lse_T, "lse"), T, V, grad_scale, dev<T_>(dlogits_TV, "dlogits"));
    CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_local_max(const ExecContext& ctx, const Tensor& logits_TV, Tensor& max_T) {
  const CrossEntropyDims dims = cross_entropy_local_max_shapes(logits_TV, max_T);
  const int64_t T = dims.T, Vr = dims.V;
  check_logits_dtype("cross_entropy_local_max", logits_TV);
  if (T == 0) return;
  with_data_type(logits_TV.dtype(), [&]<class T_>() {
    local_max_rows<T_><<<row_blocks(T), kThreads, 0, stream_of(ctx)>>>(dev<const T_>(logits_TV, "logits"), T, Vr,
                                                                       dev<float>(max_T, "max_T"));
    CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_local_sums(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                              const Tensor& max_T, int64_t vocab_start, int64_t vocab, Tensor& sums_2T) {
  const CrossEntropyDims dims = cross_entropy_local_sums_shapes(logits_TV, targets_T, max_T, sums_2T);
  const int64_t T = dims.T, Vr = dims.V;
  check_logits_dtype("cross_entropy_local_sums", logits_TV);
  if (T == 0) return;
  with_data_type(logits_TV.dtype(), [&]<class T_>() {
    local_sums_rows<T_><<<row_blocks(T), kThreads, 0, stream_of(ctx)>>>(
        dev<const T_>(logits_TV, "logits"), dev<const int32_t>(targets_T, "targets"), dev<const float>(max_T, "max_T"),
        T, Vr, vocab_start, vocab, dev<double>(sums_2T, "sums_2T"));
    CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_finish(const ExecContext& ctx, const Tensor& max_T, const Tensor& sums_2T, Tensor& loss_T,
                          Tensor& lse_T) {
  const int64_t T = cross_entropy_finish_shapes(max_T, sums_2T, loss_T, lse_T);
  if (T == 0) return;
  finish_tokens<<<grid_for(T, 256), 256, 0, stream_of(ctx)>>>(dev<const float>(max_T, "max_T"),
                                                              dev<const double>(sums_2T, "sums_2T"), T,
                                                              dev<float>(loss_T, "loss_T"), dev<float>(lse_T, "lse_T"));
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_local_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                                  const Tensor& lse_T, int64_t vocab_start, float grad_scale, Tensor& dlogits_TV) {
  const CrossEntropyDims dims = cross_entropy_local_backward_shapes(logits_TV, targets_T, lse_T, dlogits_TV);
  const int64_t T = dims.T, Vr = dims.V;
  check_logits_dtype("cross_entropy_local_backward", logits_TV, &dlogits_TV);
  if (T == 0 || Vr == 0) return;
  with_data_type(logits_TV.dtype(), [&]<class T_>() {
    // Not restrict: dlogits may alias logits.
    local_backward_rows<T_><<<row_blocks(T), kThreads, 0, stream_of(ctx)>>>(
        static_cast<const T_*>(logits_TV.address()), dev<const int32_t>(targets_T, "targets"),
        dev<const float>(lse_T, "lse"), T, Vr, vocab_start, grad_scale, dev<T_>(dlogits_TV, "dlogits"));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace origami::cuda
