// CUDA RMSNorm forward and backward (kernels/rmsnorm.h), T = f32 or bf16 for
// x, w, y, dy, dx; rstd f32; dw f32 or bf16 (it may differ from T: an fp32
// gradient buffer under bf16 activations). Arithmetic in f32, expression for
// expression the CPU twin's (with the FMAs GCC contracts it into), so only
// the order of the row sums differs.
//
// Row kernels: one 256-thread block per row (grid-stride over rows). Each
// thread sums its fixed groups of 8 columns in order (loaded as packs when
// D % 8 == 0 and every pointer is 16-byte aligned, else element by element:
// the same order either way), then cub::BlockReduce's fixed tree; the row
// sum is broadcast through shared memory.
//
// dw = Σ_t dy ⊙ x · r, deterministic without atomics: the rows are cut into
// fixed chunks (chunks_of(T): a function of T only); each chunk's
// per-column partial, summed over its rows in row order, goes to the
// workspace [chunks, D] f32; a last kernel adds the chunks in a fixed order
// into dw (read, add in f32, round once). The fused backward computes the
// partial in shared memory beside dx (one pass over dy and x, D <= 8192);
// the weight half reads dy and x per column. Both accumulate each column as
// acc = fmaf(dy·x, r, acc) from 0 over the same rows, so the split pair
// (input + weight) is bitwise the fused op, as kernels/rmsnorm.h promises.
#include <cub/block/block_reduce.cuh>

#include <initializer_list>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

constexpr int kRowThreads = 256;
constexpr int64_t kMaxChunks = 512;
constexpr int64_t kMinChunkRows = 16;
constexpr int64_t kFusedMaxD = 8192;  // the fused backward's shared partial: D floats <= 32 KiB

// Rows per dw chunk and the chunk count: at most kMaxChunks partials.
struct Chunks {
  int64_t rows = 0, count = 0;
};
Chunks chunks_of(int64_t T) {
  const int64_t rows = std::max(kMinChunkRows, (T + kMaxChunks - 1) / kMaxChunks);
  return {rows, (T + rows - 1) / rows};
}

size_t partial_bytes(int64_t T, int64_t D) {
  return static_cast<size_t>(chunks_of(T).count) * static_cast<size_t>(D) * sizeof(float);
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 30)); }

using RowReduce = cub::BlockReduce<float, kRowThreads>;
struct RowShared {
  typename RowReduce::TempStorage temp;
  float value;
};

// The block's sum of v, in every thread; the shared state is free again on return.
__device__ __forceinline__ float row_sum(float v, RowShared& sh) {
  const float total = RowReduce(sh.temp).Sum(v);
  if (threadIdx.x == 0) sh.value = total;
  __syncthreads();
  const float out = sh.value;
  __syncthreads();
  return out;
}

// Thread t owns the row's column groups [8g, 8g + 8) for g = t, t + 256, ...
// (kernels/cuda/pack.cuh): the same columns, in the same order, whether the
// row is loaded in packs or element by element.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    forward_kernel(const T* __restrict__ x, const T* __restrict__ w, float eps, T* __restrict__ y,
                   float* __restrict__ rstd, int64_t rows, int64_t D, bool packed) {
  __shared__ RowShared sh;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const T* xr = x + t * D;
    T* yr = y + t * D;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x * kPack; c < D; c += kRowThreads * kPack) {
      float v[kPack];
      const int count = load_upto(xr + c, D - c, packed, v);
#pragma unroll
      for (int k = 0; k < kPack; ++k)
        if (k < count) ss = fmaf(v[k], v[k], ss);
    }
    ss = row_sum(ss, sh);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
    if (threadIdx.x == 0) rstd[t] = r;
    for (int64_t c = threadIdx.x * kPack; c < D; c += kRowThreads * kPack) {
      float v[kPack], wv[kPack];
      const int count = load_upto(xr + c, D - c, packed, v);
      load_upto(w + c, D - c, packed, wv);
#pragma unroll
      for (int k = 0; k < kPack; ++k) v[k] = v[k] * r * wv[k];
      store_upto(yr + c, count, packed, v);
    }
  }
}

