// CUDA attention forward kernels (launched from attention.cu), FlashAttention-2
// style: one block per (q tile, q head, batch), a loop over the key tiles
// with an online softmax (running max m, running denominator l, rescaled
// accumulator), o = acc / l and lse = m + log l written once at the end.
//
// Invariants shared with the CPU twin (kernels/cpu/attention.cpp):
//   - a key tile is skipped when its smallest position exceeds every query
//     position of the q tile; it is mask-free when its largest position is
//     <= every query position and it is full (positions from the workspace
//     ranges, never from indices: they may be in any order);
//   - whether a row sees any key is decided by positions (a flag set by
//     every unmasked element), never by the scores: a row that sees none
//     gets o = 0 and lse = −inf; a row that does but whose denominator is
//     not > 0 (non-finite scores) gets NaN;
//   - rows past Sq / keys past Skv are zero-filled in shared memory (never
//     garbage: 0 · NaN would leak) and masked; nothing past them is written.
//
// SIMT (f32 data, and bf16 of other head dims): 32 × 32 tiles, 256 threads,
// everything in fp32 shared memory (head_dim is a runtime value); S is
// computed 2 × 2 per thread, the row statistics by 8 lanes per row with a
// fixed shuffle tree, the accumulator O in shared memory updated once per
// key tile from a per-thread register sum over the tile's 32 keys.
//
// Tensor cores (bf16, head_dim 64 / 128): 128 × 64 tiles, 4 warps of 32 query
// rows each (two m16 tiles), Q in shared memory, K/V double-buffered with
// cp.async (tile t+1 in flight while tile t is computed), fragments by
// ldmatrix from XOR-swizzled tiles, scores and softmax in fp32 registers in
// the exp2 domain (scale·log2 e folded in), P re-packed from the score
// accumulators into A fragments without touching shared memory (layouts in
// attention_tiles.cuh). The output is staged through the warp's own rows of
// the Q tile for 16-byte stores. Blocks run the latest q tiles first (the
// costliest under the causal mask).
#include <cmath>

#include "kernels/cuda/attention_tiles.cuh"

namespace origami::cuda::attn {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------- SIMT

constexpr int kSt = 32;        // SIMT tile rows (queries and keys); == kRangeRows
constexpr int kSThreads = 256;  // 8 lanes per row for the row statistics
static_assert(kSt == kRangeRows, "the SIMT kernels read one range slot per tile");


static_assert(kSt == kAttentionCudaSimtRows, "kernels/attention.h states this kernel's shared memory");
size_t fwd_simt_smem(int64_t D) { return attention_cuda_forward_smem(D); }

template <class T> __global__ void __launch_bounds__(kSThreads) fwd_simt_kernel(FwdArgs a) {
  extern __shared__ float smem[];
  const int D = static_cast<int>(a.D), ld = simt_ld(a.D);
  float* Qs = smem;               // [kSt][ld]
  float* Ks = Qs + kSt * ld;      // [kSt][ld]
  float* Vs = Ks + kSt * ld;      // [kSt][D]
  float* Os = Vs + kSt * D;       // [kSt][D] unnormalized output
  float* Ss = Os + kSt * D;       // [kSt][kSt + 1] scores, then probabilities
  float* m_s = Ss + kSt * (kSt + 1);
  float* l_s = m_s + kSt;
  float* alpha_s = l_s + kSt;
  int* qpos_s = reinterpret_cast<int*>(alpha_s + kSt);
  int* kpos_s = qpos_s + kSt;
  int* seen_s = kpos_s + kSt;

  const int tid = threadIdx.x;
  const int64_t n_qt = ceil_div(a.Sq, kSt), n_kt = ceil_div(a.Skv, kSt);
  const int64_t qt = n_qt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (a.Hq / a.Hkv);
  const int64_t i0 = qt * kSt, ldq = a.Hq * a.D, ldk = a.Hkv * a.D;
  const int nq = static_cast<int>(min(static_cast<int64_t>(kSt), a.Sq - i0));
  const T* Q = static_cast<const T*>(a.q) + ((b * a.Sq + i0) * a.Hq + h) * a.D;
  const T* K = static_cast<const T*>(a.k) + (b * a.Skv * a.Hkv + kvh) * a.D;
  const T* V = static_cast<const T*>(a.v) + (b * a.Skv * a.Hkv + kvh) * a.D;

  for (int e = tid; e < kSt * D; e += kSThreads) {
    const int r = e / D, c = e - r * D;
    Qs[r * ld + c] = r < nq ? to_f32(Q[r * ldq + c]) : 0.0f;
    Os[e] = 0.0f;
  }
  if (tid < kSt) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
    seen_s[tid] = 0;
    qpos_s[tid] = tid < nq ? a.q_pos[i0 + tid] : INT32_MIN;
  }
  const int2 qr = a.ranges.q[qt];
  const int ty = tid / 16, tx = tid % 16;      // S: rows 2ty, 2ty+1; columns tx, tx+16
  const int rr = tid / 8, sub = tid % 8;       // statistics: row rr, columns sub + 8k

