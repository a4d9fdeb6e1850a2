// CUDA MoE integer routing ops (kernels/moe_ops.h; CPU twin
// kernels/cpu/moe_ops.cpp): the expert histogram, capacity masks, rows per
// expert and the permutation row maps. Every result is an integer or a pure
// selection, so each equals the CPU's bit for bit.
//
// Order without atomics: the flattened T·K slots (slot i = t·K + j, the
// token-major order) are sorted by a STABLE cub::DeviceRadixSort of (key,
// slot) pairs, so each expert's slots form one run in slot order:
//   maps: key = expert, or E for a dropped slot (sorts last, unused); the run
//         of expert e starting at sorted position start[e] fills rows
//         offset[e] + (p − start[e]) — the CPU's fill order;
//   capacity, position: key = expert; slot p of a run is kept when
//         p − start[e] < C (its first C slots in token-major order);
//   capacity, probs: two stable sorts, first by weight descending (NaN as
//         −inf, −0 as +0, as the CPU's comparison sees them), then by expert:
//         runs are (weight desc, slot asc), the CPU's ranking, keep the first C.
// start[e] is a binary search over the sorted keys and offset[e] a block scan
// of rows_E, in one single-block kernel that also makes the CPU's checks
// (kept ≤ rows, Σ rows = N). The histogram counts with integer atomics
// (order-independent, exact). Scratch (keys and slots double-buffered, start,
// base, CUB temp) comes from ctx.workspace: ≈ 16 bytes per slot.
// One CUB instantiation (u32 keys, i32 slots) serves all sorts.
#include <bit>
#include <climits>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/moe_common.cuh"
#include "kernels/cuda/ops.h"

namespace origami::cuda {

namespace {

using moe::align256;

void check_expert_tk(const Tensor& expert_TK) {
  ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32, "expert_TK must be i32");
}

void check_kept(const Tensor& kept_TK, const Tensor& expert_TK) {
  if (!kept_TK.defined()) return;
  ORIGAMI_CHECK(kept_TK.dtype() == DType::u8, "kept_TK must be u8");
  check_shape(kept_TK, expert_TK.shape(), "kept_TK");
}

// ---------------------------------------------------------------- histogram

constexpr int kHistThreads = 256;
constexpr int64_t kSharedBins = 8192;  // experts counted in shared memory first (32 KiB)

// Block-local counts in shared memory (or straight to global for huge E),
// then one global add per non-empty bin. Integer atomics: the result does
// not depend on their order. Every slot's expert is range-checked, dropped
// or not, as on the CPU.
__global__ void __launch_bounds__(kHistThreads)
    histogram_kernel(const int32_t* __restrict__ ex, const uint8_t* __restrict__ kept, int64_t n, int E,
                     bool shared_bins, unsigned long long* __restrict__ count) {
  extern __shared__ unsigned bins[];
  if (shared_bins) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) bins[e] = 0;
    __syncthreads();
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = ex[i];
    ORIGAMI_DEVICE_CHECK(e >= 0 && e < E, "moe_expert_histogram: expert index outside [0, num_experts)");
    if (kept && !kept[i]) continue;
    if (shared_bins)
      atomicAdd(&bins[e], 1u);
    else
      atomicAdd(&count[e], 1ull);
  }
  if (shared_bins) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (bins[e]) atomicAdd(&count[e], static_cast<unsigned long long>(bins[e]));
  }
}

// ---------------------------------------------------------------- sort keys

constexpr int kThreads = 256;

// Maps and the position policy: key = expert (range-checked), or E for a
// dropped slot (kept given and 0; not checked, as on the CPU); slot = i.
__global__ void expert_keys_kernel(const int32_t* __restrict__ ex, const uint8_t* __restrict__ kept, int64_t n, int E,
                                   uint32_t* __restrict__ keys, int32_t* __restrict__ slots) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t key = static_cast<uint32_t>(E);
    if (!kept || kept[i]) {
      const int32_t e = ex[i];
      ORIGAMI_DEVICE_CHECK(e >= 0 && e < E, "moe routing: expert index outside [0, num_experts)");
      key = static_cast<uint32_t>(e);
    }
    keys[i] = key;
    slots[i] = static_cast<int32_t>(i);
  }
}

