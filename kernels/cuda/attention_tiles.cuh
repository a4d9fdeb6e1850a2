// Private pieces of the CUDA attention (attention.cu, attention_forward.cu,
// attention_backward.cu): the launch arguments, the position ranges that
// decide tile skipping and masking, and the warp-level bf16 tensor-core
// primitives (mma.sync m16n8k16, ldmatrix, cp.async) with their register
// layouts written out once, here.
//
// Position ranges: positions are arbitrary (context parallelism's zigzag
// chunks, ring attention's later key blocks, shuffled tests), so a tile's
// skip/mask decision comes from the min and max position of its rows, never
// from indices. prepare kernels write [lo, hi] per kRangeRows rows of q_pos
// and kv_pos into the workspace; a kernel with taller tiles folds several.
//
// Register layouts of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4·g + t
// (g = lane >> 2 in 0..7, t = lane & 3):
//   A (16×16, row-major), 4 × b32, each two bf16 (lower half = lower column):
//     a0 = A[g][2t, 2t+1]   a1 = A[g+8][2t, 2t+1]
//     a2 = A[g][2t+8, +9]   a3 = A[g+8][2t+8, +9]
//   B (16×8, K×N), 2 × b32:  b0 = B[2t, 2t+1][g]   b1 = B[2t+8, 2t+9][g]
//   C/D (16×8 f32), 4 × f32: c0, c1 = C[g][2t, 2t+1]   c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the row addresses (16 bytes
// each) of matrix i; register i of every lane receives matrix i's
// M[g][2t, 2t+1] (no .trans) or M[2t][g], M[2t+1][g] (.trans).
// Hence, with tiles in shared memory as [rows][D] (16-byte chunks swizzled):
//   - an A fragment of rows r0.., columns k0..: x4 on (rows r0 + (i&1)·8,
//     cols k0 + (i>>1)·8)                                     (ldsm_a)
//   - B fragments of two n-tiles from a tile stored [n][k] (K for Q·Kᵀ):
//     x4 on (rows n0 + (i>>1)·8, cols k0 + (i&1)·8): regs {0,1} are n-tile
//     n0, regs {2,3} n-tile n0+8                              (ldsm_b_nk)
//   - B fragments of two n-tiles from a tile stored [k][n] (V for P·V):
//     x4.trans on (rows k0 + (i&1)·8, cols n0 + (i>>1)·8): regs {0,1} are
//     n-tile n0, {2,3} n-tile n0+8                            (ldsm_b_kn)
//   - a C tile pair (n-tiles 2j, 2j+1 of a 16-row accumulator) is the A
//     fragment of k-chunk j once packed to bf16:
//     a0 = C[2j].c0c1, a1 = C[2j].c2c3, a2 = C[2j+1].c0c1, a3 = C[2j+1].c2c3.
#pragma once
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/cuda/common.cuh"

namespace origami::cuda::attn {

constexpr int kRangeRows = 32;  // rows per [lo, hi] position range
constexpr int32_t kPosMax = 0x7fffffff;

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }
// Row stride of the SIMT kernels' fp32 tiles: odd, so the 16 different rows
// one warp reads at the same column fall in 16 different banks
// (kernels/attention.h, which also states their shared memory).
__host__ __device__ inline int simt_ld(int64_t D) { return static_cast<int>(attention_cuda_simt_ld(D)); }

struct Ranges {
  const int2* q;   // [ceil(Sq / kRangeRows)] {lo, hi} of q_pos
  const int2* kv;  // [ceil(Skv / kRangeRows)] {lo, hi} of kv_pos
};

struct FwdArgs {
  const void *q, *k, *v;  // [B, Sq, Hq, D], [B, Skv, Hkv, D] ×2
  const int32_t *q_pos, *kv_pos;
  void* o;     // [B, Sq, Hq, D]
  float* lse;  // [B, Hq, Sq]
  Ranges ranges;
  int64_t B, Sq, Skv, Hq, Hkv, D;
  float scale;
};

struct BwdArgs {
  const void *q, *k, *v, *dO;  // o is folded into Dsum before the kernels run
  const float* lse;            // [B, Hq, Sq]
  const float* Dsum;           // [B, Hq, Sq] rowsum(dO ⊙ O)
  const int32_t *q_pos, *kv_pos;
  void *dq, *dk, *dv;
  Ranges ranges;
  int64_t B, Sq, Skv, Hq, Hkv, D;
  float scale;
};

