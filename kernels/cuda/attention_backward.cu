// CUDA attention backward kernels (launched from attention.cu after the
// Dsum = rowsum(dO ⊙ O) pass), deterministic: no atomics. Two kernels that
// each own their outputs and write every element once:
//   dK/dV: one block per (key tile, kv head, batch); loops over the q heads of
//     the GQA group and the query tiles in a fixed order, recomputing
//     P = exp(scale·Q Kᵀ − lse) and dS = P ⊙ (dO Vᵀ − Dsum):
//       dV += Pᵀ dO,   dK += scale · dSᵀ Q
//   dQ:   one block per (query tile, q head, batch); loops over the key tiles:
//       dQ += scale · dS K
// P and dP are recomputed in both (7 tile products instead of FA2's 5): the
// price of writing dQ without atomics or an O(S²) buffer.
//
// Masking matches the CPU twin: an element is visible when kv_pos <= q_pos
// (by value; positions may be in any order); a masked element has P = 0
// without evaluating exp, so a row before every key (lse −inf) contributes
// nothing. Query tiles entirely before a key tile (max q_pos < min kv_pos)
// and key tiles entirely after a query tile are skipped. Rows past Sq / keys
// past Skv are zero-filled in shared memory and never written.
//
// SIMT (f32, and bf16 of other head dims): 32 × 32 tiles, 256 threads, fp32
// shared memory, S and dP 2 × 2 per thread, accumulators in shared memory
// updated once per tile from register sums over the tile's 32 rows/keys.
//
// Tensor cores (bf16, head_dim 64 / 128): 64-row tiles, 4 warps of 16 rows.
// dK/dV computes the transposed products Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, so Pᵀ and
// dSᵀ come out in accumulator layout with key rows and re-pack in registers
// as the A operands of Pᵀ dO and dSᵀ Q (B from ldmatrix.trans of dO and Q);
// the Q/dO tiles (with their lse, Dsum, positions) are double-buffered with
// cp.async. dQ is the forward's structure with dP = dO Vᵀ beside S and
// dS K (ldmatrix.trans of K) in place of P V. dS and P are rounded to bf16
// for the tensor-core products, as FlashAttention does.
#include "kernels/cuda/attention_tiles.cuh"

