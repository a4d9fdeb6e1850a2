// CPU causal GQA attention, FlashAttention-2 style, on oneDNN tile GEMMs
// (sgemm_raw, single-threaded inside our parallel region) and vf16 row code.
// Forward: tiles of kTileQ queries × kTileK keys with an online softmax.
// Backward: probabilities recomputed from the saved log-sum-exp, one key tile
// at a time against every query row that sees it. Scratch lives in the
// caller's workspace and is O(seq · tile) per thread plus Kᵀ for the
// forward; there is never an S×S buffer.
//
// Forward reads Kᵀ, prepared once per call: oneDNN runs 64-row "A·Bᵀ" tile
// products at about half the rate of "A·B" (measured 64×64×64: 6.4 µs vs
// 3.6 µs on one core).
//
// Masking is by explicit positions (context parallelism hands a rank
// non-contiguous chunks): a key tile is skipped when its smallest position
// exceeds every query's, and is mask-free when its largest position is <=
// every query's. A query row before every key (ring attention's blocks) is
// decided by positions too: o = 0, lse = −inf in forward, nothing in backward.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/gemm.h"
#include "kernels/op_shapes.h"

namespace origami::cpu {

namespace {

// Forward tiles, measured on the 2-core AVX-512 box (hd 64, one thread):
// kTileK 128 beat 64 by ~8% at S = 1024 (fewer oneDNN calls, each with fixed
// overhead). Query rows that precede every key of a tile are trimmed from its
// GEMMs, so a tall query tile wastes nothing on causal diagonals; 128 rows
// beat 64 by ~3% and tied with 256.
constexpr int64_t kTileQ = 128;
constexpr int64_t kTileK = 128;
constexpr int kLanes = cpu::kVecLanes;
static_assert(kTileK % kLanes == 0);
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }  // 64-byte spacing: no false sharing

// Forward workspace = [Kᵀ: B·Hkv·hd·Skv] then one scratch slot per thread.
int64_t kv_transposed(const AttentionDims& d) {
  return round_up16(d.batch * d.num_kv_heads * d.head_dim * d.kv_len);
}
int64_t forward_per_thread(const AttentionDims& d) {
  return round_up16(kTileQ * kTileK) + round_up16(kTileQ * d.head_dim) + round_up16(kTileQ) + kTileQ * kLanes;
}
// Backward: [D = rowsum(dO ⊙ O): B·Hq·Sq] then per thread P and dS for every
// query row against one key tile.
int64_t backward_fixed(const AttentionDims& d) { return round_up16(d.batch * d.num_heads * d.q_len); }
int64_t backward_per_thread(const AttentionDims& d) { return 2 * round_up16(d.q_len * kTileK); }

// src [rows, stride ld_src] -> dst [cols, stride ld_dst], in 16×16 blocks:
// head rows sit a power-of-two stride apart, so walking a whole column would
// map every row to the same few L1 sets and miss on each element (measured
// 6x slower than blocked).
void transpose_block(const float* __restrict src, int64_t ld_src, int64_t rows, int64_t cols,
                     float* __restrict dst, int64_t ld_dst) {
  constexpr int64_t kB = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kB)
    for (int64_t c0 = 0; c0 < cols; c0 += kB) {
      const int64_t nr = std::min(kB, rows - r0), nc = std::min(kB, cols - c0);
      float blk[kB][kB];
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t c = 0; c < nc; ++c) blk[c][r] = src[(r0 + r) * ld_src + c0 + c];
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t r = 0; r < nr; ++r) dst[(c0 + c) * ld_dst + r0 + r] = blk[c][r];
    }
}

