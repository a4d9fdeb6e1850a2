// CPU MoE routing ops (see moe_ops.h; the statistics and the bias update are
// in cpu/moe_stats.cpp). Per-token work (scores, top-k, their backward, row
// copies) is split over tokens with OpenMP; each token writes
// only its own rows, so results never depend on the thread count. The O(T·k)
// integer passes (histogram, capacity, row maps) are serial: at bench sizes
// (T·k = 8192) they take microseconds, less than waking a thread team, and a
// serial token-major walk gives the documented order for free.
// E is small (8..256), so top-k is an insertion into a k-long sorted list:
// one pass over E, strict '>' comparisons keep the lower index on ties.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/op_shapes.h"

namespace origami::cpu {

namespace {

constexpr float kNormEps = kMoeNormEps;

// Inserts (v, idx) into the descending list (bv, bi) of length n if it beats
// the last entry. Equal values do not move ahead of earlier (lower) indices.
inline void insert_top(float v, int32_t idx, float* bv, int32_t* bi, int64_t n) {
  if (!(v > bv[n - 1])) return;
  int64_t pos = n - 1;
  while (pos > 0 && bv[pos - 1] < v) {
    bv[pos] = bv[pos - 1];
    bi[pos] = bi[pos - 1];
    --pos;
  }
  bv[pos] = v;
  bi[pos] = idx;
}

inline void reset_top(float* bv, int32_t* bi, int64_t n) {
  std::fill(bv, bv + n, -std::numeric_limits<float>::infinity());
  std::fill(bi, bi + n, -1);
}

// Row max and Σ exp(z − max), the pieces of softmax and logsumexp.
inline void softmax_pieces(const float* __restrict z, int64_t E, float& mx, float& se) {
  mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, z[e]);
  se = 0.0f;
#pragma omp simd reduction(+ : se)
  for (int64_t e = 0; e < E; ++e) se += cpu::exp_fast(z[e] - mx);
}

void check_kept(const Tensor& kept_TK, const Tensor& expert_TK) {
  if (!kept_TK.defined()) return;
  ORIGAMI_CHECK(kept_TK.dtype() == DType::u8, "kept_TK must be u8");
  check_shape(kept_TK, expert_TK.shape(), "kept_TK");
}

}  // namespace

void moe_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                      Tensor& scores_TE, Tensor& expert_TK, Tensor& weight_TK, Tensor& lse_T) {
  moe_topk_forward_shapes(logits_TE, bias_E, p, scores_TE, expert_TK, weight_TK, lse_T);
  const int64_t T = logits_TE.rows(), E = logits_TE.cols(), K = p.top_k;
  const float* logits = logits_TE.f32();
  const float* bias = bias_E.defined() ? bias_E.f32() : nullptr;
  float* scores = scores_TE.f32();
  int32_t* experts = expert_TK.i32();
  float* weights = weight_TK.f32();
  float* lse = lse_T.defined() ? lse_T.f32() : nullptr;
  const int64_t G = p.num_groups, Eg = E / G, gk = p.group_topk, m = K / std::max<int64_t>(gk, 1);
  const int64_t nbuf = std::max({K, m, gk});
#pragma omp parallel
  {
    std::vector<float> sel(E), gscore(G), bv(nbuf);
    std::vector<int32_t> bi(nbuf);
    std::vector<uint8_t> group_kept(G);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* __restrict z = logits + t * E;
      float* __restrict s = scores + t * E;
      float mx = 0.0f, se = 0.0f;
      if (p.score_function == MoeScore::softmax || lse) softmax_pieces(z, E, mx, se);
      if (p.score_function == MoeScore::softmax) {
        const float inv = 1.0f / se;
#pragma omp simd
        for (int64_t e = 0; e < E; ++e) s[e] = cpu::exp_fast(z[e] - mx) * inv;
      } else {
#pragma omp simd
        for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + cpu::exp_fast(-z[e]));
      }
      if (lse) lse[t] = mx + std::log(se);
      for (int64_t e = 0; e < E; ++e) sel[e] = s[e] + (bias ? bias[e] : 0.0f);

      if (G > 1) {
        // Group score: sum of the group's top m selection values (Megatron).
        for (int64_t g = 0; g < G; ++g) {
          reset_top(bv.data(), bi.data(), m);
          for (int64_t e = g * Eg; e < (g + 1) * Eg; ++e) insert_top(sel[e], static_cast<int32_t>(e), bv.data(), bi.data(), m);
          float sum = 0.0f;
          for (int64_t i = 0; i < m; ++i) sum += bv[i];
          gscore[g] = sum;
        }
        reset_top(bv.data(), bi.data(), gk);
        for (int64_t g = 0; g < G; ++g) insert_top(gscore[g], static_cast<int32_t>(g), bv.data(), bi.data(), gk);
        // Mask the groups not kept: -inf never beats the list's -inf sentinel.
        std::fill(group_kept.begin(), group_kept.end(), 0);
        for (int64_t i = 0; i < gk; ++i)
          if (bi[i] >= 0) group_kept[bi[i]] = 1;
        for (int64_t g = 0; g < G; ++g)
          if (!group_kept[g])
            std::fill(sel.begin() + g * Eg, sel.begin() + (g + 1) * Eg, -std::numeric_limits<float>::infinity());
      }

      reset_top(bv.data(), bi.data(), K);
      for (int64_t e = 0; e < E; ++e) insert_top(sel[e], static_cast<int32_t>(e), bv.data(), bi.data(), K);
      float* __restrict w = weights + t * K;
      if (bi[K - 1] < 0) {
        // Non-finite scores (a diverged run): route to the first experts not
        // yet chosen so every index stays valid downstream, and make the
        // weights NaN so the loss reports the divergence.
        for (int64_t j = 0, e = 0; j < K; ++j) {
          if (bi[j] >= 0) continue;
          while (std::find(bi.begin(), bi.begin() + K, static_cast<int32_t>(e)) != bi.begin() + K) ++e;
          bi[j] = static_cast<int32_t>(e);
        }
        for (int64_t j = 0; j < K; ++j) {
          experts[t * K + j] = bi[j];
          w[j] = std::numeric_limits<float>::quiet_NaN();
        }
        continue;
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        experts[t * K + j] = bi[j];
        w[j] = s[bi[j]];
        sum += w[j];
      }
      const float scale = p.normalize_topk ? p.scaling_f32() / (sum + kNormEps) : p.scaling_f32();
      for (int64_t j = 0; j < K; ++j) w[j] *= scale;
    }
  }
}