namespace origami::cuda::attn {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------- SIMT

constexpr int kSt = 32, kSThreads = 256;
static_assert(kSt == kRangeRows, "the SIMT kernels read one range slot per tile");


// Both SIMT kernels: four [kSt][ld] operand tiles, two [kSt][kSt+1] P/dS
// tiles (dQ uses one), two [kSt][D] accumulators (dQ uses one), 4 × kSt scalars.
static_assert(kSt == kAttentionCudaSimtRows, "kernels/attention.h states this kernel's shared memory");
size_t bwd_simt_smem(int64_t D) { return attention_cuda_backward_smem(D); }

// Loads rows [row0, row0 + kSt) of a head (stride ldg) as fp32 into a [kSt][ld]
// tile, zeros past n rows.
template <class T>
__device__ __forceinline__ void load_rows(float* dst, int ld, const T* head, int64_t ldg, int64_t row0, int n, int D,
                                          int tid) {
  for (int e = tid; e < kSt * D; e += kSThreads) {
    const int r = e / D, c = e - r * D;
    dst[r * ld + c] = r < n ? to_f32(head[(row0 + r) * ldg + c]) : 0.0f;
  }
}

// P and dS of a 32 × 32 (query i, key j) tile, 2 × 2 per thread, into
// P_s / dS_s [i][j] (P_s may be null).
__device__ __forceinline__ void simt_p_ds(const float* Qs, const float* dOs, const float* Ks, const float* Vs, int ld,
                                          int D, const int* qpos, const int* kpos, const float* lse,
                                          const float* Dsum, int nq, int nk, float scale, float* P_s, float* dS_s,
                                          int tid) {
  const int ty = tid / 16, tx = tid % 16;  // rows 2ty, 2ty+1; columns tx, tx+16
  float s[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}}, dp[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  const float* q0 = Qs + 2 * ty * ld;
  const float* g0 = dOs + 2 * ty * ld;
  const float* k0 = Ks + tx * ld;
  const float* v0 = Vs + tx * ld;
  for (int d = 0; d < D; ++d) {
    const float x0 = q0[d], x1 = q0[ld + d], y0 = k0[d], y1 = k0[16 * ld + d];
    const float u0 = g0[d], u1 = g0[ld + d], w0 = v0[d], w1 = v0[16 * ld + d];
    s[0][0] = fmaf(x0, y0, s[0][0]), s[0][1] = fmaf(x0, y1, s[0][1]);
    s[1][0] = fmaf(x1, y0, s[1][0]), s[1][1] = fmaf(x1, y1, s[1][1]);
    dp[0][0] = fmaf(u0, w0, dp[0][0]), dp[0][1] = fmaf(u0, w1, dp[0][1]);
    dp[1][0] = fmaf(u1, w0, dp[1][0]), dp[1][1] = fmaf(u1, w1, dp[1][1]);
  }
  for (int ri = 0; ri < 2; ++ri)
    for (int cj = 0; cj < 2; ++cj) {
      const int i = 2 * ty + ri, j = tx + 16 * cj;
      const bool visible = i < nq && j < nk && kpos[j] <= qpos[i];
      const float p = visible ? expf(s[ri][cj] * scale - lse[i]) : 0.0f;
      if (P_s) P_s[i * (kSt + 1) + j] = p;
      dS_s[i * (kSt + 1) + j] = p * (dp[ri][cj] - Dsum[i]);
    }
}

template <class T> __global__ void __launch_bounds__(kSThreads) dkdv_simt_kernel(BwdArgs a) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), ld = simt_ld(a.D);
  float* Ks = smem;
  float* Vs = Ks + kSt * ld;
  float* Qs = Vs + kSt * ld;
  float* dOs = Qs + kSt * ld;
  float* P_s = dOs + kSt * ld;       // [kSt (query)][kSt + 1 (key)]
  float* dS_s = P_s + kSt * (kSt + 1);
  float* dK_s = dS_s + kSt * (kSt + 1);  // [kSt (key)][D]
  float* dV_s = dK_s + kSt * D;
  float* lse_s = dV_s + kSt * D;
  float* Ds_s = lse_s + kSt;
  int* qpos_s = reinterpret_cast<int*>(Ds_s + kSt);
  int* kpos_s = qpos_s + kSt;

  const int tid = threadIdx.x;
  const int64_t kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, group = a.Hq / a.Hkv;
  const int64_t j0 = kt * kSt, n_qt = ceil_div(a.Sq, kSt), ldq = a.Hq * a.D, ldk = a.Hkv * a.D;
  const int nk = static_cast<int>(min(static_cast<int64_t>(kSt), a.Skv - j0));
  const T* Kh = static_cast<const T*>(a.k) + (b * a.Skv * a.Hkv + kvh) * a.D;
  const T* Vh = static_cast<const T*>(a.v) + (b * a.Skv * a.Hkv + kvh) * a.D;
  load_rows(Ks, ld, Kh, ldk, j0, nk, D, tid);
  load_rows(Vs, ld, Vh, ldk, j0, nk, D, tid);
  for (int e = tid; e < kSt * D; e += kSThreads) dK_s[e] = dV_s[e] = 0.0f;
  if (tid < kSt) kpos_s[tid] = tid < nk ? a.kv_pos[j0 + tid] : kPosMax;
  const int2 kr = a.ranges.kv[kt];

  for (int64_t hq = kvh * group; hq < (kvh + 1) * group; ++hq) {
    const T* Qh = static_cast<const T*>(a.q) + (b * a.Sq * a.Hq + hq) * a.D;
    const T* dOh = static_cast<const T*>(a.dO) + (b * a.Sq * a.Hq + hq) * a.D;
    const float* lse = a.lse + (b * a.Hq + hq) * a.Sq;
    const float* Dsum = a.Dsum + (b * a.Hq + hq) * a.Sq;
    for (int64_t qt = 0; qt < n_qt; ++qt) {
      if (a.ranges.q[qt].y < kr.x) continue;  // every query before every key
      const int64_t i0 = qt * kSt;
      const int nq = static_cast<int>(min(static_cast<int64_t>(kSt), a.Sq - i0));
      __syncthreads();  // the previous tile's readers are done
      load_rows(Qs, ld, Qh, ldq, i0, nq, D, tid);
      load_rows(dOs, ld, dOh, ldq, i0, nq, D, tid);
      if (tid < kSt) {
        const bool in = tid < nq;
        lse_s[tid] = in ? lse[i0 + tid] : 0.0f;
        Ds_s[tid] = in ? Dsum[i0 + tid] : 0.0f;
        qpos_s[tid] = in ? a.q_pos[i0 + tid] : INT32_MIN;
      }
      __syncthreads();
      simt_p_ds(Qs, dOs, Ks, Vs, ld, D, qpos_s, kpos_s, lse_s, Ds_s, nq, nk, a.scale, P_s, dS_s, tid);
      __syncthreads();
      for (int e = tid; e < kSt * D; e += kSThreads) {
        const int j = e / D, c = e - j * D;
        float dv = 0.0f, dk = 0.0f;
        for (int i = 0; i < kSt; ++i) {
          dv = fmaf(P_s[i * (kSt + 1) + j], dOs[i * ld + c], dv);
          dk = fmaf(dS_s[i * (kSt + 1) + j], Qs[i * ld + c], dk);
        }
        dV_s[e] += dv;
        dK_s[e] += a.scale * dk;
      }
    }
  }
  __syncthreads();
  T* dKh = static_cast<T*>(a.dk) + (b * a.Skv * a.Hkv + kvh) * a.D;
  T* dVh = static_cast<T*>(a.dv) + (b * a.Skv * a.Hkv + kvh) * a.D;
  for (int e = tid; e < nk * D; e += kSThreads) {
    const int j = e / D, c = e - j * D;
    dKh[(j0 + j) * ldk + c] = from_f32<T>(dK_s[e]);
    dVh[(j0 + j) * ldk + c] = from_f32<T>(dV_s[e]);
  }
}

