// CUDA causal GQA attention, the entry points (kernels/attention.h): input
// checks, workspace layout, the small prepare kernels, the choice between
// the bf16 tensor-core kernels and the SIMT ones, and attention_merge.
//
// Workspace (every region 256-byte aligned, all written before read):
//   forward:  [q_pos ranges: ceil(Sq/32) int2][kv_pos ranges: ceil(Skv/32) int2]
//   backward: [Dsum: B·Hq·Sq f32][q_pos ranges][kv_pos ranges]
// A range is {min, max} position of 32 consecutive rows (attention_tiles.cuh).
//
// Kernel choice: bf16 with head_dim 64 or 128 and 16-byte aligned tensors
// runs the tensor-core kernels (attention_forward.cu / attention_backward.cu);
// everything else (f32, other head dims) the SIMT kernels, fp32 FMA
// throughout. Both are deterministic: no atomics, fixed reduction orders.
//
// Merge: one warp per (batch, query, head) row; the two weights in double as
// on the CPU (lane-redundant, so no broadcast), the row blended in fp32.
#include "kernels/cuda/attention_tiles.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

using attn::align256;
using attn::ceil_div;
using attn::kRangeRows;

void check_inputs(const char* op, const AttentionDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& q_pos, const Tensor& kv_pos) {
  attention_input_shapes(d, q, k, v, q_pos, kv_pos);
  check_data_dtype(op, q, "q");
  check_same_dtype(op, q, "q", k, "k");
  check_same_dtype(op, q, "q", v, "v");
}

size_t ranges_bytes(const AttentionDims& d) {
  return align256(ceil_div(d.q_len, kRangeRows) * sizeof(int2)) +
         align256(ceil_div(d.kv_len, kRangeRows) * sizeof(int2));
}
size_t dsum_bytes(const AttentionDims& d) { return align256(d.batch * d.num_heads * d.q_len * sizeof(float)); }

void check_workspace(const char* op, const Tensor& ws, size_t need) {
  ORIGAMI_CHECK(ws.defined(), op, " without a workspace");
  ORIGAMI_CHECK(ws.nbytes() >= need, op, " workspace has ", ws.nbytes(), " bytes, needs ", need);
  ORIGAMI_CHECK(reinterpret_cast<uintptr_t>(ws.address()) % 16 == 0, op, " workspace is not 16-byte aligned");
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.address()) % 16 == 0; }

// The tensor-core kernels: bf16, head_dim 64 or 128, 16-byte aligned rows.
bool mma_eligible(const AttentionDims& d, std::initializer_list<const Tensor*> ts) {
  if ((*ts.begin())->dtype() != DType::bf16 || (d.head_dim != 64 && d.head_dim != 128)) return false;
  for (const Tensor* t : ts)
    if (!aligned16(*t)) return false;
  return true;
}

// {min, max} of each kRangeRows consecutive positions; one thread per range.
__global__ void position_ranges_kernel(const int32_t* __restrict pos, int64_t n, int2* __restrict out) {
  const int64_t n_ranges = (n + kRangeRows - 1) / kRangeRows;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < n_ranges; r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i0 = r * kRangeRows, i1 = min(n, i0 + kRangeRows);
    int2 lohi = make_int2(pos[i0], pos[i0]);
    for (int64_t i = i0 + 1; i < i1; ++i) {
      lohi.x = min(lohi.x, pos[i]);
      lohi.y = max(lohi.y, pos[i]);
    }
    out[r] = lohi;
  }
}

// Writes both range arrays at `at` (the layout of ranges_bytes).
attn::Ranges prepare_ranges(const AttentionDims& d, const Tensor& q_pos, const Tensor& kv_pos, char* at,
                            cudaStream_t s) {
  int2* qr = reinterpret_cast<int2*>(at);
  int2* kr = reinterpret_cast<int2*>(at + align256(ceil_div(d.q_len, kRangeRows) * sizeof(int2)));
  constexpr int kThreads = 128;
  position_ranges_kernel<<<grid_for(ceil_div(d.q_len, kRangeRows), kThreads), kThreads, 0, s>>>(
      dev<const int32_t>(q_pos, "attention q_pos"), d.q_len, qr);
  CUDA_CHECK_LAUNCH();
  position_ranges_kernel<<<grid_for(ceil_div(d.kv_len, kRangeRows), kThreads), kThreads, 0, s>>>(
      dev<const int32_t>(kv_pos, "attention kv_pos"), d.kv_len, kr);
  CUDA_CHECK_LAUNCH();
  return {qr, kr};
}