// Chain rule per token, with the selection fixed:
//   g = ∂f/∂s:  weights: p_j = c·s_ej (/ (Σ s_ej + ε) if normalized) gives
//               g_ei += c/(Σ+ε)·(R_i − Σ_j R_j·s_ej/(Σ+ε)), or c·R_i;
//               aux through s' (sigmoid: s'_e = s_e / N) gives (a_e − Σ a·s')/N.
//   ∂f/∂z:      softmax s_e(g_e − Σ g·s); sigmoid g_e·s_e(1 − s_e);
//               z-loss 2·z_coef·lse·softmax(z)_e.
void moe_topk_backward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& scores_TE,
                       const Tensor& expert_TK, const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len,
                       float z_coef, const MoeTopkParams& p, Tensor& dlogits_TE) {
  moe_topk_backward_shapes(logits_TE, scores_TE, expert_TK, dweight_TK, aux_SE, seg_len, p, dlogits_TE);
  const int64_t T = logits_TE.rows(), E = logits_TE.cols(), K = p.top_k;
  const float* logits = logits_TE.f32();
  const float* scores = scores_TE.f32();
  const int32_t* experts = expert_TK.i32();
  const float* dweight = dweight_TK.defined() ? dweight_TK.f32() : nullptr;
  const float* aux = aux_SE.defined() ? aux_SE.f32() : nullptr;
  float* dlogits = dlogits_TE.f32();
  const float scaling = p.scaling_f32();
#pragma omp parallel
  {
    std::vector<float> g(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* __restrict s = scores + t * E;
      const int32_t* sel = experts + t * K;
      std::fill(g.begin(), g.end(), 0.0f);
      if (dweight) {
        const float* R = dweight + t * K;
        if (p.normalize_topk) {
          float sum = 0.0f, rs = 0.0f;
          for (int64_t j = 0; j < K; ++j) sum += s[sel[j]];
          const float den = sum + kNormEps;
          for (int64_t j = 0; j < K; ++j) rs += R[j] * s[sel[j]];
          rs /= den;
          for (int64_t j = 0; j < K; ++j) g[sel[j]] += scaling / den * (R[j] - rs);
        } else {
          for (int64_t j = 0; j < K; ++j) g[sel[j]] += scaling * R[j];
        }
      }
      if (aux) {
        const float* a = aux + (t / seg_len) * E;
        if (p.score_function == MoeScore::softmax) {
          for (int64_t e = 0; e < E; ++e) g[e] += a[e];
        } else {
          float tot = 0.0f, as = 0.0f;
          for (int64_t e = 0; e < E; ++e) tot += s[e];
          const float inv = 1.0f / (tot + kNormEps);
          for (int64_t e = 0; e < E; ++e) as += a[e] * s[e] * inv;
          for (int64_t e = 0; e < E; ++e) g[e] += (a[e] - as) * inv;
        }
      }
      float* __restrict dz = dlogits + t * E;
      if (p.score_function == MoeScore::softmax) {
        float gs = 0.0f;
        for (int64_t e = 0; e < E; ++e) gs += g[e] * s[e];
        for (int64_t e = 0; e < E; ++e) dz[e] = s[e] * (g[e] - gs);
      } else {
        for (int64_t e = 0; e < E; ++e) dz[e] = g[e] * s[e] * (1.0f - s[e]);
      }
      if (z_coef != 0.0f) {
        const float* __restrict z = logits + t * E;
        float mx, se;
        softmax_pieces(z, E, mx, se);
        const float lse = mx + std::log(se);
        const float c = 2.0f * z_coef * lse / se;
#pragma omp simd
        for (int64_t e = 0; e < E; ++e) dz[e] += c * cpu::exp_fast(z[e] - mx);
      }
    }
  }
}

