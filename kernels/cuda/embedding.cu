// CUDA embedding gather and scatter-add (kernels/embedding.h) for a vocab
// shard [vocab_start, vocab_start + V): ids outside it give zero rows in
// forward and no gradient in backward, as on the CPU (kernels/cpu/embedding.cpp).
//
// Forward: one block per token row (grid-stride over rows), 16-byte packs
// when the row width and both bases allow, else element copies. A copy, so
// bitwise the table's elements.
//
// Backward without float atomics. The tokens are sorted by local row with a
// stable radix sort of (row, token index) pairs, so equal rows form runs in
// token order; ids off the shard get the key V and sort last, unused. Block
// (i, c) owns sorted position i and column chunk c: it works only when i
// starts a run, and then sums the run's dout rows into the table row in
// token order, starting from the row's value: dtable[row] + dout[t0] +
// dout[t1] + ..., one fp32 add per token — exactly the CPU's order, so f32
// results are bitwise the CPU's; bf16 rows are rounded once at the end. Rows
// no token names are left untouched (accumulate semantics). The sort's keys,
// values and CUB scratch come from ctx.workspace (the op has no workspace
// argument): 4 arrays of T 32-bit words plus CUB's temp bytes.
// A frequent id's run is summed serially over its tokens (the order the CPU
// fixes); its columns are split over D / (128 · pack) blocks.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace origami::cuda {

namespace {

// N elements of T moved as one aligned access (16 bytes when N = 16 / sizeof(T)).
template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };
template <class T> constexpr int kPack16 = 16 / static_cast<int>(sizeof(T));

// Rows of D elements at these bases all start on 16-byte boundaries.
template <class T> bool rows_vectorizable(int64_t D, const void* a, const void* b) {
  return (D * static_cast<int64_t>(sizeof(T))) % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

// Threads per block for rows of `packs` packs: a power of two in [32, 256].
int row_threads(int64_t packs) {
  int t = 32;
  while (t < 256 && t < packs) t *= 2;
  return t;
}

void check_args(const Tensor& ids_T, const Tensor& table_VD, const Tensor& rows_TD, const char* what) {
  ORIGAMI_CHECK(ids_T.defined() && ids_T.dtype() == DType::i32 && ids_T.dim() == 1, what, " ids must be i32 [T], got ",
                ids_T.defined() ? shape_string(ids_T.shape()) : "(none)");
  ORIGAMI_CHECK(table_VD.defined() && table_VD.dim() == 2, what, " table must be [V, D], got ",
                table_VD.defined() ? shape_string(table_VD.shape()) : "(none)");
  ORIGAMI_CHECK(rows_TD.defined(), what, " rows are undefined");
  check_data_dtype(what, table_VD, "table");
  check_same_dtype(what, table_VD, "table", rows_TD, "rows");
  check_shape(rows_TD, {ids_T.numel(), table_VD.size(1)}, what);
}

// ---------------------------------------------------------------- forward

template <class T, int N> __global__ void gather_rows(const int32_t* __restrict__ ids, const T* __restrict__ table,
                                                      int64_t n_tokens, int64_t V, int64_t D, int64_t vocab_start,
                                                      T* __restrict__ out) {
  using P = Pack<T, N>;
  const int64_t packs = D / N;
  P zero;
#pragma unroll
  for (int k = 0; k < N; ++k) zero.v[k] = from_f32<T>(0.0f);
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const int64_t row = static_cast<int64_t>(ids[t]) - vocab_start;
    P* dst = reinterpret_cast<P*>(out + t * D);
    if (row >= 0 && row < V) {
      const P* src = reinterpret_cast<const P*>(table + row * D);
      for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) dst[c] = src[c];
    } else {
      for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) dst[c] = zero;
    }
  }
}