template <class T> __global__ void __launch_bounds__(kSThreads) dq_simt_kernel(BwdArgs a) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), ld = simt_ld(a.D);
  float* Qs = smem;
  float* dOs = Qs + kSt * ld;
  float* Ks = dOs + kSt * ld;
  float* Vs = Ks + kSt * ld;
  float* dS_s = Vs + kSt * ld;             // [kSt (query)][kSt + 1 (key)]
  float* dQ_s = dS_s + 2 * kSt * (kSt + 1);  // [kSt][D]
  float* lse_s = dQ_s + 2 * kSt * D;
  float* Ds_s = lse_s + kSt;
  int* qpos_s = reinterpret_cast<int*>(Ds_s + kSt);
  int* kpos_s = qpos_s + kSt;

  const int tid = threadIdx.x;
  const int64_t n_qt = ceil_div(a.Sq, kSt), n_kt = ceil_div(a.Skv, kSt);
  const int64_t qt = n_qt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (a.Hq / a.Hkv), i0 = qt * kSt, ldq = a.Hq * a.D, ldk = a.Hkv * a.D;
  const int nq = static_cast<int>(min(static_cast<int64_t>(kSt), a.Sq - i0));
  const T* Qh = static_cast<const T*>(a.q) + (b * a.Sq * a.Hq + h) * a.D;
  const T* dOh = static_cast<const T*>(a.dO) + (b * a.Sq * a.Hq + h) * a.D;
  const T* Kh = static_cast<const T*>(a.k) + (b * a.Skv * a.Hkv + kvh) * a.D;
  const T* Vh = static_cast<const T*>(a.v) + (b * a.Skv * a.Hkv + kvh) * a.D;
  load_rows(Qs, ld, Qh, ldq, i0, nq, D, tid);
  load_rows(dOs, ld, dOh, ldq, i0, nq, D, tid);
  for (int e = tid; e < kSt * D; e += kSThreads) dQ_s[e] = 0.0f;
  if (tid < kSt) {
    const bool in = tid < nq;
    lse_s[tid] = in ? a.lse[(b * a.Hq + h) * a.Sq + i0 + tid] : 0.0f;
    Ds_s[tid] = in ? a.Dsum[(b * a.Hq + h) * a.Sq + i0 + tid] : 0.0f;
    qpos_s[tid] = in ? a.q_pos[i0 + tid] : INT32_MIN;
  }
  const int2 qr = a.ranges.q[qt];

  for (int64_t kt = 0; kt < n_kt; ++kt) {
    if (a.ranges.kv[kt].x > qr.y) continue;  // every key in every query's future
    const int64_t j0 = kt * kSt;
    const int nk = static_cast<int>(min(static_cast<int64_t>(kSt), a.Skv - j0));
    __syncthreads();
    load_rows(Ks, ld, Kh, ldk, j0, nk, D, tid);
    load_rows(Vs, ld, Vh, ldk, j0, nk, D, tid);
    if (tid < kSt) kpos_s[tid] = tid < nk ? a.kv_pos[j0 + tid] : kPosMax;
    __syncthreads();
    simt_p_ds(Qs, dOs, Ks, Vs, ld, D, qpos_s, kpos_s, lse_s, Ds_s, nq, nk, a.scale, nullptr, dS_s, tid);
    __syncthreads();
    for (int e = tid; e < kSt * D; e += kSThreads) {
      const int i = e / D, c = e - i * D;
      const float* ds = dS_s + i * (kSt + 1);
      float dq = 0.0f;
      for (int j = 0; j < kSt; ++j) dq = fmaf(ds[j], Ks[j * ld + c], dq);
      dQ_s[e] += a.scale * dq;
    }
  }
  __syncthreads();
  T* dQh = static_cast<T*>(a.dq) + (b * a.Sq * a.Hq + h) * a.D;
  for (int e = tid; e < nq * D; e += kSThreads) {
    const int i = e / D, c = e - i * D;
    dQh[(i0 + i) * ldq + c] = from_f32<T>(dQ_s[e]);
  }
}