// x: [B, S, H, hd] -> xt: [B, H, hd, S], 64 sequence rows per work item.
void transpose_heads(const float* x, float* xt, int64_t B, int64_t S, int64_t H, int64_t hd) {
  constexpr int64_t kRows = 64;
  const int64_t n_sb = (S + kRows - 1) / kRows;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < B * H * n_sb; ++item) {
    const int64_t sb = item % n_sb, h = (item / n_sb) % H, b = item / (n_sb * H);
    const int64_t s0 = sb * kRows;
    transpose_block(x + ((b * S + s0) * H + h) * hd, H * hd, std::min(kRows, S - s0), hd,
                    xt + (b * H + h) * hd * S + s0, S);
  }
}

struct PosRange {
  int32_t lo, hi;
};
PosRange pos_range(const int32_t* pos, int64_t n) {
  PosRange r{pos[0], pos[0]};
  for (int64_t i = 1; i < n; ++i) {
    r.lo = std::min(r.lo, pos[i]);
    r.hi = std::max(r.hi, pos[i]);
  }
  return r;
}

// Returns the smallest key position: a query before it sees no key.
int32_t check_inputs(const AttentionDims& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_pos,
                     const Tensor& kv_pos) {
  attention_input_shapes(d, q, k, v, q_pos, kv_pos);
  ORIGAMI_CHECK(q.dtype() == DType::f32 && k.dtype() == DType::f32 && v.dtype() == DType::f32,
                "CPU attention is fp32");
  // Whether a query sees any key is a property of the positions alone, so it
  // is decided from them, never from the scores (non-finite scores of a
  // diverged run flow through to the loss, where the trainer stops cleanly).
  const int32_t* kp = kv_pos.i32();
  return *std::min_element(kp, kp + d.kv_len);
}

// Threads to use given the workspace the caller sized for this context
// (*_workspace_bytes): the context's count, fewer if the workspace is short.
int threads_for(const ExecContext& ctx, const Tensor& workspace, int64_t fixed, int64_t per_thread, const char* what) {
  ORIGAMI_CHECK(workspace.defined(), what, " without a workspace");
  const int64_t floats = static_cast<int64_t>(workspace.nbytes() / sizeof(float));
  const int64_t fit = (floats - fixed) / per_thread;
  ORIGAMI_CHECK(fit >= 1, what, " workspace has ", workspace.nbytes(), " bytes, needs at least ",
                (fixed + per_thread) * 4);
  return static_cast<int>(std::min<int64_t>(fit, ctx.threads()));
}

// Row helpers work on whole kTileK-wide rows so every loop has a constant trip
// count and vectorizes without remainder code (with a runtime count GCC kept
// a scalar max loop that cost more than the tile GEMMs). Columns past the
// tile's last key carry position INT32_MAX, so masking turns them into -inf
// and they drop out of max and sum.
struct KeyTile {
  alignas(64) int32_t pos[kTileK];
  int64_t j0, nk;
  PosRange range;
};
KeyTile key_tile(const int32_t* kpos, int64_t j0, int64_t Skv) {
  KeyTile t;
  t.j0 = j0;
  t.nk = std::min(kTileK, Skv - j0);
  t.range = pos_range(kpos + j0, t.nk);
  for (int64_t c = 0; c < kTileK; ++c) t.pos[c] = c < t.nk ? kpos[j0 + c] : std::numeric_limits<int32_t>::max();
  return t;
}

// Keys later than the query become -inf (also overwrites any garbage, NaN
// included, in padding columns that the tile GEMM did not write).
inline void mask_row(float* __restrict s, const int32_t* __restrict kpos, int32_t qp) {
  const cpu::vi16 q = cpu::splat_i(qp);
  const cpu::vf16 ninf = cpu::splat(kNegInf);
  for (int64_t c = 0; c < kTileK; c += kLanes)
    cpu::store(s + c, cpu::load_i(kpos + c) > q ? ninf : cpu::load(s + c));
}

inline float row_max(const float* __restrict s) {
  cpu::vf16 m = cpu::load(s);
  for (int64_t c = kLanes; c < kTileK; c += kLanes) m = cpu::vmax(m, cpu::load(s + c));
  return cpu::hmax(m);
}