// One row of the backward: dx = r·w⊙dy − x·(r³/D · Σ w⊙dy⊙x), and with
// `partial` (shared, [D]) also partial += dy⊙x·r. Called by the whole block.
template <class T>
__device__ __forceinline__ void backward_row(const T* dyr, const T* xr, const T* w, float r, T* dxr, int64_t D,
                                             bool packed, RowShared& sh, float* partial) {
  float dot = 0.0f;
  for (int64_t c = threadIdx.x * kPack; c < D; c += kRowThreads * kPack) {
    float dy[kPack], xv[kPack], wv[kPack];
    const int count = load_upto(dyr + c, D - c, packed, dy);
    load_upto(xr + c, D - c, packed, xv);
    load_upto(w + c, D - c, packed, wv);
#pragma unroll
    for (int k = 0; k < kPack; ++k)
      if (k < count) dot = fmaf(wv[k] * dy[k], xv[k], dot);
  }
  dot = row_sum(dot, sh);
  const float coef = dot * r * r * r / static_cast<float>(D);
  for (int64_t c = threadIdx.x * kPack; c < D; c += kRowThreads * kPack) {
    float dy[kPack], xv[kPack], wv[kPack], dx[kPack];
    const int count = load_upto(dyr + c, D - c, packed, dy);
    load_upto(xr + c, D - c, packed, xv);
    load_upto(w + c, D - c, packed, wv);
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      dx[k] = fmaf(r * wv[k], dy[k], -(xv[k] * coef));
      if (partial != nullptr && k < count) partial[c + k] = fmaf(dy[k] * xv[k], r, partial[c + k]);
    }
    store_upto(dxr + c, count, packed, dx);
  }
}

template <class T>
__global__ void __launch_bounds__(kRowThreads)
    backward_input_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                          const float* __restrict__ rstd, T* __restrict__ dx, int64_t rows, int64_t D, bool packed) {
  __shared__ RowShared sh;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x)
    backward_row(dy + t * D, x + t * D, w, rstd[t], dx + t * D, D, packed, sh, nullptr);
}

// Block k: the rows of chunk k, dx per row and the chunk's dw partial in
// shared memory (dynamic, D floats), then written to partial_KD[k].
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    backward_fused_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                          const float* __restrict__ rstd, T* __restrict__ dx, int64_t rows, int64_t D,
                          int64_t chunk_rows, bool packed, float* __restrict__ partial_KD) {
  __shared__ RowShared sh;
  extern __shared__ float4 dynamic_smem[];
  float* partial = reinterpret_cast<float*>(dynamic_smem);
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) partial[c] = 0.0f;
  __syncthreads();
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * chunk_rows;
  const int64_t t1 = t0 + chunk_rows < rows ? t0 + chunk_rows : rows;
  for (int64_t t = t0; t < t1; ++t) backward_row(dy + t * D, x + t * D, w, rstd[t], dx + t * D, D, packed, sh, partial);
  __syncthreads();
  float* out = partial_KD + static_cast<int64_t>(blockIdx.x) * D;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) out[c] = partial[c];
}

// The weight half's partials: block (column tile, chunk k), one column per
// thread, rows of the chunk in order.
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    weight_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ rstd,
                          int64_t rows, int64_t D, int64_t chunk_rows, float* __restrict__ partial_KD) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (col >= D) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t t1 = t0 + chunk_rows < rows ? t0 + chunk_rows : rows;
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t t = t0; t < t1; ++t) acc = fmaf(to_f32(dy[t * D + col]) * to_f32(x[t * D + col]), rstd[t], acc);
  partial_KD[static_cast<int64_t>(blockIdx.y) * D + col] = acc;
}

// dw[c] += Σ_k partial_KD[k][c]: a 32-column tile per block, warp j sums the
// chunks k ≡ j (mod kFinishWarps) in order, then warp 0 adds the warps' sums
// in order. Fixed order: a function of the chunk count only.
constexpr int kFinishWarps = 16;