// Dsum[b, h, i] = Σ_c dO[b, i, h, c] · O[b, i, h, c] in fp32: one warp per
// row, lanes strided over c, then a fixed xor-shuffle tree.
template <class T>
__global__ void dsum_kernel(const T* __restrict o, const T* __restrict dO, float* __restrict Dsum, int64_t B,
                            int64_t Sq, int64_t Hq, int64_t D) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < B * Sq * Hq; row += warps) {
    const T* a = o + row * D;
    const T* g = dO + row * D;
    float s = 0.0f;
    for (int64_t c = lane; c < D; c += 32) s += to_f32(a[c]) * to_f32(g[c]);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) {
      const int64_t h = row % Hq, i = (row / Hq) % Sq, b = row / (Hq * Sq);
      Dsum[(b * Hq + h) * Sq + i] = s;
    }
  }
}

template <class T>
__global__ void merge_kernel(const T* __restrict o_part, const float* __restrict lse_part, T* __restrict o_acc,
                             float* __restrict lse_acc, int64_t B, int64_t Sq, int64_t Hq, int64_t D) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < B * Sq * Hq; row += warps) {
    const int64_t h = row % Hq, i = (row / Hq) % Sq, b = row / (Hq * Sq);
    const int64_t l_at = (b * Hq + h) * Sq + i;
    const double part = lse_part[l_at], acc = lse_acc[l_at];
    if (part == -INFINITY) continue;  // nothing to add: the row stays bitwise as it is
    T* dst = o_acc + row * D;
    const T* src = o_part + row * D;
    __syncwarp();  // every lane has read lse_acc before lane 0 rewrites it
    if (acc == -INFINITY) {  // nothing yet: the part as it is
      for (int64_t e = lane; e < D; e += 32) dst[e] = src[e];
      if (lane == 0) lse_acc[l_at] = lse_part[l_at];
      continue;
    }
    const double m = fmax(part, acc);
    const double w_acc = exp(acc - m), w_part = exp(part - m), sum = w_acc + w_part;
    const float wa = static_cast<float>(w_acc / sum), wp = static_cast<float>(w_part / sum);
    for (int64_t e = lane; e < D; e += 32) dst[e] = from_f32<T>(wa * to_f32(dst[e]) + wp * to_f32(src[e]));
    if (lane == 0) lse_acc[l_at] = static_cast<float>(m + log(sum));
  }
}

unsigned warp_grid(int64_t rows, int warps_per_block) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(rows, warps_per_block), 1, 65535 * 8));
}

}  // namespace

size_t attention_forward_workspace_bytes(const ExecContext&, const AttentionDims& dims) {
  attention_dims_check(dims);
  return ranges_bytes(dims);
}

void attention_forward(const ExecContext& ctx, const AttentionDims& d, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& o,
                       Tensor& lse_BHS, Tensor& workspace) {
  constexpr const char* op = "attention_forward";
  check_inputs(op, d, q, k, v, q_pos_S, kv_pos_S);
  attention_output_shapes(d, o, lse_BHS);
  check_same_dtype(op, q, "q", o, "o");
  check_workspace(op, workspace, ranges_bytes(d));
  const cudaStream_t s = stream_of(ctx);

  attn::FwdArgs a{};
  a.q = q.address();
  a.k = k.address();
  a.v = v.address();
  a.q_pos = dev<const int32_t>(q_pos_S, "attention q_pos");
  a.kv_pos = dev<const int32_t>(kv_pos_S, "attention kv_pos");
  a.o = o.address();
  a.lse = dev<float>(lse_BHS, "attention lse");
  a.ranges = prepare_ranges(d, q_pos_S, kv_pos_S, static_cast<char*>(workspace.address()), s);
  a.B = d.batch, a.Sq = d.q_len, a.Skv = d.kv_len, a.Hq = d.num_heads, a.Hkv = d.num_kv_heads, a.D = d.head_dim;
  a.scale = scale;
  if (mma_eligible(d, {&q, &k, &v, &o}))
    attn::launch_forward_mma(a, s);
  else
    with_data_type(q.dtype(), [&]<class T>() { attn::launch_forward_simt<T>(a, s); });
}