// s = exp(s − sub) in place.
inline void row_exp(float* __restrict s, float sub) {
  for (int64_t c = 0; c < kTileK; c += kLanes) cpu::store(s + c, cpu::exp_fast(cpu::load(s + c) - sub));
}

// s = exp(s − sub) in place, and lanes = lanes·alpha + per-lane sums of s.
// The softmax denominator stays as kLanes partial sums per row and is reduced
// once after the last key tile: a horizontal sum per row and tile costs as
// much as the row's exps.
inline void row_exp_accumulate(float* __restrict s, float sub, float alpha, float* __restrict lanes) {
  cpu::vf16 acc = cpu::load(lanes) * alpha;
  for (int64_t c = 0; c < kTileK; c += kLanes) {
    const cpu::vf16 e = cpu::exp_fast(cpu::load(s + c) - sub);
    cpu::store(s + c, e);
    acc += e;
  }
  cpu::store(lanes, acc);
}

// ds = p ⊙ (ds − D) over a whole row.
inline void row_dsoftmax(const float* __restrict p, float* __restrict ds, float D) {
  for (int64_t c = 0; c < kTileK; c += kLanes) cpu::store(ds + c, cpu::load(p + c) * (cpu::load(ds + c) - D));
}

}  // namespace

size_t attention_forward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims) {
  attention_dims_check(dims);
  return static_cast<size_t>(kv_transposed(dims) + ctx.threads() * forward_per_thread(dims)) * sizeof(float);
}

size_t attention_backward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims) {
  attention_dims_check(dims);
  return static_cast<size_t>(backward_fixed(dims) + ctx.threads() * backward_per_thread(dims)) * sizeof(float);
}