void moe_expert_histogram(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, int64_t E,
                          Tensor& count_E) {
  ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32, "expert_TK must be i32");
  check_kept(kept_TK, expert_TK);
  ORIGAMI_CHECK(count_E.defined() && count_E.dtype() == DType::i64, "count_E must be i64");
  check_shape(count_E, {E}, "count_E");
  const int64_t n = expert_TK.numel();
  const int32_t* ex = expert_TK.i32();
  const uint8_t* kept = kept_TK.defined() ? kept_TK.data<uint8_t>() : nullptr;
  int64_t* cnt = count_E.data<int64_t>();
  std::fill(cnt, cnt + E, 0);
  for (int64_t i = 0; i < n; ++i) {
    ORIGAMI_CHECK(ex[i] >= 0 && ex[i] < E, "expert index ", ex[i], " at slot ", i, " is outside [0, ", E, ")");
    if (!kept || kept[i]) ++cnt[ex[i]];
  }
}

void moe_capacity_mask(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& weight_TK, int64_t E,
                       int64_t capacity, MoeDrop policy, Tensor& kept_TK) {
  ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32, "expert_TK must be i32");
  ORIGAMI_CHECK(kept_TK.defined() && kept_TK.dtype() == DType::u8, "kept_TK must be u8");
  check_shape(kept_TK, expert_TK.shape(), "kept_TK");
  const int64_t n = expert_TK.numel();
  const int32_t* ex = expert_TK.i32();
  uint8_t* kept = kept_TK.data<uint8_t>();
  if (capacity < 0) {  // dropless
    std::fill(kept, kept + n, 1);
    return;
  }
  std::vector<int64_t> cnt(static_cast<size_t>(E), 0);
  if (policy == MoeDrop::position) {
    for (int64_t i = 0; i < n; ++i) {
      ORIGAMI_CHECK(ex[i] >= 0 && ex[i] < E, "expert index ", ex[i], " at slot ", i, " is outside [0, ", E, ")");
      kept[i] = cnt[ex[i]]++ < capacity ? 1 : 0;
    }
    return;
  }
  check_shape(weight_TK, expert_TK.shape(), "weight_TK");
  ORIGAMI_CHECK(weight_TK.dtype() == DType::f32, "weight_TK must be f32");
  const float* w = weight_TK.f32();
  // Counting sort of slot indices by expert (stable: token-major within an
  // expert), then a partial selection only where an expert is over capacity.
  for (int64_t i = 0; i < n; ++i) {
    ORIGAMI_CHECK(ex[i] >= 0 && ex[i] < E, "expert index ", ex[i], " at slot ", i, " is outside [0, ", E, ")");
    ++cnt[ex[i]];
  }
  std::vector<int64_t> start(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + cnt[e];
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i) order[cursor[ex[i]]++] = static_cast<int32_t>(i);
  std::fill(kept, kept + n, 1);
  // Higher weight first; equal weights: lower flat index = lower token, then
  // slot. NaN weights (a diverged run) rank lowest, so the order stays a
  // strict weak ordering and nth_element stays inside the range.
  auto key = [w](int32_t i) { return w[i] == w[i] ? w[i] : -std::numeric_limits<float>::infinity(); };
  auto before = [key](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); };
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    if (cnt[e] <= capacity) continue;
    int32_t* first = order.data() + start[e];
    std::nth_element(first, first + capacity, first + cnt[e], before);
    for (int64_t i = capacity; i < cnt[e]; ++i) kept[first[i]] = 0;
  }
}