// ---------------------------------------------------------------- tensor cores

constexpr int kMr = 64, kMWarps = 4, kMThreads = kMWarps * 32;  // tiles of 64 rows, 16 per warp
static_assert(kMr % kRangeRows == 0);

// dK/dV: K, V [kMr][D]; Q, dO [2][kMr][D]; per buffer kMr lse, Dsum, q_pos.
template <int D> constexpr size_t dkdv_mma_smem() {
  return static_cast<size_t>(6 * kMr) * D * sizeof(bf16) + 2 * kMr * (2 * sizeof(float) + sizeof(int));
}
// dQ: Q, dO [kMr][D]; K, V [2][kMr][D]; per buffer kMr kv_pos.
template <int D> constexpr size_t dq_mma_smem() {
  return static_cast<size_t>(6 * kMr) * D * sizeof(bf16) + 2 * kMr * sizeof(int);
}

// Accumulator rows (this warp's 16) of a [kMr][D] tile, scaled, as bf16 into
// the warp's own rows of a swizzled tile, then 16-byte stores of the valid
// rows to global (row stride ld).
template <int D>
__device__ __forceinline__ void store_rows(const float (&acc)[D / 8][4], float scale, const SwizzledTile<D>& stage,
                                           bf16* head, int64_t ld, int64_t row0, int64_t n_rows, int warp, int lane) {
  const int t = lane & 3, g = lane >> 2;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(stage.at(warp * 16 + g + 8 * hf, dt * 8) + 2 * t) =
          pack_bf16(acc[dt][2 * hf] * scale, acc[dt][2 * hf + 1] * scale);
  __syncwarp();
  for (int c = lane; c < 16 * (D / 8); c += 32) {
    const int r = warp * 16 + c / (D / 8), col = (c % (D / 8)) * 8;
    if (row0 + r < n_rows)
      *reinterpret_cast<uint4*>(head + (row0 + r) * ld + col) = *reinterpret_cast<const uint4*>(stage.at(r, col));
  }
}