void attention_forward(const ExecContext& ctx, const AttentionDims& d, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& o,
                       Tensor& lse_BHS, Tensor& workspace) {
  const int32_t first_key = check_inputs(d, q, k, v, q_pos_S, kv_pos_S);
  attention_output_shapes(d, o, lse_BHS);
  const int64_t per_thread = forward_per_thread(d);
  const int64_t kt_size = kv_transposed(d);
  const int nthr = threads_for(ctx, workspace, kt_size, per_thread, "attention_forward");

  const int64_t B = d.batch, Sq = d.q_len, Skv = d.kv_len, Hq = d.num_heads, Hkv = d.num_kv_heads,
                hd = d.head_dim, group = Hq / Hkv;
  const int64_t ldq = Hq * hd, ldk = Hkv * hd;  // row strides of one head's [S, hd] slice
  const int64_t n_qt = (Sq + kTileQ - 1) / kTileQ;
  const float* qd = q.f32();
  const float* kd = k.f32();
  const float* vd = v.f32();
  const int32_t* qpos = q_pos_S.i32();
  const int32_t* kpos = kv_pos_S.i32();
  float* od = o.f32();
  float* lsed = lse_BHS.f32();
  float* Kt_all = static_cast<float*>(workspace.raw());  // [B, Hkv, hd, Skv]
  float* ws = Kt_all + kt_size;
  transpose_heads(kd, Kt_all, B, Skv, Hkv, hd);

#pragma omp parallel num_threads(nthr)
  {
    float* base = ws + omp_get_thread_num() * per_thread;
    float* S = base;                                   // [kTileQ, kTileK] scores, then probabilities
    float* acc = S + round_up16(kTileQ * kTileK);      // [kTileQ, hd] unnormalized output
    float* m = acc + round_up16(kTileQ * hd);          // [kTileQ] running max
    float* l = m + round_up16(kTileQ);                 // [kTileQ, kLanes] running denominator, by lane

    // Causal tiles differ in cost; dynamic scheduling balances them.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hq * n_qt; ++item) {
      const int64_t qt = item % n_qt, h = (item / n_qt) % Hq, b = item / (n_qt * Hq);
      const int64_t i0 = qt * kTileQ, nq = std::min(kTileQ, Sq - i0);
      const int64_t kvh = h / group;
      const float* Q = qd + ((b * Sq + i0) * Hq + h) * hd;
      const float* Kt = Kt_all + (b * Hkv + kvh) * hd * Skv;
      const float* V = vd + (b * Skv * Hkv + kvh) * hd;
      const PosRange qr = pos_range(qpos + i0, nq);
      std::fill(m, m + nq, kNegInf);
      std::fill(l, l + nq * kLanes, 0.0f);
      std::fill(acc, acc + nq * hd, 0.0f);

      for (int64_t j0 = 0; j0 < Skv; j0 += kTileK) {
        const KeyTile kt = key_tile(kpos, j0, Skv);
        const int64_t nk = kt.nk;
        if (kt.range.lo > qr.hi) continue;  // every key of the tile is in every query's future
        int64_t r0 = 0;  // rows before r0 see no key of this tile (exact skip when positions ascend)
        while (qpos[i0 + r0] < kt.range.lo) ++r0;
        sgemm_raw(Trans::no, Trans::no, nq - r0, nk, hd, scale, Q + r0 * ldq, ldq, Kt + j0, Skv, 0.0f,
                  S + r0 * kTileK, kTileK);
        for (int64_t r = r0; r < nq; ++r) {
          float* __restrict s = S + r * kTileK;
          if (kt.range.hi > qpos[i0 + r] || nk < kTileK) mask_row(s, kt.pos, qpos[i0 + r]);
          const float m_new = std::max(m[r], row_max(s));
          if (m_new == kNegInf) {  // no visible key yet for this row: contributes nothing
            std::fill(s, s + kTileK, 0.0f);
            continue;
          }
          const float alpha = cpu::exp_fast(m[r] - m_new);  // 0 when m[r] is -inf
          row_exp_accumulate(s, m_new, alpha, l + r * kLanes);
          if (alpha != 1.0f) {
            float* __restrict a = acc + r * hd;
            for (int64_t c = 0; c < hd; ++c) a[c] *= alpha;
          }
          m[r] = m_new;
        }
        sgemm_raw(Trans::no, Trans::no, nq - r0, hd, nk, 1.0f, S + r0 * kTileK, kTileK, V + j0 * ldk, ldk, 1.0f,
                  acc + r0 * hd, hd);
      }

      for (int64_t r = 0; r < nq; ++r) {
        float* __restrict out = od + ((b * Sq + i0 + r) * Hq + h) * hd;
        float& lse = lsed[(b * Hq + h) * Sq + i0 + r];
        if (qpos[i0 + r] < first_key) {  // sees no key: the empty softmax
          std::fill(out, out + hd, 0.0f);
          lse = kNegInf;
          continue;
        }
        // The row sees a key, so denom > 0 unless the scores are not finite:
        // then the row is NaN, which the loss reports.
        float denom = cpu::hsum(cpu::load(l + r * kLanes));
        if (!(denom > 0.0f)) denom = std::numeric_limits<float>::quiet_NaN();
        const float inv = 1.0f / denom;
        const float* __restrict a = acc + r * hd;
        for (int64_t c = 0; c < hd; ++c) out[c] = a[c] * inv;
        lse = m[r] + std::log(denom);
      }
    }
  }
}