template <class TW>
__global__ void __launch_bounds__(32 * kFinishWarps)
    weight_finish_kernel(const float* __restrict__ partial_KD, int64_t chunks, int64_t D, TW* __restrict__ dw) {
  __shared__ float sums[kFinishWarps][33];
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  float s = 0.0f;
  if (col < D)
    for (int64_t k = warp; k < chunks; k += kFinishWarps) s += partial_KD[k * D + col];
  sums[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || col >= D) return;
  float total = 0.0f;
#pragma unroll
  for (int j = 0; j < kFinishWarps; ++j) total += sums[j][lane];
  dw[col] = from_f32<TW>(to_f32(dw[col]) + total);
}

void launch_weight_finish(const float* partial_KD, int64_t chunks, int64_t D, Tensor& dw_D, cudaStream_t stream) {
  ORIGAMI_CHECK(is_float_data(dw_D.dtype()), "rmsnorm dw is ", to_string(dw_D.dtype()), "; expected f32 or bf16");
  with_data_type(dw_D.dtype(), [&]<class TW>() {
    const dim3 block(32, kFinishWarps);
    const unsigned grid = static_cast<unsigned>((D + 31) / 32);
    weight_finish_kernel<TW><<<grid, block, 0, stream>>>(partial_KD, chunks, D, dev<TW>(dw_D, "dw_D"));
    CUDA_CHECK_LAUNCH();
  });
}

// Data dtypes, CUDA's rule (op_shapes checks the shapes): x f32 or bf16,
// the other data tensors x's dtype (dw may be the fp32 master gradient).
void check_data(const char* op, const Tensor& x_TD, std::initializer_list<std::pair<const Tensor*, const char*>> same) {
  check_data_dtype(op, x_TD, "x_TD");
  for (auto [t, name] : same) check_same_dtype(op, *t, name, x_TD, "x_TD");
}

void check_workspace(const char* op, const Tensor& workspace, int64_t T, int64_t D) {
  ORIGAMI_CHECK(workspace.defined(), op, " without a workspace");
  const size_t need = partial_bytes(T, D);
  ORIGAMI_CHECK(workspace.nbytes() >= need, "rmsnorm workspace has ", workspace.nbytes(), " bytes, needs ", need,
                " (", op, "_workspace_bytes)");
}

bool packed_rows(int64_t D, std::initializer_list<const void*> ptrs) {
  if (D % kPack != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD,
                     Tensor& rstd_T) {
  const RmsnormDims dims = rmsnorm_forward_shapes(x_TD, w_D, y_TD, rstd_T);
  const int64_t T = dims.T, D = dims.D;
  check_data("rmsnorm_forward", x_TD, {{&w_D, "w_D"}, {&y_TD, "y_TD"}});
  if (T == 0) return;
  with_data_type(x_TD.dtype(), [&]<class T_>() {
    const T_* x = dev<const T_>(x_TD, "x_TD");
    const T_* w = dev<const T_>(w_D, "w_D");
    T_* y = dev<T_>(y_TD, "y_TD");
    forward_kernel<T_><<<row_grid(T), kRowThreads, 0, stream_of(ctx)>>>(
        x, w, eps, y, dev<float>(rstd_T, "rstd_T"), T, D, packed_rows(D, {x, w, y}));
    CUDA_CHECK_LAUNCH();
  });
}

size_t rmsnorm_backward_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) { return partial_bytes(T, D); }

