// CUDA MoE row gathers and scatters (kernels/moe_ops.h; CPU twin
// kernels/cpu/moe_ops.cpp): moe_permute_rows, moe_permute_rows_backward,
// moe_unpermute_rows, moe_unpermute_rows_backward. Activations are f32 or
// bf16, one dtype per call (router weights f32); arithmetic in f32 with one
// rounding per stored element.
//
// Bandwidth-bound row moves: one warp per row — permuted row n (permute),
// token t (permute backward, unpermute), slot (t, j) (unpermute backward) —
// grid-stride over rows, lanes over 16-byte packs when D and every base
// allow (pack.cuh), else single elements. A token's slots are read in groups
// of four so four row gathers are in flight per pack.
// Order: permute backward and unpermute add a token's kept slots in slot
// order, starting from dx_TD[t] and from 0 — the CPU's order, so f32 results
// are the CPU's bit for bit (up to the multiply-adds each compiler fuses).
// The weight gradient's dot product is per-lane partials over packs, then a
// warp butterfly: fixed, but not the CPU's order. Padding rows (token −1) get
// zeros in both directions, as on the CPU. Dropped slots (row −1) are
// skipped; a row index past the permuted buffer is a device check.
#include "kernels/cuda/moe_common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace origami::cuda {

namespace {

constexpr int kWarps = 8;  // rows in flight per block
constexpr int kThreads = kWarps * 32;
constexpr int kGroup = 4;  // slots gathered together

// N elements of T moved as one aligned access: a bitwise copy (no widening).
template <class T, int N> struct alignas(sizeof(T) * N) Raw { T v[N]; };

// N = kPack (16-byte packs, pack.cuh) or 1, widened to float.
template <class T, int N> __device__ __forceinline__ void load_row(const T* p, float (&v)[N]) {
  if constexpr (N == kPack)
    load_pack(p, v);
  else
    v[0] = to_f32(p[0]);
}
template <class T, int N> __device__ __forceinline__ void store_row(T* p, const float (&v)[N]) {
  if constexpr (N == kPack)
    store_pack(p, v);
  else
    p[0] = from_f32<T>(v[0]);
}

// ---------------------------------------------------------------- permute

template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    permute_kernel(const T* __restrict__ x, const int32_t* __restrict__ tok, int64_t n_tokens, int64_t n_rows,
                   int64_t D, T* __restrict__ out) {
  using P = Raw<T, N>;
  const int lane = threadIdx.x % 32;
  const int64_t packs = D / N;
  P zero;
#pragma unroll
  for (int k = 0; k < N; ++k) zero.v[k] = from_f32<T>(0.0f);
  for (int64_t n = moe::warp_index(); n < n_rows; n += moe::warp_stride()) {
    const int32_t t = tok[n];
    ORIGAMI_DEVICE_CHECK(t < n_tokens, "moe_permute_rows: a permuted row names a token past T");
    P* dst = reinterpret_cast<P*>(out + n * D);
    if (t >= 0) {
      const P* src = reinterpret_cast<const P*>(x + static_cast<int64_t>(t) * D);
#pragma unroll 4
      for (int64_t c = lane; c < packs; c += 32) dst[c] = src[c];
    } else {
#pragma unroll 4
      for (int64_t c = lane; c < packs; c += 32) dst[c] = zero;
    }
  }
}

// ---------------------------------------------------------------- token sums

// acc += Σ_j scale_j · src[row_j] over the token's kept slots, in slot order;
// scale_j = weight[j] (unpermute) or 1 (permute backward: weight null).
template <class T, int N>
__device__ __forceinline__ void add_slots(float (&acc)[N], const T* __restrict__ src, const int32_t* __restrict__ rows,
                                          const float* __restrict__ weight, int K, int64_t n_rows, int64_t D,
                                          int64_t col) {
  int j = 0;
  for (; j + kGroup <= K; j += kGroup) {
    int32_t r[kGroup];
    float y[kGroup][N];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) r[u] = rows[j + u];
#pragma unroll
    for (int u = 0; u < kGroup; ++u)
      if (r[u] >= 0) {
        ORIGAMI_DEVICE_CHECK(r[u] < n_rows, "moe permutation: a slot's row is outside the permuted rows");
        load_row<T, N>(src + static_cast<int64_t>(r[u]) * D + col, y[u]);
      }
#pragma unroll
    for (int u = 0; u < kGroup; ++u)
      if (r[u] >= 0) {
        const float p = weight ? weight[j + u] : 1.0f;  // 1·y is exact: a plain sum
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += p * y[u][k];
      }
  }
  for (; j < K; ++j) {
    const int32_t r = rows[j];
    if (r < 0) continue;
    ORIGAMI_DEVICE_CHECK(r < n_rows, "moe permutation: a slot's row is outside the permuted rows");
    float y[N];
    load_row<T, N>(src + static_cast<int64_t>(r) * D + col, y);
    const float p = weight ? weight[j] : 1.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] += p * y[k];
  }
}