template <int D> __global__ void __launch_bounds__(kMThreads) dkdv_mma_kernel(BwdArgs a) {
  constexpr int kKc = D / 16, kNt = kMr / 8, kDt = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  const SwizzledTile<D> Kt{sm}, Vt{sm + kMr * D};
  bf16* qdo_base = sm + 2 * kMr * D;  // Q0, Q1, dO0, dO1
  float* lse_s = reinterpret_cast<float*>(sm + 6 * kMr * D);  // [2][kMr], log2 domain
  float* Ds_s = lse_s + 2 * kMr;                               // [2][kMr]
  int* qpos_s = reinterpret_cast<int*>(Ds_s + 2 * kMr);        // [2][kMr]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = lane & 3, g = lane >> 2;
  const int64_t kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, group = a.Hq / a.Hkv;
  const int64_t n_qt = ceil_div(a.Sq, kMr), n_qr = ceil_div(a.Sq, kRangeRows), n_kr = ceil_div(a.Skv, kRangeRows);
  const int64_t j0 = kt * kMr, ldq = a.Hq * D, ldk = a.Hkv * D;
  const bf16* Kh = static_cast<const bf16*>(a.k) + (b * a.Skv * a.Hkv + kvh) * D;
  const bf16* Vh = static_cast<const bf16*>(a.v) + (b * a.Skv * a.Hkv + kvh) * D;
  const int2 kr = fold_ranges(a.ranges.kv, kt * (kMr / kRangeRows), kMr / kRangeRows, n_kr);
  const float scale_log2 = a.scale * kLog2e;
  int kp[2];  // positions of this lane's key rows g, g + 8
  for (int hf = 0; hf < 2; ++hf) {
    const int64_t j = j0 + warp * 16 + g + 8 * hf;
    kp[hf] = j < a.Skv ? a.kv_pos[j] : kPosMax;
  }

  // Work items: (q head of the group, q tile) in order, skipping q tiles before every key.
  const int64_t n_items = group * n_qt;
  auto q_range = [&](int64_t qt) { return fold_ranges(a.ranges.q, qt * (kMr / kRangeRows), kMr / kRangeRows, n_qr); };
  auto next_item = [&](int64_t from) {
    for (int64_t it = from; it < n_items; ++it)
      if (q_range(it % n_qt).y >= kr.x) return it;
    return n_items;
  };
  auto load_q = [&](int64_t it, int buf) {
    const int64_t hq = kvh * group + it / n_qt, i0 = (it % n_qt) * kMr;
    const int64_t head = b * a.Sq * a.Hq + hq;
    load_tile_async<D, kMr>(SwizzledTile<D>{qdo_base + buf * kMr * D}, static_cast<const bf16*>(a.q) + head * D, ldq,
                            i0, a.Sq, tid, kMThreads);
    load_tile_async<D, kMr>(SwizzledTile<D>{qdo_base + (2 + buf) * kMr * D}, static_cast<const bf16*>(a.dO) + head * D,
                            ldq, i0, a.Sq, tid, kMThreads);
    if (tid < kMr) {
      const int64_t i = i0 + tid, at = (b * a.Hq + hq) * a.Sq + i;
      const bool in = i < a.Sq;
      lse_s[buf * kMr + tid] = in ? a.lse[at] * kLog2e : 0.0f;
      Ds_s[buf * kMr + tid] = in ? a.Dsum[at] : 0.0f;
      qpos_s[buf * kMr + tid] = in ? a.q_pos[i] : INT32_MIN;
    }
  };

  load_tile_async<D, kMr>(Kt, Kh, ldk, j0, a.Skv, tid, kMThreads);
  load_tile_async<D, kMr>(Vt, Vh, ldk, j0, a.Skv, tid, kMThreads);
  int64_t it = next_item(0);
  if (it < n_items) load_q(it, 0);
  cp_async_commit();

  float dk[kDt][4], dv[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;

  int buf = 0;
  while (it < n_items) {
    const int64_t nxt = next_item(it + 1);
    cp_async_wait_all();
    __syncthreads();  // item it landed; every warp is done with buffer buf ^ 1
    if (nxt < n_items) load_q(nxt, buf ^ 1);
    cp_async_commit();

    const SwizzledTile<D> Qt{qdo_base + buf * kMr * D}, dOt{qdo_base + (2 + buf) * kMr * D};
    const float* lse = lse_s + buf * kMr;
    const float* Ds = Ds_s + buf * kMr;
    const int* qpos = qpos_s + buf * kMr;
    const int64_t qt = it % n_qt;
    const bool need_mask = kr.y > q_range(qt).x || (qt + 1) * kMr > a.Sq || j0 + kMr > a.Skv;

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: this warp's 16 keys × 64 queries.
    float st[kNt][4], dpt[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < kKc; ++kc) {
      uint32_t ka[4], va[4];
      ldsm_a(ka, Kt, warp * 16, kc * 16, lane);
      ldsm_a(va, Vt, warp * 16, kc * 16, lane);
#pragma unroll
      for (int np = 0; np < kNt / 2; ++np) {
        uint32_t qb[4], ob[4];
        ldsm_b_nk(qb, Qt, np * 16, kc * 16, lane);
        ldsm_b_nk(ob, dOt, np * 16, kc * 16, lane);
        mma_bf16(st[2 * np], ka, qb[0], qb[1]);
        mma_bf16(st[2 * np + 1], ka, qb[2], qb[3]);
        mma_bf16(dpt[2 * np], va, ob[0], ob[1]);
        mma_bf16(dpt[2 * np + 1], va, ob[2], ob[3]);
      }
    }
    // Pᵀ into st, dSᵀ into dpt. Element (key g + 8hf, query nt·8 + 2t + e).
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const int c = nt * 8 + 2 * t;
      const float2 l2 = *reinterpret_cast<const float2*>(lse + c);
      const float2 d2 = *reinterpret_cast<const float2*>(Ds + c);
      const int2 q2 = *reinterpret_cast<const int2*>(qpos + c);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool visible = !need_mask || kp[hf] <= (e ? q2.y : q2.x);
          const float p = visible ? exp2f(st[nt][2 * hf + e] * scale_log2 - (e ? l2.y : l2.x)) : 0.0f;
          st[nt][2 * hf + e] = p;
          dpt[nt][2 * hf + e] = p * (dpt[nt][2 * hf + e] - (e ? d2.y : d2.x));
        }
    }
    // dV += Pᵀ dO, dK += dSᵀ Q (scale applied at the end).
#pragma unroll
    for (int kk = 0; kk < kMr / 16; ++kk) {
      uint32_t pa[4], da[4];
      c_to_a(pa, st[2 * kk], st[2 * kk + 1]);
      c_to_a(da, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < kDt / 2; ++dp) {
        uint32_t ob[4], qb[4];
        ldsm_b_kn(ob, dOt, kk * 16, dp * 16, lane);
        ldsm_b_kn(qb, Qt, kk * 16, dp * 16, lane);
        mma_bf16(dv[2 * dp], pa, ob[0], ob[1]);
        mma_bf16(dv[2 * dp + 1], pa, ob[2], ob[3]);
        mma_bf16(dk[2 * dp], da, qb[0], qb[1]);
        mma_bf16(dk[2 * dp + 1], da, qb[2], qb[3]);
      }
    }
    buf ^= 1;
    it = nxt;
  }
  cp_async_wait_all();
  __syncthreads();  // K/V landed even when no item ran; each warp reuses its own K/V rows for staging
  store_rows<D>(dk, a.scale, Kt, static_cast<bf16*>(a.dk) + (b * a.Skv * a.Hkv + kvh) * D, ldk, j0, a.Skv, warp,
                lane);
  store_rows<D>(dv, 1.0f, Vt, static_cast<bf16*>(a.dv) + (b * a.Skv * a.Hkv + kvh) * D, ldk, j0, a.Skv, warp, lane);
}