// The probs policy's first sort: a u32 whose ascending order is the weights'
// descending one. NaN ranks as −inf (lowest) and −0 as +0, so keys tie
// exactly where the CPU's comparison ties (the stable sort then keeps the
// lower slot first).
__device__ __forceinline__ uint32_t descending_weight_key(float w) {
  if (w != w) w = -INFINITY;
  if (w == 0.0f) w = 0.0f;
  const uint32_t u = __float_as_uint(w);
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

__global__ void weight_keys_kernel(const float* __restrict__ w, int64_t n, uint32_t* __restrict__ keys,
                                   int32_t* __restrict__ slots) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = descending_weight_key(w[i]);
    slots[i] = static_cast<int32_t>(i);
  }
}

// The probs policy's second sort: keys[p] = expert of sorted slot p.
__global__ void gathered_expert_keys_kernel(const int32_t* __restrict__ ex, const int32_t* __restrict__ slots,
                                            int64_t n, int E, uint32_t* __restrict__ keys) {
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = ex[slots[p]];
    ORIGAMI_DEVICE_CHECK(e >= 0 && e < E, "moe_capacity_mask: expert index outside [0, num_experts)");
    keys[p] = static_cast<uint32_t>(e);
  }
}

// ---------------------------------------------------------------- expert bounds

constexpr int kBoundsThreads = 256;

// First position in sorted keys[0, n) whose key is >= k.
__device__ __forceinline__ int64_t lower_bound(const uint32_t* keys, int64_t n, uint32_t k) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < k)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// One block. start[e] (e in [0, E]) = first sorted position of key e. With
// rows (maps): base[e] = Σ_{e'<e} rows[e'] − start[e], so sorted position p
// of expert e lands on row base[e] + p; and the CPU's checks: each expert's
// kept slots fit its rows, and Σ rows = N (the row maps' length).
__global__ void __launch_bounds__(kBoundsThreads)
    expert_bounds_kernel(const uint32_t* __restrict__ keys, int64_t n, int E, const int64_t* __restrict__ rows,
                         int64_t N, int64_t* __restrict__ start, int64_t* __restrict__ base) {
  using Scan = cub::BlockScan<int64_t, kBoundsThreads>;
  __shared__ typename Scan::TempStorage scan;
  int64_t carry = 0;
  for (int e0 = 0; e0 <= E; e0 += kBoundsThreads) {  // uniform over the block
    const int e = e0 + static_cast<int>(threadIdx.x);
    const int64_t r = rows && e < E ? rows[e] : 0;
    int64_t offset, total;
    Scan(scan).ExclusiveSum(r, offset, total);
    if (e <= E) {
      const int64_t lo = lower_bound(keys, n, static_cast<uint32_t>(e));
      start[e] = lo;
      if (rows && e < E) {
        const int64_t kept = lower_bound(keys, n, static_cast<uint32_t>(e) + 1) - lo;
        ORIGAMI_DEVICE_CHECK(r >= 0 && kept <= r, "moe_permutation_maps: an expert has more kept slots than rows_E");
        base[e] = carry + offset - lo;
      }
    }
    carry += total;
    __syncthreads();  // the scan's storage is reused
  }
  if (rows && threadIdx.x == 0)
    ORIGAMI_DEVICE_CHECK(carry == N, "moe_permutation_maps: sum of rows_E differs from the row maps' length");
}

// ---------------------------------------------------------------- final passes

__global__ void capacity_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ slots, int64_t n,
                                const int64_t* __restrict__ start, int64_t capacity, uint8_t* __restrict__ kept) {
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x)
    kept[slots[p]] = p - start[keys[p]] < capacity ? 1 : 0;
}

// Row maps from the sorted slots; padding rows keep the −1 of the memset.
__global__ void maps_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ slots, int64_t n, int E,
                            int K, const int64_t* __restrict__ base, int32_t* __restrict__ row_of,
                            int32_t* __restrict__ row_token, int32_t* __restrict__ row_slot) {
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t key = keys[p];
    const int32_t i = slots[p];
    if (key == static_cast<uint32_t>(E)) {
      row_of[i] = -1;
      continue;
    }
    const int64_t r = base[key] + p;
    row_of[i] = static_cast<int32_t>(r);
    row_token[r] = i / K;
    row_slot[r] = i % K;
  }
}