// dst[t] = (accumulate ? dst[t] : 0) + Σ_j weight_j · src[row_of[t, j]]:
// permute backward (accumulate, no weights) and unpermute.
template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    token_sum_kernel(const T* __restrict__ src, const int32_t* __restrict__ row_of, const float* __restrict__ weight,
                     int64_t n_tokens, int K, int64_t n_rows, int64_t D, bool accumulate, T* __restrict__ dst) {
  const int lane = threadIdx.x % 32;
  const int64_t packs = D / N;
  for (int64_t t = moe::warp_index(); t < n_tokens; t += moe::warp_stride()) {
    const int32_t* rows = row_of + t * K;
    const float* w = weight ? weight + t * K : nullptr;
    T* d = dst + t * D;
    for (int64_t c = lane; c < packs; c += 32) {
      float acc[N];
      if (accumulate)
        load_row<T, N>(d + c * N, acc);
      else
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = 0.0f;
      add_slots<T, N>(acc, src, rows, w, K, n_rows, D, c * N);
      store_row<T, N>(d + c * N, acc);
    }
  }
}

// ---------------------------------------------------------------- unpermute backward

// Warps [0, T·K): slot w = (t, j) with row r: dy[r] = weight·dout[t] and
// dweight[w] = <dout[t], y[r]> (0 for a dropped slot). Warps [T·K, T·K + N):
// permuted row n, zeroed when it is padding (no slot writes it).
template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    unpermute_backward_kernel(const T* __restrict__ dout, const T* __restrict__ y, const int32_t* __restrict__ row_of,
                              const int32_t* __restrict__ tok, const float* __restrict__ weight, int64_t n_slots, int K,
                              int64_t n_rows, int64_t D, T* __restrict__ dy, float* __restrict__ dweight) {
  const int lane = threadIdx.x % 32;
  const int64_t packs = D / N;
  for (int64_t w = moe::warp_index(); w < n_slots + n_rows; w += moe::warp_stride()) {
    if (w >= n_slots) {  // uniform over the warp, like every branch below
      const int64_t n = w - n_slots;
      if (tok[n] >= 0) continue;
      float zero[N];
#pragma unroll
      for (int k = 0; k < N; ++k) zero[k] = 0.0f;
      for (int64_t c = lane; c < packs; c += 32) store_row<T, N>(dy + n * D + c * N, zero);
      continue;
    }
    const int32_t r = row_of[w];
    if (r < 0) {
      if (lane == 0) dweight[w] = 0.0f;
      continue;
    }
    ORIGAMI_DEVICE_CHECK(r < n_rows, "moe_unpermute_rows_backward: a slot's row is outside the permuted rows");
    const float p = weight[w];
    const T* g = dout + (w / K) * D;
    const T* yr = y + static_cast<int64_t>(r) * D;
    T* d = dy + static_cast<int64_t>(r) * D;
    float acc = 0.0f;
#pragma unroll 2
    for (int64_t c = lane; c < packs; c += 32) {
      float gv[N], yv[N], dv[N];
      load_row<T, N>(g + c * N, gv);
      load_row<T, N>(yr + c * N, yv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        acc += gv[k] * yv[k];
        dv[k] = p * gv[k];
      }
      store_row<T, N>(d + c * N, dv);
    }
    acc = moe::warp_sum(acc);
    if (lane == 0) dweight[w] = acc;
  }
}