template <int D> __global__ void __launch_bounds__(kMThreads) dq_mma_kernel(BwdArgs a) {
  constexpr int kKc = D / 16, kNt = kMr / 8, kDt = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  const SwizzledTile<D> Qt{sm}, dOt{sm + kMr * D};
  bf16* kv_base = sm + 2 * kMr * D;  // K0, K1, V0, V1
  int* kpos_s = reinterpret_cast<int*>(sm + 6 * kMr * D);  // [2][kMr]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = lane & 3, g = lane >> 2;
  const int64_t n_qt = ceil_div(a.Sq, kMr), n_kt = ceil_div(a.Skv, kMr);
  const int64_t n_qr = ceil_div(a.Sq, kRangeRows), n_kr = ceil_div(a.Skv, kRangeRows);
  const int64_t qt = n_qt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (a.Hq / a.Hkv), i0 = qt * kMr, ldq = a.Hq * D, ldk = a.Hkv * D;
  const int64_t qhead = b * a.Sq * a.Hq + h;
  const bf16* Kh = static_cast<const bf16*>(a.k) + (b * a.Skv * a.Hkv + kvh) * D;
  const bf16* Vh = static_cast<const bf16*>(a.v) + (b * a.Skv * a.Hkv + kvh) * D;
  const int2 qr = fold_ranges(a.ranges.q, qt * (kMr / kRangeRows), kMr / kRangeRows, n_qr);
  const float scale_log2 = a.scale * kLog2e;

  int qp[2];
  float lse2[2], Dr[2];  // this lane's rows g, g + 8: position, lse (log2 domain), Dsum
  for (int hf = 0; hf < 2; ++hf) {
    const int64_t i = i0 + warp * 16 + g + 8 * hf;
    const bool in = i < a.Sq;
    qp[hf] = in ? a.q_pos[i] : INT32_MIN;
    lse2[hf] = in ? a.lse[(b * a.Hq + h) * a.Sq + i] * kLog2e : 0.0f;
    Dr[hf] = in ? a.Dsum[(b * a.Hq + h) * a.Sq + i] : 0.0f;
  }

  auto k_range = [&](int64_t kt) { return fold_ranges(a.ranges.kv, kt * (kMr / kRangeRows), kMr / kRangeRows, n_kr); };
  auto next_tile = [&](int64_t from) {
    for (int64_t kt = from; kt < n_kt; ++kt)
      if (k_range(kt).x <= qr.y) return kt;
    return n_kt;
  };
  auto load_kv = [&](int64_t kt, int buf) {
    const int64_t j0 = kt * kMr;
    load_tile_async<D, kMr>(SwizzledTile<D>{kv_base + buf * kMr * D}, Kh, ldk, j0, a.Skv, tid, kMThreads);
    load_tile_async<D, kMr>(SwizzledTile<D>{kv_base + (2 + buf) * kMr * D}, Vh, ldk, j0, a.Skv, tid, kMThreads);
    if (tid < kMr) kpos_s[buf * kMr + tid] = j0 + tid < a.Skv ? a.kv_pos[j0 + tid] : kPosMax;
  };

  load_tile_async<D, kMr>(Qt, static_cast<const bf16*>(a.q) + qhead * D, ldq, i0, a.Sq, tid, kMThreads);
  load_tile_async<D, kMr>(dOt, static_cast<const bf16*>(a.dO) + qhead * D, ldq, i0, a.Sq, tid, kMThreads);
  int64_t kt = next_tile(0);
  if (kt < n_kt) load_kv(kt, 0);
  cp_async_commit();

  float dq[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.0f;

  int buf = 0;
  while (kt < n_kt) {
    const int64_t nxt = next_tile(kt + 1);
    cp_async_wait_all();
    __syncthreads();
    if (nxt < n_kt) load_kv(nxt, buf ^ 1);
    cp_async_commit();

    const SwizzledTile<D> Kt{kv_base + buf * kMr * D}, Vt{kv_base + (2 + buf) * kMr * D};
    const int* kpos = kpos_s + buf * kMr;
    const bool need_mask = k_range(kt).y > qr.x || (kt + 1) * kMr > a.Skv;

    float s[kNt][4], dp[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < kKc; ++kc) {
      uint32_t qa[4], oa[4];
      ldsm_a(qa, Qt, warp * 16, kc * 16, lane);
      ldsm_a(oa, dOt, warp * 16, kc * 16, lane);
#pragma unroll
      for (int np = 0; np < kNt / 2; ++np) {
        uint32_t kb[4], vb[4];
        ldsm_b_nk(kb, Kt, np * 16, kc * 16, lane);
        ldsm_b_nk(vb, Vt, np * 16, kc * 16, lane);
        mma_bf16(s[2 * np], qa, kb[0], kb[1]);
        mma_bf16(s[2 * np + 1], qa, kb[2], kb[3]);
        mma_bf16(dp[2 * np], oa, vb[0], vb[1]);
        mma_bf16(dp[2 * np + 1], oa, vb[2], vb[3]);
      }
    }
    // dS into dp. Element (query g + 8hf, key nt·8 + 2t + e).
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const int2 k2 = need_mask ? *reinterpret_cast<const int2*>(kpos + nt * 8 + 2 * t) : make_int2(0, 0);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool visible = !need_mask || (e ? k2.y : k2.x) <= qp[hf];
          const float p = visible ? exp2f(s[nt][2 * hf + e] * scale_log2 - lse2[hf]) : 0.0f;
          dp[nt][2 * hf + e] = p * (dp[nt][2 * hf + e] - Dr[hf]);
        }
    }
    // dQ += dS K (scale applied at the end).
#pragma unroll
    for (int kk = 0; kk < kMr / 16; ++kk) {
      uint32_t da[4];
      c_to_a(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < kDt / 2; ++dn) {
        uint32_t kb[4];
        ldsm_b_kn(kb, Kt, kk * 16, dn * 16, lane);
        mma_bf16(dq[2 * dn], da, kb[0], kb[1]);
        mma_bf16(dq[2 * dn + 1], da, kb[2], kb[3]);
      }
    }
    buf ^= 1;
    kt = nxt;
  }
  cp_async_wait_all();
  __syncthreads();
  store_rows<D>(dq, a.scale, Qt, static_cast<bf16*>(a.dq) + qhead * D, ldq, i0, a.Sq, warp, lane);
}