void moe_expert_rows(const ExecContext& ctx, const Tensor& kept_E, int64_t pad_rows, Tensor& rows_E) {
  ORIGAMI_CHECK(kept_E.defined() && kept_E.dtype() == DType::i64 && kept_E.dim() == 1, "kept_E must be i64 [E]");
  ORIGAMI_CHECK(rows_E.defined() && rows_E.dtype() == DType::i64, "rows_E must be i64");
  const int64_t E = kept_E.numel();
  check_shape(rows_E, {E}, "rows_E");
  const int64_t* kept = kept_E.data<int64_t>();
  int64_t* rows = rows_E.data<int64_t>();
  for (int64_t e = 0; e < E; ++e) rows[e] = pad_rows >= 0 ? pad_rows : kept[e];
}

void moe_permutation_maps(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, const Tensor& rows_E,
                          Tensor& row_of_TK, Tensor& row_token_N, Tensor& row_slot_N) {
  ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32, "expert_TK must be i32");
  check_kept(kept_TK, expert_TK);
  ORIGAMI_CHECK(rows_E.defined() && rows_E.dtype() == DType::i64 && rows_E.dim() == 1, "rows_E must be i64 [E]");
  const int64_t T = expert_TK.rows(), K = expert_TK.cols(), E = rows_E.numel();
  const int64_t* rows = rows_E.data<int64_t>();
  std::vector<int64_t> offset(static_cast<size_t>(E) + 1, 0), fill(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e) offset[e + 1] = offset[e] + rows[e];
  const int64_t N = offset[E];
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_i32(row_token_N, {N}, "row_token_N");
  check_i32(row_slot_N, {N}, "row_slot_N");
  const int32_t* ex = expert_TK.i32();
  const uint8_t* kept = kept_TK.defined() ? kept_TK.data<uint8_t>() : nullptr;
  int32_t* row_of = row_of_TK.i32();
  int32_t* row_token = row_token_N.i32();
  int32_t* row_slot = row_slot_N.i32();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t i = t * K + j;
      if (kept && !kept[i]) {
        row_of[i] = -1;
        continue;
      }
      const int32_t e = ex[i];
      ORIGAMI_CHECK(e >= 0 && e < E, "expert index ", e, " at token ", t, " slot ", j, " is outside [0, ", E, ")");
      ORIGAMI_CHECK(fill[e] < rows[e], "expert ", e, " has more kept slots than its ", rows[e], " rows");
      const int64_t r = offset[e] + fill[e]++;
      row_of[i] = static_cast<int32_t>(r);
      row_token[r] = static_cast<int32_t>(t);
      row_slot[r] = static_cast<int32_t>(j);
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    std::fill(row_token + offset[e] + fill[e], row_token + offset[e + 1], -1);
    std::fill(row_slot + offset[e] + fill[e], row_slot + offset[e + 1], -1);
  }
}

void moe_permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Tensor& row_token_N, Tensor& x_ND) {
  ORIGAMI_CHECK(x_TD.defined() && x_TD.dtype() == DType::f32, "permute input must be f32");
  const int64_t T = x_TD.rows(), D = x_TD.cols(), N = row_token_N.numel();
  check_i32(row_token_N, {N}, "row_token_N");
  check_f32(x_ND, {N, D}, "permuted x_ND");
  const float* x = x_TD.f32();
  const int32_t* tok = row_token_N.i32();
  float* out = x_ND.f32();
  const size_t row_bytes = static_cast<size_t>(D) * sizeof(float);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = tok[n];
    ORIGAMI_CHECK(t < T, "permutation row ", n, " names token ", t, " of ", T);
    if (t >= 0)
      std::memcpy(out + n * D, x + static_cast<int64_t>(t) * D, row_bytes);
    else
      std::memset(out + n * D, 0, row_bytes);
  }
}

void moe_permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Tensor& row_of_TK, Tensor& dx_TD) {
  ORIGAMI_CHECK(dx_ND.defined() && dx_ND.dtype() == DType::f32, "permute gradient must be f32");
  const int64_t N = dx_ND.rows(), D = dx_ND.cols(), T = row_of_TK.rows(), K = row_of_TK.cols();
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_f32(dx_TD, {T, D}, "permute dx_TD");
  const float* src = dx_ND.f32();
  const int32_t* row_of = row_of_TK.i32();
  float* dst = dx_TD.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* __restrict d = dst + t * D;
    for (int64_t j = 0; j < K; ++j) {
      const int32_t r = row_of[t * K + j];
      if (r < 0) continue;
      ORIGAMI_CHECK(r < N, "slot row ", r, " outside the ", N, " permuted rows");
      const float* __restrict y = src + static_cast<int64_t>(r) * D;
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) d[c] += y[c];
    }
  }
}