// ---------------------------------------------------------------- host side

unsigned warp_blocks(int64_t rows) { return grid_for(rows, kWarps); }

bool packable(int64_t D, std::initializer_list<const void*> bases) {
  if (D % kPack != 0) return false;
  for (const void* b : bases)
    if (!aligned16(b)) return false;
  return true;
}

// One data tensor of the call: defined, f32 or bf16, the call's dtype, this shape.
void check_data(const char* op, const Tensor& t, const char* name, const Tensor& first, const Shape& shape) {
  ORIGAMI_CHECK(t.defined(), op, ": ", name, " is undefined");
  check_data_dtype(op, t, name);
  check_same_dtype(op, first, "the first data tensor", t, name);
  check_shape(t, shape, name);
}

template <class T, int N>
void launch_token_sum(cudaStream_t stream, const T* src, const int32_t* row_of, const float* weight, int64_t T_,
                      int64_t K, int64_t n_rows, int64_t D, bool accumulate, T* dst) {
  token_sum_kernel<T, N><<<warp_blocks(T_), kThreads, 0, stream>>>(src, row_of, weight, T_, static_cast<int>(K), n_rows,
                                                                   D, accumulate, dst);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Tensor& row_token_N, Tensor& x_ND) {
  constexpr const char* op = "moe_permute_rows";
  ORIGAMI_CHECK(x_TD.defined(), op, ": x_TD is undefined");
  const int64_t T = x_TD.rows(), D = x_TD.cols(), N = row_token_N.numel();
  check_data(op, x_TD, "x_TD", x_TD, x_TD.shape());
  check_i32(row_token_N, {N}, "row_token_N");
  check_data(op, x_ND, "permuted x_ND", x_TD, {N, D});
  if (N == 0 || D == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  with_data_type(x_TD.dtype(), [&]<class E>() {
    const E* x = dev<const E>(x_TD, "x_TD");
    E* out = dev<E>(x_ND, "x_ND");
    const int32_t* tok = dev<const int32_t>(row_token_N, "row_token_N");
    constexpr int V = 16 / static_cast<int>(sizeof(E));
    if (D % V == 0 && aligned16(x) && aligned16(out))
      permute_kernel<E, V><<<warp_blocks(N), kThreads, 0, stream>>>(x, tok, T, N, D, out);
    else
      permute_kernel<E, 1><<<warp_blocks(N), kThreads, 0, stream>>>(x, tok, T, N, D, out);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Tensor& row_of_TK, Tensor& dx_TD) {
  constexpr const char* op = "moe_permute_rows_backward";
  ORIGAMI_CHECK(dx_ND.defined(), op, ": dx_ND is undefined");
  const int64_t N = dx_ND.rows(), D = dx_ND.cols(), T = row_of_TK.rows(), K = row_of_TK.cols();
  check_data(op, dx_ND, "permute gradient dx_ND", dx_ND, dx_ND.shape());
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_data(op, dx_TD, "permute dx_TD", dx_ND, {T, D});
  ORIGAMI_CHECK(K <= INT32_MAX, op, ": ", K, " slots per token");
  if (T == 0 || D == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  with_data_type(dx_ND.dtype(), [&]<class E>() {
    const E* src = dev<const E>(dx_ND, "dx_ND");
    E* dst = dev<E>(dx_TD, "dx_TD");
    const int32_t* row_of = dev<const int32_t>(row_of_TK, "row_of_TK");
    if (packable(D, {src, dst}))
      launch_token_sum<E, kPack>(stream, src, row_of, nullptr, T, K, N, D, true, dst);
    else
      launch_token_sum<E, 1>(stream, src, row_of, nullptr, T, K, N, D, true, dst);
  });
}

void moe_unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Tensor& row_of_TK, const Tensor& weight_TK,
                        Tensor& out_TD) {
  constexpr const char* op = "moe_unpermute_rows";
  ORIGAMI_CHECK(y_ND.defined(), op, ": y_ND is undefined");
  const int64_t N = y_ND.rows(), D = y_ND.cols(), T = row_of_TK.rows(), K = row_of_TK.cols();
  check_data(op, y_ND, "unpermute input y_ND", y_ND, y_ND.shape());
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_f32(weight_TK, {T, K}, "unpermute weight_TK");
  check_data(op, out_TD, "unpermute out_TD", y_ND, {T, D});
  ORIGAMI_CHECK(K <= INT32_MAX, op, ": ", K, " slots per token");
  if (T == 0 || D == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  with_data_type(y_ND.dtype(), [&]<class E>() {
    const E* y = dev<const E>(y_ND, "y_ND");
    E* out = dev<E>(out_TD, "out_TD");
    const int32_t* row_of = dev<const int32_t>(row_of_TK, "row_of_TK");
    const float* w = dev<const float>(weight_TK, "weight_TK");
    if (packable(D, {y, out}))
      launch_token_sum<E, kPack>(stream, y, row_of, w, T, K, N, D, false, out);
    else
      launch_token_sum<E, 1>(stream, y, row_of, w, T, K, N, D, false, out);
  });
}

void moe_unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND,
                                 const Tensor& row_of_TK, const Tensor& row_token_N, const Tensor& weight_TK,
                                 Tensor& dy_ND, Tensor& dweight_TK) {
  constexpr const char* op = "moe_unpermute_rows_backward";
  ORIGAMI_CHECK(y_ND.defined(), op, ": y_ND is undefined");
  const int64_t N = y_ND.rows(), D = y_ND.cols(), T = row_of_TK.rows(), K = row_of_TK.cols();
  check_data(op, y_ND, "unpermute input y_ND", y_ND, y_ND.shape());
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_i32(row_token_N, {N}, "row_token_N");
  check_data(op, dout_TD, "unpermute dout_TD", y_ND, {T, D});
  check_f32(weight_TK, {T, K}, "unpermute weight_TK");
  check_data(op, dy_ND, "unpermute dy_ND", y_ND, {N, D});
  check_f32(dweight_TK, {T, K}, "unpermute dweight_TK");
  ORIGAMI_CHECK(K <= INT32_MAX, op, ": ", K, " slots per token");
  const int64_t n_slots = T * K;
  if (n_slots + N == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  with_data_type(y_ND.dtype(), [&]<class E>() {
    const E* dout = dev<const E>(dout_TD, "dout_TD");
    const E* y = dev<const E>(y_ND, "y_ND");
    E* dy = dev<E>(dy_ND, "dy_ND");
    const int32_t* row_of = dev<const int32_t>(row_of_TK, "row_of_TK");
    const int32_t* tok = dev<const int32_t>(row_token_N, "row_token_N");
    const float* w = dev<const float>(weight_TK, "weight_TK");
    float* dw = dev<float>(dweight_TK, "dweight_TK");
    const unsigned blocks = warp_blocks(n_slots + N);
    if (packable(D, {dout, y, dy}))
      unpermute_backward_kernel<E, kPack>
          <<<blocks, kThreads, 0, stream>>>(dout, y, row_of, tok, w, n_slots, static_cast<int>(K), N, D, dy, dw);
    else
      unpermute_backward_kernel<E, 1>
          <<<blocks, kThreads, 0, stream>>>(dout, y, row_of, tok, w, n_slots, static_cast<int>(K), N, D, dy, dw);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace origami::cuda