void check_grid(int64_t x, int64_t y, int64_t z) {
  ORIGAMI_CHECK(x < (int64_t(1) << 31) && y <= 65535 && z <= 65535, "attention_backward grid too large: ", x, " × ",
                y, " × ", z);
}

template <int D> void launch_mma(const BwdArgs& a, cudaStream_t s) {
  constexpr size_t smem_kv = dkdv_mma_smem<D>(), smem_q = dq_mma_smem<D>();
  allow_smem(reinterpret_cast<const void*>(&dkdv_mma_kernel<D>), smem_kv, "attention_backward dK/dV (tensor cores)");
  allow_smem(reinterpret_cast<const void*>(&dq_mma_kernel<D>), smem_q, "attention_backward dQ (tensor cores)");
  const int64_t n_kt = ceil_div(a.Skv, kMr), n_qt = ceil_div(a.Sq, kMr);
  check_grid(n_kt, a.Hkv, a.B);
  check_grid(n_qt, a.Hq, a.B);
  dkdv_mma_kernel<D><<<dim3(static_cast<unsigned>(n_kt), static_cast<unsigned>(a.Hkv), static_cast<unsigned>(a.B)),
                       kMThreads, smem_kv, s>>>(a);
  CUDA_CHECK_LAUNCH();
  dq_mma_kernel<D><<<dim3(static_cast<unsigned>(n_qt), static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B)),
                     kMThreads, smem_q, s>>>(a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

template <class T> void launch_backward_simt(const BwdArgs& a, cudaStream_t s) {
  const size_t smem = bwd_simt_smem(a.D);
  allow_smem(reinterpret_cast<const void*>(&dkdv_simt_kernel<T>), smem, "attention_backward dK/dV (SIMT)");
  allow_smem(reinterpret_cast<const void*>(&dq_simt_kernel<T>), smem, "attention_backward dQ (SIMT)");
  const int64_t n_kt = ceil_div(a.Skv, kSt), n_qt = ceil_div(a.Sq, kSt);
  check_grid(n_kt, a.Hkv, a.B);
  check_grid(n_qt, a.Hq, a.B);
  dkdv_simt_kernel<T><<<dim3(static_cast<unsigned>(n_kt), static_cast<unsigned>(a.Hkv), static_cast<unsigned>(a.B)),
                        kSThreads, smem, s>>>(a);
  CUDA_CHECK_LAUNCH();
  dq_simt_kernel<T><<<dim3(static_cast<unsigned>(n_qt), static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B)),
                      kSThreads, smem, s>>>(a);
  CUDA_CHECK_LAUNCH();
}
template void launch_backward_simt<float>(const BwdArgs&, cudaStream_t);
template void launch_backward_simt<bf16>(const BwdArgs&, cudaStream_t);

void launch_backward_mma(const BwdArgs& a, cudaStream_t s) {
  if (a.D == 64)
    launch_mma<64>(a, s);
  else
    launch_mma<128>(a, s);
}

}  // namespace origami::cuda::attn