void moe_unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Tensor& row_of_TK, const Tensor& weight_TK,
                        Tensor& out_TD) {
  ORIGAMI_CHECK(y_ND.defined() && y_ND.dtype() == DType::f32, "unpermute input must be f32");
  const int64_t N = y_ND.rows(), D = y_ND.cols(), T = row_of_TK.rows(), K = row_of_TK.cols();
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_f32(weight_TK, {T, K}, "unpermute weight_TK");
  check_f32(out_TD, {T, D}, "unpermute out_TD");
  const float* y = y_ND.f32();
  const int32_t* row_of = row_of_TK.i32();
  const float* w = weight_TK.f32();
  float* out = out_TD.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* __restrict o = out + t * D;
    std::memset(o, 0, static_cast<size_t>(D) * sizeof(float));
    for (int64_t j = 0; j < K; ++j) {
      const int32_t r = row_of[t * K + j];
      if (r < 0) continue;
      ORIGAMI_CHECK(r < N, "slot row ", r, " outside the ", N, " permuted rows");
      const float* __restrict yr = y + static_cast<int64_t>(r) * D;
      const float p = w[t * K + j];
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) o[c] += p * yr[c];
    }
  }
}

void moe_unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND,
                                 const Tensor& row_of_TK, const Tensor& row_token_N, const Tensor& weight_TK,
                                 Tensor& dy_ND, Tensor& dweight_TK) {
  ORIGAMI_CHECK(y_ND.defined() && y_ND.dtype() == DType::f32, "unpermute input must be f32");
  const int64_t N = y_ND.rows(), D = y_ND.cols(), T = row_of_TK.rows(), K = row_of_TK.cols();
  check_i32(row_of_TK, {T, K}, "row_of_TK");
  check_i32(row_token_N, {N}, "row_token_N");
  check_f32(dout_TD, {T, D}, "unpermute dout_TD");
  check_f32(weight_TK, {T, K}, "unpermute weight_TK");
  check_f32(dy_ND, {N, D}, "unpermute dy_ND");
  check_f32(dweight_TK, {T, K}, "unpermute dweight_TK");
  const float* dout = dout_TD.f32();
  const float* y = y_ND.f32();
  const int32_t* row_of = row_of_TK.i32();
  const int32_t* tok = row_token_N.i32();
  const float* w = weight_TK.f32();
  float* dy = dy_ND.f32();
  float* dw = dweight_TK.f32();
#pragma omp parallel
  {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < T; ++t) {
      const float* __restrict g = dout + t * D;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t r = row_of[t * K + j];
        if (r < 0) {
          dw[t * K + j] = 0.0f;
          continue;
        }
        ORIGAMI_CHECK(r < N, "slot row ", r, " outside the ", N, " permuted rows");
        const float* __restrict yr = y + static_cast<int64_t>(r) * D;
        float* __restrict d = dy + static_cast<int64_t>(r) * D;
        const float p = w[t * K + j];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < D; ++c) {
          acc += g[c] * yr[c];
          d[c] = p * g[c];
        }
        dw[t * K + j] = acc;
      }
    }
    // Padding rows (no slot points at them) are disjoint from the rows above.
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      if (tok[n] < 0) std::memset(dy + n * D, 0, static_cast<size_t>(D) * sizeof(float));
  }
}

}  // namespace origami::cpu

namespace origami {

void check_moe_topk_params(const MoeTopkParams& p, int64_t E) {
  ORIGAMI_CHECK(E > 0 && p.top_k >= 1 && p.top_k <= E, "router top_k = ", p.top_k, " must be in [1, num_experts = ", E,
                "]");
  ORIGAMI_CHECK(p.num_groups >= 1 && E % p.num_groups == 0, "num_experts = ", E,
                " must be divisible by router num_groups = ", p.num_groups);
  if (p.num_groups > 1) {
    ORIGAMI_CHECK(p.group_topk >= 1 && p.group_topk <= p.num_groups, "router group_topk = ", p.group_topk,
                  " must be in [1, num_groups = ", p.num_groups, "]");
    ORIGAMI_CHECK(p.top_k % p.group_topk == 0, "router top_k = ", p.top_k,
                  " must be divisible by group_topk = ", p.group_topk);
    ORIGAMI_CHECK(p.top_k / p.group_topk <= E / p.num_groups, "router top_k / group_topk = ", p.top_k / p.group_topk,
                  " exceeds the experts per group (", E / p.num_groups, ")");
  }
}

}  // namespace origami