// Backward, per work item (batch, kv head), per key tile j, per q head of the
// group: all query rows that can see the tile form one block, so the five
// products are single GEMMs with the sequence as M or K instead of many
// 64-row tile GEMMs (oneDNN runs those ~15% slower, and per-call overhead
// adds up). At these sizes oneDNN's A·Bᵀ runs as fast as A·B (measured), so
// unlike the forward no transposed copies are needed:
//   P  = exp(scale·Q Kⱼᵀ − lse)        dVⱼ += Pᵀ dO
//   dP = dO Vⱼᵀ,  dS = P ⊙ (dP − D)    dQ  += scale·dS Kⱼ,  dKⱼ += scale·dSᵀ Q
// The item owns dK, dV of its kv head and dQ of its q-head group, so items
// never write the same memory: no atomics, no reduction, and the result does
// not depend on the thread count.
void attention_backward(const ExecContext& ctx, const AttentionDims& d, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                        const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                        Tensor& workspace) {
  const int32_t first_key = check_inputs(d, q, k, v, q_pos_S, kv_pos_S);
  attention_grad_shapes(d, o, lse_BHS, do_, dq, dk, dv);
  const int64_t per_thread = backward_per_thread(d), fixed = backward_fixed(d);
  const int nthr = threads_for(ctx, workspace, fixed, per_thread, "attention_backward");

  const int64_t B = d.batch, Sq = d.q_len, Skv = d.kv_len, Hq = d.num_heads, Hkv = d.num_kv_heads,
                hd = d.head_dim, group = Hq / Hkv;
  const int64_t ldq = Hq * hd, ldk = Hkv * hd;
  const float* qd = q.f32();
  const float* kd = k.f32();
  const float* vd = v.f32();
  const float* odat = o.f32();
  const float* dod = do_.f32();
  const float* lsed = lse_BHS.f32();
  const int32_t* qpos = q_pos_S.i32();
  const int32_t* kpos = kv_pos_S.i32();
  float* dqd = dq.f32();
  float* dkd = dk.f32();
  float* dvd = dv.f32();
  float* Dall = static_cast<float*>(workspace.raw());  // [B, Hq, Sq] rowsum(dO ⊙ O)
  float* ws = Dall + fixed;

  // D and the zeroed dQ first: both are per query row.
#pragma omp parallel for schedule(static) num_threads(nthr)
  for (int64_t row = 0; row < B * Sq; ++row) {
    const int64_t b = row / Sq, i = row % Sq;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t off = ((b * Sq + i) * Hq + h) * hd;
      const float* __restrict a = odat + off;
      const float* __restrict g = dod + off;
      float dsum = 0.0f;
#pragma omp simd reduction(+ : dsum)
      for (int64_t c = 0; c < hd; ++c) dsum += a[c] * g[c];
      Dall[(b * Hq + h) * Sq + i] = dsum;
      std::fill_n(dqd + off, hd, 0.0f);
    }
  }

#pragma omp parallel num_threads(nthr)
  {
    float* base = ws + omp_get_thread_num() * per_thread;
    float* P = base;                                // [Sq, kTileK] probabilities
    float* dS = P + round_up16(Sq * kTileK);        // [Sq, kTileK] dP, then dS

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hkv; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv;
      const int64_t kv_off = (b * Skv * Hkv + kvh) * hd;
      for (int64_t j0 = 0; j0 < Skv; j0 += kTileK) {
        const KeyTile kt = key_tile(kpos, j0, Skv);
        const int64_t nk = kt.nk;
        const float* Kj = kd + kv_off + j0 * ldk;
        const float* Vj = vd + kv_off + j0 * ldk;
        float* dKj = dkd + kv_off + j0 * ldk;
        float* dVj = dvd + kv_off + j0 * ldk;
        for (int64_t r = 0; r < nk; ++r) {
          std::fill_n(dKj + r * ldk, hd, 0.0f);
          std::fill_n(dVj + r * ldk, hd, 0.0f);
        }
        // Rows before the first query that sees any key of the tile are skipped;
        // later fully-masked rows (unsorted positions) get P = 0 from the mask.
        int64_t r0 = 0;
        while (r0 < Sq && qpos[r0] < kt.range.lo) ++r0;
        if (r0 == Sq) continue;
        const int64_t nr = Sq - r0;

        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          const int64_t q_off = (b * Sq * Hq + h) * hd + r0 * ldq;
          const float* Q = qd + q_off;
          const float* dO = dod + q_off;
          const float* lse = lsed + (b * Hq + h) * Sq + r0;
          const float* D = Dall + (b * Hq + h) * Sq + r0;

          sgemm_raw(Trans::no, Trans::yes, nr, nk, hd, scale, Q, ldq, Kj, ldk, 0.0f, P, kTileK);
          for (int64_t r = 0; r < nr; ++r) {
            float* p = P + r * kTileK;
            if (qpos[r0 + r] < first_key) {  // a row before every key (lse −inf): no probability
              std::fill(p, p + kTileK, 0.0f);
              continue;
            }
            if (kt.range.hi > qpos[r0 + r] || nk < kTileK) mask_row(p, kt.pos, qpos[r0 + r]);
            row_exp(p, lse[r]);
          }
          sgemm_raw(Trans::yes, Trans::no, nk, hd, nr, 1.0f, P, kTileK, dO, ldq, 1.0f, dVj, ldk);
          sgemm_raw(Trans::no, Trans::yes, nr, nk, hd, 1.0f, dO, ldq, Vj, ldk, 0.0f, dS, kTileK);
          for (int64_t r = 0; r < nr; ++r) row_dsoftmax(P + r * kTileK, dS + r * kTileK, D[r]);
          sgemm_raw(Trans::no, Trans::no, nr, hd, nk, scale, dS, kTileK, Kj, ldk, 1.0f, dqd + q_off, ldq);
          sgemm_raw(Trans::yes, Trans::no, nk, hd, nr, scale, dS, kTileK, Q, ldq, 1.0f, dKj, ldk);
        }
      }
    }
  }
}