size_t attention_backward_workspace_bytes(const ExecContext&, const AttentionDims& dims) {
  attention_dims_check(dims);
  return dsum_bytes(dims) + ranges_bytes(dims);
}

void attention_backward(const ExecContext& ctx, const AttentionDims& d, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                        const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                        Tensor& workspace) {
  constexpr const char* op = "attention_backward";
  check_inputs(op, d, q, k, v, q_pos_S, kv_pos_S);
  attention_grad_shapes(d, o, lse_BHS, do_, dq, dk, dv);
  check_same_dtype(op, q, "q", o, "o");
  check_same_dtype(op, q, "q", do_, "do");
  check_same_dtype(op, q, "q", dq, "dq");
  check_same_dtype(op, q, "q", dk, "dk");
  check_same_dtype(op, q, "q", dv, "dv");
  check_workspace(op, workspace, dsum_bytes(d) + ranges_bytes(d));
  const cudaStream_t s = stream_of(ctx);
  char* ws = static_cast<char*>(workspace.address());
  float* Dsum = reinterpret_cast<float*>(ws);

  attn::BwdArgs a{};
  a.q = q.address();
  a.k = k.address();
  a.v = v.address();
  a.dO = do_.address();
  a.lse = dev<const float>(lse_BHS, "attention lse");
  a.Dsum = Dsum;
  a.q_pos = dev<const int32_t>(q_pos_S, "attention q_pos");
  a.kv_pos = dev<const int32_t>(kv_pos_S, "attention kv_pos");
  a.dq = dq.address();
  a.dk = dk.address();
  a.dv = dv.address();
  a.ranges = prepare_ranges(d, q_pos_S, kv_pos_S, ws + dsum_bytes(d), s);
  a.B = d.batch, a.Sq = d.q_len, a.Skv = d.kv_len, a.Hq = d.num_heads, a.Hkv = d.num_kv_heads, a.D = d.head_dim;
  a.scale = scale;

  constexpr int kWarps = 8;
  const int64_t rows = d.batch * d.q_len * d.num_heads;
  with_data_type(q.dtype(), [&]<class T>() {
    dsum_kernel<T><<<warp_grid(rows, kWarps), kWarps * 32, 0, s>>>(
        dev<const T>(o, "attention o"), dev<const T>(do_, "attention do"), Dsum, d.batch, d.q_len, d.num_heads,
        d.head_dim);
    CUDA_CHECK_LAUNCH();
  });
  if (mma_eligible(d, {&q, &k, &v, &do_, &dq, &dk, &dv}))
    attn::launch_backward_mma(a, s);
  else
    with_data_type(q.dtype(), [&]<class T>() { attn::launch_backward_simt<T>(a, s); });
}

void attention_merge(const ExecContext& ctx, const Tensor& o_part, const Tensor& lse_part, Tensor& o_acc,
                     Tensor& lse_acc) {
  constexpr const char* op = "attention_merge";
  ORIGAMI_CHECK(o_acc.dim() == 4 && lse_acc.dim() == 3, "attention_merge: o must be [B, Sq, Hq, hd], lse [B, Hq, Sq]");
  const int64_t B = o_acc.size(0), Sq = o_acc.size(1), Hq = o_acc.size(2), hd = o_acc.size(3);
  check_shape(o_part, o_acc.shape(), "attention_merge o_part");
  check_shape(lse_acc, {B, Hq, Sq}, "attention_merge lse_acc");
  check_shape(lse_part, {B, Hq, Sq}, "attention_merge lse_part");
  check_data_dtype(op, o_acc, "o_acc");
  check_same_dtype(op, o_acc, "o_acc", o_part, "o_part");
  const int64_t rows = B * Sq * Hq;
  if (rows == 0) return;  // hd == 0 still merges lse, as the CPU twin does
  constexpr int kWarps = 8;
  const cudaStream_t s = stream_of(ctx);
  with_data_type(o_acc.dtype(), [&]<class T>() {
    merge_kernel<T><<<warp_grid(rows, kWarps), kWarps * 32, 0, s>>>(
        dev<const T>(o_part, "attention_merge o_part"), dev<const float>(lse_part, "attention_merge lse_part"),
        dev<T>(o_acc, "attention_merge o_acc"), dev<float>(lse_acc, "attention_merge lse_acc"), B, Sq, Hq, hd);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace origami::cuda