// ---------------------------------------------------------------- scratch

// Bits that hold keys in [0, max_key]; at least 1 (CUB copies instead of
// sorting when begin_bit == end_bit).
int key_bits(uint32_t max_key) { return std::max(1, static_cast<int>(std::bit_width(max_key))); }

// The sort's double buffers, per-expert bounds and CUB's temp, carved from
// one workspace block (kept alive by the caller until its last launch).
struct SlotSort {
  Tensor ws;
  cub::DoubleBuffer<uint32_t> keys;
  cub::DoubleBuffer<int32_t> slots;
  int64_t* start = nullptr;  // [E + 1]
  int64_t* base = nullptr;   // [E]
  void* temp = nullptr;
  size_t temp_bytes = 0;
  int n = 0;

  SlotSort(const ExecContext& ctx, int64_t n_slots, int64_t E, std::initializer_list<int> end_bits)
      : n(static_cast<int>(n_slots)) {
    const cudaStream_t stream = stream_of(ctx);
    for (int bits : end_bits) {  // CUB's temp depends on the pass count: room for the largest
      size_t bytes = 0;
      cub::DoubleBuffer<uint32_t> k(nullptr, nullptr);
      cub::DoubleBuffer<int32_t> s(nullptr, nullptr);
      CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, k, s, n, 0, bits, stream));
      temp_bytes = std::max(temp_bytes, bytes);
    }
    const size_t words = align256(static_cast<size_t>(n) * 4), bounds = align256(static_cast<size_t>(E + 1) * 8);
    ws = ctx.workspace(4 * words + 2 * bounds + temp_bytes);
    char* p = static_cast<char*>(ws.address());
    keys = cub::DoubleBuffer<uint32_t>(reinterpret_cast<uint32_t*>(p), reinterpret_cast<uint32_t*>(p + words));
    slots = cub::DoubleBuffer<int32_t>(reinterpret_cast<int32_t*>(p + 2 * words),
                                       reinterpret_cast<int32_t*>(p + 3 * words));
    start = reinterpret_cast<int64_t*>(p + 4 * words);
    base = reinterpret_cast<int64_t*>(p + 4 * words + bounds);
    temp = p + 4 * words + 2 * bounds;
  }

  void sort(int end_bit, cudaStream_t stream) {
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, slots, n, 0, end_bit, stream));
  }
};

void check_slot_count(int64_t n, const char* op) {
  ORIGAMI_CHECK(n <= INT32_MAX, op, ": ", n, " slots (slot indices are i32)");
}

}  // namespace

void moe_expert_histogram(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, int64_t E,
                          Tensor& count_E) {
  check_expert_tk(expert_TK);
  check_kept(kept_TK, expert_TK);
  ORIGAMI_CHECK(count_E.defined() && count_E.dtype() == DType::i64, "count_E must be i64");
  check_shape(count_E, {E}, "count_E");
  ORIGAMI_CHECK(E <= INT32_MAX, "moe_expert_histogram: ", E, " experts");
  const int64_t n = expert_TK.numel();
  const cudaStream_t stream = stream_of(ctx);
  auto* count = static_cast<unsigned long long*>(count_E.address());
  if (E > 0) CUDA_CHECK(cudaMemsetAsync(count, 0, static_cast<size_t>(E) * 8, stream));
  if (n == 0) return;
  const bool shared_bins = E <= kSharedBins;
  const unsigned blocks = grid_for(n, kHistThreads * 4, 1024);
  histogram_kernel<<<blocks, kHistThreads, shared_bins ? static_cast<size_t>(E) * 4 : 0, stream>>>(
      dev<const int32_t>(expert_TK, "expert_TK"), kept_TK.defined() ? dev<const uint8_t>(kept_TK, "kept_TK") : nullptr,
      n, static_cast<int>(E), shared_bins, count);
  CUDA_CHECK_LAUNCH();
}