  for (int64_t kt = 0; kt < n_kt; ++kt) {
    if (a.ranges.kv[kt].x > qr.y) continue;  // every key in every query's future
    const int64_t j0 = kt * kSt;
    const int nk = static_cast<int>(min(static_cast<int64_t>(kSt), a.Skv - j0));
    __syncthreads();  // the previous tile's readers are done (and the setup is visible)
    for (int e = tid; e < kSt * D; e += kSThreads) {
      const int r = e / D, c = e - r * D;
      const bool in = r < nk;
      Ks[r * ld + c] = in ? to_f32(K[(j0 + r) * ldk + c]) : 0.0f;
      Vs[e] = in ? to_f32(V[(j0 + r) * ldk + c]) : 0.0f;
    }
    if (tid < kSt) kpos_s[tid] = tid < nk ? a.kv_pos[j0 + tid] : kPosMax;
    __syncthreads();

    float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    const float* q0 = Qs + (2 * ty) * ld;
    const float* k0 = Ks + tx * ld;
    for (int d = 0; d < D; ++d) {
      const float x0 = q0[d], x1 = q0[ld + d], y0 = k0[d], y1 = k0[16 * ld + d];
      acc[0][0] = fmaf(x0, y0, acc[0][0]);
      acc[0][1] = fmaf(x0, y1, acc[0][1]);
      acc[1][0] = fmaf(x1, y0, acc[1][0]);
      acc[1][1] = fmaf(x1, y1, acc[1][1]);
    }
    for (int ri = 0; ri < 2; ++ri)
      for (int cj = 0; cj < 2; ++cj) {
        const int r = 2 * ty + ri, c = tx + 16 * cj;
        const bool visible = r < nq && c < nk && kpos_s[c] <= qpos_s[r];
        Ss[r * (kSt + 1) + c] = visible ? acc[ri][cj] * a.scale : -INFINITY;
        if (visible) seen_s[r] = 1;  // every writer stores the same value
      }
    __syncthreads();

    {
      float* s = Ss + rr * (kSt + 1);
      const float m_old = m_s[rr];
      float x[4], mx = -INFINITY;
      for (int k = 0; k < 4; ++k) mx = fmaxf(mx, x[k] = s[sub + 8 * k]);
      for (int off = 4; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: p = 0, not NaN
      float sum = 0.0f;
      for (int k = 0; k < 4; ++k) {
        const float p = expf(x[k] - m_use);
        s[sub + 8 * k] = p;
        sum += p;
      }
      for (int off = 4; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      // Every lane of the row has read m_s[rr] (m_old) before lane sub == 0
      // rewrites it: shuffles converge the lanes but do not order memory.
      __syncwarp();
      if (sub == 0) {
        const float alpha = expf(m_old - m_use);  // 0 while m_old is −inf
        m_s[rr] = m_new;
        l_s[rr] = l_s[rr] * alpha + sum;
        alpha_s[rr] = alpha;
      }
    }
    __syncthreads();

    for (int e = tid; e < kSt * D; e += kSThreads) {
      const int r = e / D, c = e - r * D;
      const float* p = Ss + r * (kSt + 1);
      float o = 0.0f;
      for (int j = 0; j < kSt; ++j) o = fmaf(p[j], Vs[j * D + c], o);
      Os[e] = Os[e] * alpha_s[r] + o;
    }
  }
  __syncthreads();

  T* O = static_cast<T*>(a.o) + ((b * a.Sq + i0) * a.Hq + h) * a.D;
  for (int e = tid; e < nq * D; e += kSThreads) {
    const int r = e / D, c = e - r * D;
    const float l = l_s[r];
    const float inv = l > 0.0f ? 1.0f / l : NAN;
    O[r * ldq + c] = from_f32<T>(seen_s[r] ? Os[e] * inv : 0.0f);
  }
  if (tid < nq) {
    const float l = l_s[tid];
    a.lse[(b * a.Hq + h) * a.Sq + i0 + tid] =
        seen_s[tid] ? (l > 0.0f ? m_s[tid] + logf(l) : NAN) : -INFINITY;
  }
}

// ---------------------------------------------------------------- tensor cores

// 128 × 64 tiles. At head_dim 128 a lane holds 128 accumulator and 64 score
// registers: ptxas (sm_90) uses 255 and spills 12 bytes; 32-key tiles spill
// nothing but double the per-tile overhead (barrier, row max shuffles,
// rescale) and the Q fragment reloads per key, so 64 it is (FA2's choice too).
constexpr int kMq = 128, kMk = 64, kMWarps = 4, kMThreads = kMWarps * 32;
constexpr int kMt = kMq / kMWarps / 16;  // m16 tiles per warp: 2
static_assert(kMq % kRangeRows == 0 && kMk % kRangeRows == 0);

template <int D> constexpr size_t fwd_mma_smem() {
  return static_cast<size_t>(kMq + 4 * kMk) * D * sizeof(bf16) + 2 * kMk * sizeof(int);
}

template <int D> __global__ void __launch_bounds__(kMThreads) fwd_mma_kernel(FwdArgs a) {
  constexpr int kKc = D / 16;   // k-chunks of the head dim
  constexpr int kNt = kMk / 8;  // n8 tiles of a score row block
  constexpr int kDt = D / 8;    // n8 tiles of an output row block
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sm = reinterpret_cast<bf16*>(smem_raw);
  const SwizzledTile<D> Qt{sm};
  bf16* kv_base = sm + kMq * D;  // K0, K1, V0, V1, each [kMk][D]
  int* kpos_s = reinterpret_cast<int*>(kv_base + 4 * kMk * D);  // [2][kMk]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = lane & 3, g = lane >> 2;
  const int64_t n_qt = ceil_div(a.Sq, kMq), n_kt = ceil_div(a.Skv, kMk);
  const int64_t n_qr = ceil_div(a.Sq, kRangeRows), n_kr = ceil_div(a.Skv, kRangeRows);
  const int64_t qt = n_qt - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (a.Hq / a.Hkv);
  const int64_t i0 = qt * kMq, ldq = a.Hq * D, ldk = a.Hkv * D;
  const bf16* Qh = static_cast<const bf16*>(a.q) + (b * a.Sq * a.Hq + h) * D;
  const bf16* Kh = static_cast<const bf16*>(a.k) + (b * a.Skv * a.Hkv + kvh) * D;
  const bf16* Vh = static_cast<const bf16*>(a.v) + (b * a.Skv * a.Hkv + kvh) * D;
  const int2 qr = fold_ranges(a.ranges.q, qt * (kMq / kRangeRows), kMq / kRangeRows, n_qr);
  const float scale_log2 = a.scale * kLog2e;

  int qp[kMt][2];  // positions of this lane's rows (g and g + 8 of each m-tile)
  for (int mt = 0; mt < kMt; ++mt)
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t i = i0 + warp * 32 + mt * 16 + g + 8 * hf;
      qp[mt][hf] = i < a.Sq ? a.q_pos[i] : INT32_MIN;
    }

  auto next_tile = [&](int64_t from) {
    for (int64_t kt = from; kt < n_kt; ++kt)
      if (fold_ranges(a.ranges.kv, kt * (kMk / kRangeRows), kMk / kRangeRows, n_kr).x <= qr.y) return kt;
    return n_kt;
  };
  auto load_kv = [&](int64_t kt, int buf) {
    const int64_t j0 = kt * kMk;
    load_tile_async<D, kMk>(SwizzledTile<D>{kv_base + buf * kMk * D}, Kh, ldk, j0, a.Skv, tid, kMThreads);
    load_tile_async<D, kMk>(SwizzledTile<D>{kv_base + (2 + buf) * kMk * D}, Vh, ldk, j0, a.Skv, tid, kMThreads);
    if (tid < kMk) kpos_s[buf * kMk + tid] = j0 + tid < a.Skv ? a.kv_pos[j0 + tid] : kPosMax;
  };

  load_tile_async<D, kMq>(Qt, Qh, ldq, i0, a.Sq, tid, kMThreads);
  int64_t kt = next_tile(0);
  if (kt < n_kt) load_kv(kt, 0);
  cp_async_commit();

  float o[kMt][kDt][4];
  float m[kMt][2], l[kMt][2];
  bool seen[kMt][2];
  for (int mt = 0; mt < kMt; ++mt) {
    for (int dt = 0; dt < kDt; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    for (int hf = 0; hf < 2; ++hf) m[mt][hf] = -INFINITY, l[mt][hf] = 0.0f, seen[mt][hf] = false;
  }

  int buf = 0;
  while (kt < n_kt) {
    const int64_t nxt = next_tile(kt + 1);
    cp_async_wait_all();
    __syncthreads();  // tile kt landed; every warp is done with buffer buf ^ 1
    if (nxt < n_kt) load_kv(nxt, buf ^ 1);
    cp_async_commit();

    const SwizzledTile<D> Kt{kv_base + buf * kMk * D}, Vt{kv_base + (2 + buf) * kMk * D};
    const int* kpos = kpos_s + buf * kMk;
    const int2 kr = fold_ranges(a.ranges.kv, kt * (kMk / kRangeRows), kMk / kRangeRows, n_kr);
    const bool need_mask = kr.y > qr.x || (kt + 1) * kMk > a.Skv;

    float s[kMt][kNt][4];
    for (int mt = 0; mt < kMt; ++mt)
      for (int nt = 0; nt < kNt; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < kKc; ++kc) {
      uint32_t qa[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) ldsm_a(qa[mt], Qt, warp * 32 + mt * 16, kc * 16, lane);
#pragma unroll
      for (int np = 0; np < kNt / 2; ++np) {
        uint32_t kb[4];
        ldsm_b_nk(kb, Kt, np * 16, kc * 16, lane);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          mma_bf16(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma_bf16(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {  // row g + 8·hf: accumulator elements 2hf, 2hf + 1
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          const int2 kp = need_mask ? *reinterpret_cast<const int2*>(kpos + nt * 8 + 2 * t) : make_int2(0, 0);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mt][nt][2 * hf + e] * scale_log2;
            if (need_mask) {
              if ((e ? kp.y : kp.x) > qp[mt][hf])
                x = -INFINITY;
              else
                seen[mt][hf] = true;
            }
            s[mt][nt][2 * hf + e] = x;
            mx = fmaxf(mx, x);
          }
        }
        if (!need_mask) seen[mt][hf] = true;
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][hf], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: p = 0, not NaN
        const float alpha = exp2f(m[mt][hf] - m_use);
        m[mt][hf] = m_new;
        float sum = 0.0f;  // this lane's columns; the quad is summed once at the end
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(s[mt][nt][2 * hf + e] - m_use);
            s[mt][nt][2 * hf + e] = p;
            sum += p;
          }
        l[mt][hf] = l[mt][hf] * alpha + sum;
        // Rescale only when some row of the warp moved its max (warp-uniform
        // branch; a factor of 1 is exact, so skipping it changes no bit).
        if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
          for (int dt = 0; dt < kDt; ++dt) o[mt][dt][2 * hf] *= alpha, o[mt][dt][2 * hf + 1] *= alpha;
        }
      }

#pragma unroll
    for (int kk = 0; kk < kMk / 16; ++kk) {
      uint32_t pa[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) c_to_a(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < kDt / 2; ++dp) {
        uint32_t vb[4];
        ldsm_b_kn(vb, Vt, kk * 16, dp * 16, lane);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          mma_bf16(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
          mma_bf16(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    buf ^= 1;
    kt = nxt;
  }
  cp_async_wait_all();
  __syncthreads();  // Q landed even when no tile ran; the Q rows are free for staging

  // Normalize into this warp's own rows of the Q tile (no other warp reads them).
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float lt = l[mt][hf];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      int sn = seen[mt][hf] ? 1 : 0;
      sn |= __shfl_xor_sync(0xffffffffu, sn, 1);
      sn |= __shfl_xor_sync(0xffffffffu, sn, 2);
      const float inv = sn ? (lt > 0.0f ? 1.0f / lt : NAN) : 0.0f;
      const int row = warp * 32 + mt * 16 + g + 8 * hf;
      // A row that sees no key writes 0, as the SIMT kernel and the CPU do,
      // not o * 0 (NaN when its tile met a non-finite V that other rows see).
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt)
        *reinterpret_cast<uint32_t*>(Qt.at(row, dt * 8) + 2 * t) =
            sn ? pack_bf16(o[mt][dt][2 * hf] * inv, o[mt][dt][2 * hf + 1] * inv) : pack_bf16(0.0f, 0.0f);
      if (t == 0 && i0 + row < a.Sq)
        a.lse[(b * a.Hq + h) * a.Sq + i0 + row] =
            sn ? (lt > 0.0f ? (m[mt][hf] + log2f(lt)) * kLn2 : NAN) : -INFINITY;
    }
  __syncwarp();
  bf16* Oh = static_cast<bf16*>(a.o) + (b * a.Sq * a.Hq + h) * D;
  for (int c = lane; c < 32 * (D / 8); c += 32) {
    const int r = warp * 32 + c / (D / 8), col = (c % (D / 8)) * 8;
    if (i0 + r < a.Sq)
      *reinterpret_cast<uint4*>(Oh + (i0 + r) * ldq + col) = *reinterpret_cast<const uint4*>(Qt.at(r, col));
  }
}

void check_grid(int64_t x, const FwdArgs& a) {
  ORIGAMI_CHECK(x < (int64_t(1) << 31) && a.Hq <= 65535 && a.B <= 65535, "attention grid too large: ", x, " tiles, ",
                a.Hq, " heads, batch ", a.B);
}

template <int D> void launch_mma(const FwdArgs& a, cudaStream_t s) {
  constexpr size_t smem = fwd_mma_smem<D>();
  allow_smem(reinterpret_cast<const void*>(&fwd_mma_kernel<D>), smem, "attention_forward (bf16 tensor cores)");
  const int64_t n_qt = ceil_div(a.Sq, kMq);
  check_grid(n_qt, a);
  fwd_mma_kernel<D><<<dim3(static_cast<unsigned>(n_qt), static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B)),
                      kMThreads, smem, s>>>(a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

template <class T> void launch_forward_simt(const FwdArgs& a, cudaStream_t s) {
  const size_t smem = fwd_simt_smem(a.D);
  allow_smem(reinterpret_cast<const void*>(&fwd_simt_kernel<T>), smem, "attention_forward (SIMT)");
  const int64_t n_qt = ceil_div(a.Sq, kSt);
  check_grid(n_qt, a);
  fwd_simt_kernel<T><<<dim3(static_cast<unsigned>(n_qt), static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B)),
                       kSThreads, smem, s>>>(a);
  CUDA_CHECK_LAUNCH();
}
template void launch_forward_simt<float>(const FwdArgs&, cudaStream_t);
template void launch_forward_simt<bf16>(const FwdArgs&, cudaStream_t);

void launch_forward_mma(const FwdArgs& a, cudaStream_t s) {
  if (a.D == 64)
    launch_mma<64>(a, s);
  else
    launch_mma<128>(a, s);
}

}  // namespace origami::cuda::attn