template <class T, int N> void launch_gather(cudaStream_t stream, const int32_t* ids, const T* table, int64_t n_tokens,
                                             int64_t V, int64_t D, int64_t vocab_start, T* out) {
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n_tokens, int64_t{1} << 20));
  gather_rows<T, N><<<blocks, row_threads(D / N), 0, stream>>>(ids, table, n_tokens, V, D, vocab_start, out);
  CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- backward

// keys[t] = local row of token t, or V when its id is off this shard;
// tokens[t] = t (the values the stable sort carries).
__global__ void sort_inputs(const int32_t* __restrict__ ids, int64_t n_tokens, int64_t V, int64_t vocab_start,
                            uint32_t* __restrict__ keys, int32_t* __restrict__ tokens) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n_tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = static_cast<int64_t>(ids[t]) - vocab_start;
    keys[t] = static_cast<uint32_t>(row >= 0 && row < V ? row : V);
    tokens[t] = static_cast<int32_t>(t);
  }
}

constexpr int kRunThreads = 128;  // columns (packs) per block, and tokens staged per round

// Block (i, c): when sorted position i starts a run of key k < V, adds the
// run's dout rows (packs [c·128, c·128 + 128) of each) into dtable row k in
// sorted order, which the stable sort makes token order. Token indices are
// staged 128 at a time in shared memory so the dout loads of a round are
// independent of each other (four in flight per thread).
template <class T, int N> __global__ void __launch_bounds__(kRunThreads)
    sum_runs(const uint32_t* __restrict__ keys, const int32_t* __restrict__ tokens, int64_t n, uint32_t V,
             const T* __restrict__ dout, int64_t D, T* __restrict__ dtable) {
  using P = Pack<T, N>;
  __shared__ int32_t staged[kRunThreads];
  const int64_t i = blockIdx.x;
  const uint32_t key = keys[i];
  if (key >= V || (i > 0 && keys[i - 1] == key)) return;  // uniform over the block
  const int64_t packs = D / N;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kRunThreads + threadIdx.x;
  const bool mine = c < packs;
  P* dst = reinterpret_cast<P*>(dtable + static_cast<int64_t>(key) * D) + c;
  float acc[N] = {};
  if (mine) {
    const P p = *dst;
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = to_f32(p.v[k]);
  }
  for (int64_t base = i;; base += kRunThreads) {
    // Keys after i are >= key (sorted), so the run's part of this round is a prefix.
    const int64_t j = base + threadIdx.x;
    const bool in_run = j < n && keys[j] == key;
    if (in_run) staged[threadIdx.x] = tokens[j];
    const int m = __syncthreads_count(in_run);
    if (mine) {
      const P* src = reinterpret_cast<const P*>(dout) + c;
      int r = 0;
      for (; r + 4 <= m; r += 4) {
        P q[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) q[u] = src[static_cast<int64_t>(staged[r + u]) * packs];
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int k = 0; k < N; ++k) acc[k] += to_f32(q[u].v[k]);
      }
      for (; r < m; ++r) {
        const P q = src[static_cast<int64_t>(staged[r]) * packs];
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += to_f32(q.v[k]);
      }
    }
    __syncthreads();  // staged is rewritten next round
    if (m < kRunThreads) break;
  }
  if (mine) {
    P p;
#pragma unroll
    for (int k = 0; k < N; ++k) p.v[k] = from_f32<T>(acc[k]);
    *dst = p;
  }
}

template <class T, int N> void launch_sum_runs(cudaStream_t stream, const uint32_t* keys, const int32_t* tokens,
                                               int64_t n, uint32_t V, const T* dout, int64_t D, T* dtable) {
  const int64_t chunks = (D / N + kRunThreads - 1) / kRunThreads;
  ORIGAMI_CHECK(chunks <= 65535, "embedding_backward: D = ", D, " needs ", chunks, " column blocks (at most 65535)");
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(chunks));
  sum_runs<T, N><<<grid, kRunThreads, 0, stream>>>(keys, tokens, n, V, dout, D, dtable);
  CUDA_CHECK_LAUNCH();
}

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

void embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD, int64_t vocab_start,
                       Tensor& out_TD) {
  check_args(ids_T, table_VD, out_TD, "embedding_forward");
  const int64_t n_tokens = ids_T.numel(), V = table_VD.size(0), D = table_VD.size(1);
  if (n_tokens == 0 || D == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  with_data_type(table_VD.dtype(), [&]<class T>() {
    const int32_t* ids = dev<const int32_t>(ids_T, "embedding_forward ids");
    const T* table = dev<const T>(table_VD, "embedding_forward table");
    T* out = dev<T>(out_TD, "embedding_forward out");
    if (rows_vectorizable<T>(D, table, out))
      launch_gather<T, kPack16<T>>(stream, ids, table, n_tokens, V, D, vocab_start, out);
    else
      launch_gather<T, 1>(stream, ids, table, n_tokens, V, D, vocab_start, out);
  });
}

void embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dout_TD, int64_t vocab_start,
                        Tensor& dtable_VD) {
  check_args(ids_T, dtable_VD, dout_TD, "embedding_backward");
  const int64_t n = ids_T.numel(), V = dtable_VD.size(0), D = dtable_VD.size(1);
  if (n == 0 || V == 0 || D == 0) return;  // no row receives anything
  ORIGAMI_CHECK(n <= INT32_MAX, "embedding_backward: ", n, " tokens (token indices are i32)");
  ORIGAMI_CHECK(V < INT32_MAX, "embedding_backward: ", V,
                " table rows (sort keys are 32-bit, V itself the off-shard key)");
  const cudaStream_t stream = stream_of(ctx);
  const int end_bit = 32 - __builtin_clz(static_cast<uint32_t>(V));  // keys lie in [0, V]

  // Workspace: keys and token indices, double-buffered for the sort, then CUB's temp.
  const size_t words = align256(static_cast<size_t>(n) * 4);
  size_t temp_bytes = 0;
  {
    cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
    cub::DoubleBuffer<int32_t> vals(nullptr, nullptr);
    CUDA_CHECK(
        cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, vals, static_cast<int>(n), 0, end_bit, stream));
  }
  Tensor ws = ctx.workspace(4 * words + temp_bytes);
  char* base = static_cast<char*>(ws.address());
  auto* key_buf = reinterpret_cast<uint32_t*>(base);
  auto* key_alt = reinterpret_cast<uint32_t*>(base + words);
  auto* tok_buf = reinterpret_cast<int32_t*>(base + 2 * words);
  auto* tok_alt = reinterpret_cast<int32_t*>(base + 3 * words);
  void* temp = base + 4 * words;

  const int32_t* ids = dev<const int32_t>(ids_T, "embedding_backward ids");
  sort_inputs<<<grid_for(n, 256), 256, 0, stream>>>(ids, n, V, vocab_start, key_buf, tok_buf);
  CUDA_CHECK_LAUNCH();
  cub::DoubleBuffer<uint32_t> keys(key_buf, key_alt);
  cub::DoubleBuffer<int32_t> toks(tok_buf, tok_alt);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, toks, static_cast<int>(n), 0, end_bit, stream));

  with_data_type(dtable_VD.dtype(), [&]<class T>() {
    const T* dout = dev<const T>(dout_TD, "embedding_backward dout");
    T* dtable = dev<T>(dtable_VD, "embedding_backward dtable");
    if (rows_vectorizable<T>(D, dout, dtable))
      launch_sum_runs<T, kPack16<T>>(stream, keys.Current(), toks.Current(), n, static_cast<uint32_t>(V), dout, D,
                                     dtable);
    else
      launch_sum_runs<T, 1>(stream, keys.Current(), toks.Current(), n, static_cast<uint32_t>(V), dout, D, dtable);
  });
}

}  // namespace origami::cuda