// Merge, per (batch, query, head) row: weights from the two log-sum-exps in
// double (one exp each, relative to their max so neither overflows), the row
// blended in fp32. Rows are independent, so the result does not depend on
// the thread count.
void attention_merge(const ExecContext& ctx, const Tensor& o_part, const Tensor& lse_part, Tensor& o_acc,
                     Tensor& lse_acc) {
  ORIGAMI_CHECK(o_acc.dim() == 4 && lse_acc.dim() == 3, "attention_merge: o must be [B, Sq, Hq, hd], lse [B, Hq, Sq]");
  const int64_t B = o_acc.size(0), Sq = o_acc.size(1), Hq = o_acc.size(2), hd = o_acc.size(3);
  check_shape(o_part, o_acc.shape(), "attention_merge o_part");
  check_shape(lse_acc, {B, Hq, Sq}, "attention_merge lse_acc");
  check_shape(lse_part, {B, Hq, Sq}, "attention_merge lse_part");
  ORIGAMI_CHECK(o_part.dtype() == DType::f32 && o_acc.dtype() == DType::f32 && lse_part.dtype() == DType::f32 &&
                    lse_acc.dtype() == DType::f32,
                "CPU attention_merge is fp32");
  const float* op = o_part.f32();
  const float* lp = lse_part.f32();
  float* oa = o_acc.f32();
  float* la = lse_acc.f32();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * Sq; ++row) {
    const int64_t b = row / Sq, i = row % Sq;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t l_at = (b * Hq + h) * Sq + i, o_at = ((b * Sq + i) * Hq + h) * hd;
      const double part = lp[l_at], acc = la[l_at];
      if (part == -INFINITY) continue;  // nothing to add
      float* __restrict dst = oa + o_at;
      const float* __restrict src = op + o_at;
      if (acc == -INFINITY) {  // nothing yet: the part as it is
        std::copy(src, src + hd, dst);
        la[l_at] = lp[l_at];
        continue;
      }
      const double m = std::max(part, acc);
      const double w_acc = std::exp(acc - m), w_part = std::exp(part - m), sum = w_acc + w_part;
      const float a = static_cast<float>(w_acc / sum), c = static_cast<float>(w_part / sum);
      for (int64_t e = 0; e < hd; ++e) dst[e] = a * dst[e] + c * src[e];
      la[l_at] = static_cast<float>(m + std::log(sum));
    }
  }
}

}  // namespace origami::cpu