void moe_capacity_mask(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& weight_TK, int64_t E,
                       int64_t capacity, MoeDrop policy, Tensor& kept_TK) {
  check_expert_tk(expert_TK);
  ORIGAMI_CHECK(kept_TK.defined() && kept_TK.dtype() == DType::u8, "kept_TK must be u8");
  check_shape(kept_TK, expert_TK.shape(), "kept_TK");
  const int64_t n = expert_TK.numel();
  const cudaStream_t stream = stream_of(ctx);
  uint8_t* kept = dev<uint8_t>(kept_TK, "kept_TK");
  if (capacity < 0) {  // dropless
    if (n > 0) CUDA_CHECK(cudaMemsetAsync(kept, 1, static_cast<size_t>(n), stream));
    return;
  }
  if (policy == MoeDrop::probs) {
    check_shape(weight_TK, expert_TK.shape(), "weight_TK");
    ORIGAMI_CHECK(weight_TK.dtype() == DType::f32, "weight_TK must be f32");
  }
  if (n == 0) return;
  check_slot_count(n, "moe_capacity_mask");
  ORIGAMI_CHECK(E > 0 && E < INT32_MAX, "moe_capacity_mask: ", E, " experts");
  const int expert_bits = key_bits(static_cast<uint32_t>(E - 1));
  const int32_t* ex = dev<const int32_t>(expert_TK, "expert_TK");
  const unsigned blocks = grid_for(n, kThreads);
  if (policy == MoeDrop::position) {
    SlotSort s(ctx, n, E, {expert_bits});
    expert_keys_kernel<<<blocks, kThreads, 0, stream>>>(ex, nullptr, n, static_cast<int>(E), s.keys.Current(),
                                                        s.slots.Current());
    CUDA_CHECK_LAUNCH();
    s.sort(expert_bits, stream);
    expert_bounds_kernel<<<1, kBoundsThreads, 0, stream>>>(s.keys.Current(), n, static_cast<int>(E), nullptr, 0,
                                                           s.start, nullptr);
    CUDA_CHECK_LAUNCH();
    capacity_kernel<<<blocks, kThreads, 0, stream>>>(s.keys.Current(), s.slots.Current(), n, s.start, capacity, kept);
    CUDA_CHECK_LAUNCH();
    return;
  }
  SlotSort s(ctx, n, E, {32, expert_bits});
  weight_keys_kernel<<<blocks, kThreads, 0, stream>>>(dev<const float>(weight_TK, "weight_TK"), n, s.keys.Current(),
                                                      s.slots.Current());
  CUDA_CHECK_LAUNCH();
  s.sort(32, stream);  // weight descending, slot ascending on ties
  gathered_expert_keys_kernel<<<blocks, kThreads, 0, stream>>>(ex, s.slots.Current(), n, static_cast<int>(E),
                                                               s.keys.Current());
  CUDA_CHECK_LAUNCH();
  s.sort(expert_bits, stream);  // stable: each expert's run keeps the weight order
  expert_bounds_kernel<<<1, kBoundsThreads, 0, stream>>>(s.keys.Current(), n, static_cast<int>(E), nullptr, 0, s.start,
                                                         nullptr);
  CUDA_CHECK_LAUNCH();
  capacity_kernel<<<blocks, kThreads, 0, stream>>>(s.keys.Current(), s.slots.Current(), n, s.start, capacity, kept);
  CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void expert_rows_kernel(const int64_t* __restrict__ kept, int64_t E, int64_t pad_rows,
                                   int64_t* __restrict__ rows) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < E;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    rows[e] = pad_rows >= 0 ? pad_rows : kept[e];
}
}  // namespace

void moe_expert_rows(const ExecContext& ctx, const Tensor& kept_E, int64_t pad_rows, Tensor& rows_E) {
  ORIGAMI_CHECK(kept_E.defined() && kept_E.dtype() == DType::i64 && kept_E.dim() == 1, "kept_E must be i64 [E]");
  ORIGAMI_CHECK(rows_E.defined() && rows_E.dtype() == DType::i64, "rows_E must be i64");
  const int64_t E = kept_E.numel();
  check_shape(rows_E, {E}, "rows_E");
  if (E == 0) return;
  expert_rows_kernel<<<grid_for(E, kThreads), kThreads, 0, stream_of(ctx)>>>(dev<const int64_t>(kept_E, "kept_E"), E,
                                                                             pad_rows, dev<int64_t>(rows_E, "rows_E"));
  CUDA_CHECK_LAUNCH();
}