void rmsnorm_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                      const Tensor& rstd_T, Tensor& dx_TD, Tensor& dw_D, Tensor& workspace) {
  const RmsnormDims dims = rmsnorm_backward_shapes("rmsnorm_backward", dy_TD, x_TD, rstd_T,
                                                   {.w_D = &w_D, .dx_TD = &dx_TD, .dw_D = &dw_D});
  const int64_t T = dims.T, D = dims.D;
  check_data("rmsnorm_backward", x_TD, {{&dy_TD, "dy_TD"}, {&w_D, "w_D"}, {&dx_TD, "dx_TD"}});
  check_workspace("rmsnorm_backward", workspace, T, D);
  if (T == 0 || D == 0) return;  // nothing to write: dx is empty, dw gains 0
  const Chunks chunks = chunks_of(T);
  auto* partial = static_cast<float*>(workspace.address());
  cudaStream_t stream = stream_of(ctx);
  with_data_type(x_TD.dtype(), [&]<class T_>() {
    const T_* dy = dev<const T_>(dy_TD, "dy_TD");
    const T_* x = dev<const T_>(x_TD, "x_TD");
    const T_* w = dev<const T_>(w_D, "w_D");
    const float* rstd = dev<const float>(rstd_T, "rstd_T");
    T_* dx = dev<T_>(dx_TD, "dx_TD");
    const bool packed = packed_rows(D, {dy, x, w, dx});
    if (D <= kFusedMaxD) {
      const size_t smem = static_cast<size_t>(D) * sizeof(float);
      backward_fused_kernel<T_><<<static_cast<unsigned>(chunks.count), kRowThreads, smem, stream>>>(
          dy, x, w, rstd, dx, T, D, chunks.rows, packed, partial);
      CUDA_CHECK_LAUNCH();
    } else {  // the split pair: the same dx and partials, two passes over dy and x
      backward_input_kernel<T_><<<row_grid(T), kRowThreads, 0, stream>>>(dy, x, w, rstd, dx, T, D, packed);
      CUDA_CHECK_LAUNCH();
      const dim3 grid(static_cast<unsigned>((D + kRowThreads - 1) / kRowThreads), static_cast<unsigned>(chunks.count));
      weight_partial_kernel<T_><<<grid, kRowThreads, 0, stream>>>(dy, x, rstd, T, D, chunks.rows, partial);
      CUDA_CHECK_LAUNCH();
    }
  });
  launch_weight_finish(partial, chunks.count, D, dw_D, stream);
}

void rmsnorm_backward_input(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                            const Tensor& rstd_T, Tensor& dx_TD) {
  const RmsnormDims dims =
      rmsnorm_backward_shapes("rmsnorm_backward_input", dy_TD, x_TD, rstd_T, {.w_D = &w_D, .dx_TD = &dx_TD});
  const int64_t T = dims.T, D = dims.D;
  check_data("rmsnorm_backward_input", x_TD, {{&dy_TD, "dy_TD"}, {&w_D, "w_D"}, {&dx_TD, "dx_TD"}});
  if (T == 0 || D == 0) return;
  with_data_type(x_TD.dtype(), [&]<class T_>() {
    const T_* dy = dev<const T_>(dy_TD, "dy_TD");
    const T_* x = dev<const T_>(x_TD, "x_TD");
    const T_* w = dev<const T_>(w_D, "w_D");
    T_* dx = dev<T_>(dx_TD, "dx_TD");
    backward_input_kernel<T_><<<row_grid(T), kRowThreads, 0, stream_of(ctx)>>>(
        dy, x, w, dev<const float>(rstd_T, "rstd_T"), dx, T, D, packed_rows(D, {dy, x, w, dx}));
    CUDA_CHECK_LAUNCH();
  });
}

size_t rmsnorm_backward_weight_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  return partial_bytes(T, D);  // rmsnorm_backward's partials
}

void rmsnorm_backward_weight(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                             Tensor& dw_D, Tensor& workspace) {
  const RmsnormDims dims =
      rmsnorm_backward_shapes("rmsnorm_backward_weight", dy_TD, x_TD, rstd_T, {.dw_D = &dw_D});
  const int64_t T = dims.T, D = dims.D;
  check_data("rmsnorm_backward_weight", x_TD, {{&dy_TD, "dy_TD"}});
  check_workspace("rmsnorm_backward_weight", workspace, T, D);
  if (T == 0 || D == 0) return;
  const Chunks chunks = chunks_of(T);
  auto* partial = static_cast<float*>(workspace.address());
  cudaStream_t stream = stream_of(ctx);
  with_data_type(x_TD.dtype(), [&]<class T_>() {
    const dim3 grid(static_cast<unsigned>((D + kRowThreads - 1) / kRowThreads), static_cast<unsigned>(chunks.count));
    weight_partial_kernel<T_><<<grid, kRowThreads, 0, stream>>>(dev<const T_>(dy_TD, "dy_TD"),
                                                                 dev<const T_>(x_TD, "x_TD"),
                                                                 dev<const float>(rstd_T, "rstd_T"), T, D,
                                                                 chunks.rows, partial);
    CUDA_CHECK_LAUNCH();
  });
  launch_weight_finish(partial, chunks.count, D, dw_D, stream);
}

}  // namespace origami::cuda