// Launchers (attention_forward.cu / attention_backward.cu). The MMA ones take
// bf16 data with D in {64, 128} and 16-byte aligned q, k, v (o, dO, dq...):
// the caller checks mma_eligible first.
template <class T> void launch_forward_simt(const FwdArgs& a, cudaStream_t s);
void launch_forward_mma(const FwdArgs& a, cudaStream_t s);
template <class T> void launch_backward_simt(const BwdArgs& a, cudaStream_t s);
void launch_backward_mma(const BwdArgs& a, cudaStream_t s);

// Smallest / largest position over range slots [first, first + count) that
// exist (slot < n_slots). A tile past the end has no slots: {kPosMax, INT_MIN}.
__device__ __forceinline__ int2 fold_ranges(const int2* r, int64_t first, int count, int64_t n_slots) {
  int2 out = make_int2(kPosMax, INT32_MIN);
  for (int i = 0; i < count && first + i < n_slots; ++i) {
    const int2 x = r[first + i];
    out.x = min(out.x, x.x);
    out.y = max(out.y, x.y);
  }
  return out;
}

// Dynamic shared memory beyond the 48 KiB default, checked against the device.
inline void allow_smem(const void* kernel, size_t bytes, const char* what) {
  int dev = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  ORIGAMI_CHECK(bytes <= static_cast<size_t>(optin), what, " needs ", bytes,
                " bytes of shared memory per block, the device allows ", optin,
                " (head_dim too large for the CUDA attention kernels)");
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// ---------------------------------------------------------------- tensor-core primitives

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; bytes past src_bytes (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// d += a · b (16×8×16, bf16 in, f32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> bf16x2 (round to nearest even), lo in the lower half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A shared tile of R rows × D bf16 columns, 16-byte chunks XOR-swizzled by
// (row & 7) so the 8 row addresses of one ldmatrix (same chunk column, 8
// consecutive rows) hit 8 different bank groups. D >= 64 (8 chunks a row).
template <int D> struct SwizzledTile {
  bf16* base;
  __device__ __forceinline__ bf16* at(int row, int col) const {  // col: a multiple of 8
    const int chunk = (col >> 3) ^ (row & 7);
    return base + row * D + chunk * 8;
  }
};

// A fragment: rows r0..r0+15, columns k0..k0+15 of a [rows][D] tile.
template <int D>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const SwizzledTile<D>& t, int r0, int k0, int lane) {
  const int i = lane >> 3;
  ldsm_x4(a, t.at(r0 + (i & 1) * 8 + (lane & 7), k0 + (i >> 1) * 8));
}
// B fragments of n-tiles n0 (b[0], b[1]) and n0+8 (b[2], b[3]), k0..k0+15, from a tile stored [n][k].
template <int D>
__device__ __forceinline__ void ldsm_b_nk(uint32_t (&b)[4], const SwizzledTile<D>& t, int n0, int k0, int lane) {
  const int i = lane >> 3;
  ldsm_x4(b, t.at(n0 + (i >> 1) * 8 + (lane & 7), k0 + (i & 1) * 8));
}
// B fragments of n-tiles n0 (b[0], b[1]) and n0+8 (b[2], b[3]), k0..k0+15, from a tile stored [k][n].
template <int D>
__device__ __forceinline__ void ldsm_b_kn(uint32_t (&b)[4], const SwizzledTile<D>& t, int k0, int n0, int lane) {
  const int i = lane >> 3;
  ldsm_x4_trans(b, t.at(k0 + (i & 1) * 8 + (lane & 7), n0 + (i >> 1) * 8));
}

// C n-tiles 2j and 2j+1 (16 rows × 16 columns) as the A fragment of k-chunk j.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// Copies rows [row0, row0 + R) of one head (row stride ld elements) into a
// swizzled tile with cp.async, zero-filling rows at or past n_rows.
// Every thread of the block (nthreads) takes a share of the 16-byte chunks.
template <int D, int R>
__device__ __forceinline__ void load_tile_async(const SwizzledTile<D>& t, const bf16* head, int64_t ld, int64_t row0,
                                                int64_t n_rows, int tid, int nthreads) {
  constexpr int kChunks = D / 8;
  for (int c = tid; c < R * kChunks; c += nthreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool in = row0 + r < n_rows;
    const bf16* src = in ? head + (row0 + r) * ld + col : head;
    cp_async16(t.at(r, col), src, in ? 16 : 0);
  }
}

}  // namespace origami::cuda::attn