void moe_permutation_maps(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, const Tensor& rows_E,
                          Tensor& row_of_TK, Tensor& row_token_N, Tensor& row_slot_N) {
  check_expert_tk(expert_TK);
  check_kept(kept_TK, expert_TK);
  ORIGAMI_CHECK(rows_E.defined() && rows_E.dtype() == DType::i64 && rows_E.dim() == 1, "rows_E must be i64 [E]");
  const int64_t T = expert_TK.rows(), K = expert_TK.cols(), E = rows_E.numel();
  // N = Σ rows_E is device data: the maps' length is checked against it on the device.
  ORIGAMI_CHECK(row_token_N.defined() && row_token_N.dim() == 1, "row_token_N must be [N]");
  const int64_t N = row_token_N.numel();
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_i32(row_token_N, {N}, "row_token_N");
  check_i32(row_slot_N, {N}, "row_slot_N");
  ORIGAMI_CHECK(N <= INT32_MAX, "moe_permutation_maps: ", N, " rows (row maps are i32)");
  ORIGAMI_CHECK(E < INT32_MAX, "moe_permutation_maps: ", E, " experts");
  ORIGAMI_CHECK(E > 0 || N == 0, "moe_permutation_maps: no experts but ", N, " rows");
  const int64_t n = T * K;
  check_slot_count(n, "moe_permutation_maps");
  const cudaStream_t stream = stream_of(ctx);
  int32_t* row_token = dev<int32_t>(row_token_N, "row_token_N");
  int32_t* row_slot = dev<int32_t>(row_slot_N, "row_slot_N");
  if (N > 0) {  // every row starts as padding (−1 = 0xFFFFFFFF); kept slots overwrite theirs
    CUDA_CHECK(cudaMemsetAsync(row_token, 0xFF, static_cast<size_t>(N) * 4, stream));
    CUDA_CHECK(cudaMemsetAsync(row_slot, 0xFF, static_cast<size_t>(N) * 4, stream));
  }
  const int64_t* rows = E > 0 ? dev<const int64_t>(rows_E, "rows_E") : nullptr;
  if (n == 0) {
    // No slots: only the rows' sum is left to check (the CPU's shape check of the maps).
    if (E > 0) {
      SlotSort s(ctx, 0, E, {});
      expert_bounds_kernel<<<1, kBoundsThreads, 0, stream>>>(nullptr, 0, static_cast<int>(E), rows, N, s.start, s.base);
      CUDA_CHECK_LAUNCH();
    }
    return;
  }
  const int bits = key_bits(static_cast<uint32_t>(E));  // keys in [0, E]; E marks a dropped slot
  SlotSort s(ctx, n, E, {bits});
  const unsigned blocks = grid_for(n, kThreads);
  expert_keys_kernel<<<blocks, kThreads, 0, stream>>>(
      dev<const int32_t>(expert_TK, "expert_TK"), kept_TK.defined() ? dev<const uint8_t>(kept_TK, "kept_TK") : nullptr,
      n, static_cast<int>(E), s.keys.Current(), s.slots.Current());
  CUDA_CHECK_LAUNCH();
  s.sort(bits, stream);
  expert_bounds_kernel<<<1, kBoundsThreads, 0, stream>>>(s.keys.Current(), n, static_cast<int>(E), rows, N, s.start,
                                                         s.base);
  CUDA_CHECK_LAUNCH();
  maps_kernel<<<blocks, kThreads, 0, stream>>>(s.keys.Current(), s.slots.Current(), n, static_cast<int>(E),
                                               static_cast<int>(K), s.base, dev<int32_t>(row_of_TK, "row_of_TK"),
                                               row_token, row_slot);
  CUDA_CHECK_LAUNCH();
}

}  // namespace origami::cuda
