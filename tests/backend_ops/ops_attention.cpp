// The harness's table, attention part: causal GQA attention forward and
// backward, and the merge of partial results, over position patterns of
// context parallelism (chunks, fully masked key tiles, shuffled positions)
// and lengths that are not tile multiples.
#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <numeric>
#include <utility>

#include "backend_ops/harness.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

std::vector<int32_t> iota(int32_t lo, int32_t hi) {  // [lo, hi)
  std::vector<int32_t> v(hi - lo);
  std::iota(v.begin(), v.end(), lo);
  return v;
}
std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct AttentionCase {
  const char* name;
  int64_t B, Hq, Hkv, hd;
  std::vector<int32_t> qpos, kvpos;
  float scale = 0.0f;  // 0: 1/√hd
};

std::vector<AttentionCase> attention_cases(std::mt19937& g) {
  std::vector<int32_t> shuffled = iota(0, 150);
  std::shuffle(shuffled.begin(), shuffled.end(), g);
  return {
      {"S 77, not a tile multiple", 2, 4, 2, 16, iota(0, 77), iota(0, 77)},
      {"hd 24, group 2, S 130", 1, 6, 3, 24, iota(0, 130), iota(0, 130)},
      {"hd 128, group 3, S 129", 1, 3, 1, 128, iota(0, 129), iota(0, 129)},
      {"hd 8, S 5", 2, 3, 3, 8, iota(0, 5), iota(0, 5)},
      {"S 1", 1, 2, 1, 4, {0}, {0}},
      {"Sq 3 < Skv 41 (the last positions)", 2, 4, 2, 32, iota(38, 41), iota(0, 41)},
      // Context-parallel rank 1 of 2, 8-token chunks of 64: queries see earlier keys.
      {"CP chunks", 2, 4, 2, 32, concat(iota(8, 16), iota(40, 48)), iota(0, 64)},
      // Rank 1 of 4 over 1024 tokens: whole 128-key tiles skipped for the
      // first chunk, its rows trimmed from the later tiles' GEMMs; a scale
      // other than 1/√hd must be applied where the API says.
      {"CP, fully masked key tiles", 1, 2, 1, 16, concat(iota(128, 256), iota(768, 896)), iota(0, 1024), 0.3f},
      {"shuffled positions: masked by value, not index", 1, 2, 1, 64,
       std::vector<int32_t>(shuffled.begin(), shuffled.begin() + 70), shuffled},
      // Ring attention's blocks: rank 0 of cp 2 (S 64, chunks of 16) against
      // rank 1's keys: its first chunk sees none of them (o = 0, lse = −inf),
      // its second all of them.
      {"ring block: rows before every key", 2, 4, 2, 16, concat(iota(0, 16), iota(48, 64)), concat(iota(16, 32),
                                                                                                     iota(32, 48))},
      // Rows before every key in no particular order, among rows that see some.
      {"shuffled rows before every key", 1, 2, 1, 32, std::vector<int32_t>(shuffled.begin(), shuffled.begin() + 60),
       iota(40, 150)},
  };
}

struct AttentionProblem {
  AttentionCase c;
  AttentionDims d;
  float scale;
  Tensor q, k, v, dO;
};

AttentionProblem attention_problem(const AttentionCase& c, std::mt19937& g) {
  AttentionProblem p{c, {c.B, int64_t(c.qpos.size()), int64_t(c.kvpos.size()), c.Hq, c.Hkv, c.hd},
                     c.scale != 0.0f ? c.scale : 1.0f / std::sqrt(float(c.hd)), {}, {}, {}, {}};
  p.q = randn({c.B, p.d.q_len, c.Hq, c.hd}, g);
  p.k = randn({c.B, p.d.kv_len, c.Hkv, c.hd}, g);
  p.v = randn({c.B, p.d.kv_len, c.Hkv, c.hd}, g);
  p.dO = randn({c.B, p.d.q_len, c.Hq, c.hd}, g);
  return p;
}

// bf16 problems: every case above (head dims other than 64 / 128 take the
// CUDA SIMT kernels) plus head dims 64 and 128, which take the tensor-core
// kernels: tiles of 128 / 64 rows with partial ones, GQA, skipped and
// partially masked key tiles, rows before every key, shuffled positions.
std::vector<AttentionCase> attention_bf16_cases(std::mt19937& g) {
  std::vector<AttentionCase> cs = attention_cases(g);
  std::vector<int32_t> shuffled = iota(0, 150);
  std::shuffle(shuffled.begin(), shuffled.end(), g);
  const std::vector<AttentionCase> mma = {
      {"hd 64, group 2, S 300", 1, 4, 2, 64, iota(0, 300), iota(0, 300)},
      {"hd 128, group 2, S 200", 1, 4, 2, 128, iota(0, 200), iota(0, 200)},
      {"hd 64, Sq 3 < Skv 200 (the last positions)", 2, 4, 2, 64, iota(197, 200), iota(0, 200)},
      {"hd 128, CP, fully masked key tiles", 1, 2, 1, 128, concat(iota(128, 256), iota(768, 896)), iota(0, 1024),
       0.3f},
      {"hd 128, ring block: rows before every key", 2, 4, 2, 128, concat(iota(0, 16), iota(48, 64)),
       concat(iota(16, 32), iota(32, 48))},
      {"hd 128, shuffled rows before every key", 1, 2, 1, 128,
       std::vector<int32_t>(shuffled.begin(), shuffled.begin() + 60), iota(40, 150)},
      {"hd 64, shuffled positions", 1, 2, 1, 64, std::vector<int32_t>(shuffled.begin(), shuffled.begin() + 90),
       shuffled},
  };
  cs.insert(cs.end(), mma.begin(), mma.end());
  return cs;
}

// f32 values rounded to bf16 (nearest even), still f32.
Tensor bf16_round_trip(const Tensor& t) {
  static const ExecContext host = ExecContext::cpu(1);
  Tensor b = empty(t.shape(), DType::bf16), r = empty(t.shape());
  cast(host, t, b);
  cast(host, b, r);
  return r;
}

// p with q, k, v, dO rounded to bf16 (kept as f32 tensors): the values a bf16
// problem's op reads, so the fp64 reference (and the saved o, lse of the
// backward) are computed from exactly those.
AttentionProblem rounded_to_bf16(AttentionProblem p) {
  for (Tensor* t : {&p.q, &p.k, &p.v, &p.dO}) *t = bf16_round_trip(*t);
  return p;
}

struct AttentionRef {
  std::vector<double> o, lse, dq, dk, dv;
  std::vector<double> o_abs;  // Σ_j P_j·|v_j| per element of o: what a rounding of each P scales with
  // Per element of dq, dk, dv, what bf16 roundings inside the backward scale
  // with: Σ |dS|·|k| (dq), Σ |dS|·|q| (dk) times the scale, Σ P·|dO| (dv),
  // where |dS| carries a margin for its fp32 inputs (bwd_fp32_margin).
  std::vector<double> dq_abs, dk_abs, dv_abs;
};

// dS = P ⊙ (dP − D) takes dP = dO·v and D = dO·o from fp32 products over hd
// terms, which the tensor cores accumulate with up to 2^-23 per term: an
// absolute error up to hd·2^-23·(Σ|dO||v| + Σ|dO||o|), which no bf16
// rounding of dS scales with when dP − D cancels (a row with one visible
// key has dS ≡ 0). Measured against bf16's 2^-8, that is hd·2^-15 of those
// sums, added to |dS| in the scales above.
double bwd_fp32_margin(int64_t head_dim) { return static_cast<double>(head_dim) * 0x1p-15; }

// Straight from the definition, in double, one (batch, head, query) at a time.
// saved_o: the forward output backward reads (B·Sq·Hq·hd values), which
// enters D = rowsum(dO ⊙ o); null: the exact o (D = Σ_j P_j·dP_j).
AttentionRef naive_attention(const AttentionProblem& p, const std::vector<double>* saved_o = nullptr) {
  const AttentionDims& d = p.d;
  const int64_t B = d.batch, Sq = d.q_len, Skv = d.kv_len, Hq = d.num_heads, Hkv = d.num_kv_heads, hd = d.head_dim;
  const std::vector<int32_t>&qpos = p.c.qpos, &kvpos = p.c.kvpos;
  AttentionRef r;
  r.o.assign(B * Sq * Hq * hd, 0.0);
  r.o_abs.assign(r.o.size(), 0.0);
  r.dq.assign(r.o.size(), 0.0);
  r.lse.assign(B * Hq * Sq, 0.0);
  r.dk.assign(B * Skv * Hkv * hd, 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  r.dq_abs.assign(r.dq.size(), 0.0);
  r.dk_abs.assign(r.dk.size(), 0.0);
  r.dv_abs.assign(r.dk.size(), 0.0);
  const double margin = bwd_fp32_margin(hd);
  auto Q = [&](int64_t b, int64_t i, int64_t h) { return p.q.f32() + ((b * Sq + i) * Hq + h) * hd; };
  auto dO = [&](int64_t b, int64_t i, int64_t h) { return p.dO.f32() + ((b * Sq + i) * Hq + h) * hd; };
  auto K = [&](int64_t b, int64_t j, int64_t h) { return p.k.f32() + ((b * Skv + j) * Hkv + h) * hd; };
  auto V = [&](int64_t b, int64_t j, int64_t h) { return p.v.f32() + ((b * Skv + j) * Hkv + h) * hd; };
  std::vector<double> s(Skv), P(Skv), dP(Skv), dP_abs(Skv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kh = h / (Hq / Hkv);
      for (int64_t i = 0; i < Sq; ++i) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < Skv; ++j) {
          if (kvpos[j] > qpos[i]) continue;
          double dot = 0.0;
          for (int64_t c = 0; c < hd; ++c) dot += static_cast<double>(Q(b, i, h)[c]) * K(b, j, kh)[c];
          s[j] = p.scale * dot;
          mx = std::max(mx, s[j]);
        }
        double l = 0.0;
        for (int64_t j = 0; j < Skv; ++j) l += kvpos[j] <= qpos[i] ? std::exp(s[j] - mx) : 0.0;
        const double lse = mx + std::log(l);
        r.lse[(b * Hq + h) * Sq + i] = lse;
        double* o = &r.o[((b * Sq + i) * Hq + h) * hd];
        double* o_abs = &r.o_abs[((b * Sq + i) * Hq + h) * hd];
        double D = 0.0;
        for (int64_t j = 0; j < Skv; ++j) {
          P[j] = kvpos[j] <= qpos[i] ? std::exp(s[j] - lse) : 0.0;
          dP[j] = dP_abs[j] = 0.0;
          for (int64_t c = 0; c < hd; ++c) {
            o[c] += P[j] * V(b, j, kh)[c];
            o_abs[c] += P[j] * std::abs(V(b, j, kh)[c]);
            dP[j] += static_cast<double>(dO(b, i, h)[c]) * V(b, j, kh)[c];
            dP_abs[j] += std::abs(static_cast<double>(dO(b, i, h)[c]) * V(b, j, kh)[c]);
          }
          D += P[j] * dP[j];
        }
        double D_abs = 0.0;  // Σ |dO|·|o| over the o the backward reads
        const double* os = saved_o ? &(*saved_o)[((b * Sq + i) * Hq + h) * hd] : o;
        for (int64_t c = 0; c < hd; ++c) D_abs += std::abs(static_cast<double>(dO(b, i, h)[c]) * os[c]);
        if (saved_o) {
          D = 0.0;
          for (int64_t c = 0; c < hd; ++c) D += static_cast<double>(dO(b, i, h)[c]) * os[c];
        }
        double* dq = &r.dq[((b * Sq + i) * Hq + h) * hd];
        double* dq_abs = &r.dq_abs[((b * Sq + i) * Hq + h) * hd];
        for (int64_t j = 0; j < Skv; ++j) {
          if (P[j] == 0.0) continue;
          const double dS = P[j] * (dP[j] - D);
          const double dS_abs = std::abs(dS) + margin * P[j] * (dP_abs[j] + D_abs);
          const int64_t kv = ((b * Skv + j) * Hkv + kh) * hd;
          for (int64_t c = 0; c < hd; ++c) {
            dq[c] += p.scale * dS * K(b, j, kh)[c];
            r.dk[kv + c] += p.scale * dS * Q(b, i, h)[c];
            r.dv[kv + c] += P[j] * dO(b, i, h)[c];
            dq_abs[c] += std::abs(p.scale * dS_abs * K(b, j, kh)[c]);
            r.dk_abs[kv + c] += std::abs(p.scale * dS_abs * Q(b, i, h)[c]);
            r.dv_abs[kv + c] += P[j] * std::abs(dO(b, i, h)[c]);
          }
        }
      }
    }
  return r;
}

// fp32 GEMMs over <= 1024 terms and exp_fast (2e-7 relative): observed
// errors are <= 2e-6 of the largest value, forward and backward (which
// chains five products and the cancellation dP − D); bounds leave 5-10x.
const Tol kAttentionFwdTol{1e-5, 0, "fp32 GEMMs over <= 1024 terms and exp_fast: ~2e-6 of the largest value"};
// The 1e-6 absolute term: a gradient that is exactly zero (a query with one
// visible key has softmax ≡ 1) comes out as the rounding of dP − D, ~1e-7.
const Tol kAttentionBwdTol{2e-5, 1e-6, "five chained fp32 products and the cancellation dP − D: ~2e-6 observed"};
// bf16 (against fp64 on the rounded inputs). Forward, per element of o: P
// rounded to bf16 for the tensor cores' P·V (2^-8 of each P_j; the
// denominator sums the unrounded P) is off by at most 2^-8·Σ_j P_j·|v_j|,
// and o's own rounding by 2^-8·|o|; the fp32 rest (scores of <= 256-term
// dot products, exp2, the running rescales: ~1e-5 of Σ_j P_j·|v_j| at
// worst here) fits in the 1.2x. A bound, not an estimate: random signs keep
// the sum far below it. lse stays fp32 from fp32 scores: exp2/log2 rounding.
const Tol kAttentionBf16OTol{1.2 * 0x1p-8, 0,
                             "P rounded to bf16 for P·V (2^-8 of Σ_j P_j|v_j|) and o rounded to bf16 (2^-8 of |o|)"};
const Tol kAttentionBf16LseTol{2e-5, 0, "fp32 scores of bf16 inputs, fp32 exp2 sums and log2: ~1e-6"};
// Backward, per element (against fp64 on the rounded inputs, with D from
// the bf16 o the op reads): P rounded to bf16 for dV = Pᵀ·dO is off by at
// most 2^-8·Σ_i P_i|dO_i|; dS rounded to bf16 for dQ = dS·K and dK = dSᵀ·Q
// by 2^-8·Σ|dS||k| and 2^-8·Σ|dS||q| (times the scale), |dS| widened by
// the fp32 margin of dP − D (bwd_fp32_margin); each output's own rounding
// by 2^-8 of itself. The fp32 rest fits in the 1.2x (spare 0.2·2^-8 =
// 7.8e-4): P from fp32 scores of hd-term products, at worst ~3.7e-4 of P
// (hd 128, scale 0.3; typically ~1e-6), and sums over <= 1024 terms
// accumulated with 2^-23 each, 1.2e-4 of Σ|terms|. So a query that sees no key,
// and a key no query sees, must come out 0 up to the absolute term, and a
// mask or tile-edge slip in a long row, whose gradient is small beside the
// tensor's largest, cannot hide under it. The absolute term: fp32 rounding
// where every term cancels. A bound, not an estimate: with the tensor
// cores' P and dS roundings emulated in the CPU backward, the worst element
// over 6 seeds came to 0.74 of it (0.40 without them, as the CPU runs); a
// dq that lost one key per 128-key tile came to 40-98x (9-44x against the
// former bound, 1e-2 of the tensor's largest).
const Tol kAttentionBf16BwdTol{1.2 * 0x1p-8, 1e-5,
                               "P (dV) and dS (dQ, dK) rounded to bf16, 2^-8 of Σ|terms| each, and the output "
                               "rounded (2^-8 of itself)"};

std::string attention_label(const AttentionProblem& p) {
  return std::string(p.c.name) + ": B " + std::to_string(p.d.batch) + ", Hq " + std::to_string(p.d.num_heads) +
         ", Hkv " + std::to_string(p.d.num_kv_heads) + ", hd " + std::to_string(p.d.head_dim) + ", Sq " +
         std::to_string(p.d.q_len) + ", Skv " + std::to_string(p.d.kv_len);
}

// One forward problem of ap (f32; bf16_variant makes the bf16 copy). With
// per_element_o, o's bound scales with each element's own Σ_j P_j·|v_j| + |o|
// (kAttentionBf16OTol) rather than the largest |o|: a row that sees no key
// must then be exactly 0, and a masking or tile-edge slip in a long row,
// whose o is small beside the tensor's largest, cannot hide under it.
Problem attention_forward_problem(const AttentionProblem& ap, bool per_element_o = false) {
  const AttentionDims d = ap.d;
  const float scale = ap.scale;
  Problem p(attention_label(ap));
  p.in("q", ap.q).in("k", ap.k).in("v", ap.v).in("q_pos_S", i32s(ap.c.qpos)).in("kv_pos_S", i32s(ap.c.kvpos));
  p.out("o", ap.q.shape(), DType::f32, kAttentionFwdTol);
  p.out("lse_BHS", {d.batch, d.num_heads, d.q_len}, DType::f32, kAttentionFwdTol);
  p.call = [d, scale](const ExecContext& ctx, Bound& t) {
    Tensor ws = poisoned_workspace(ctx, attention_forward_workspace_bytes(ctx, d));
    attention_forward(ctx, d, t.at("q"), t.at("k"), t.at("v"), t.at("q_pos_S"), t.at("kv_pos_S"), scale, t.at("o"),
                      t.at("lse_BHS"), ws);
  };
  p.reference = [ap, per_element_o](const Bound&, Refs& want) {
    AttentionRef r = naive_attention(ap);
    if (per_element_o)
      for (size_t i = 0; i < r.o.size(); ++i) want["o"].scale.push_back(r.o_abs[i] + std::abs(r.o[i]));
    want["o"].value = std::move(r.o);
    want["lse_BHS"].value = std::move(r.lse);
  };
  return p;
}

OpEntry attention_forward_entry() {
  return {"attention_forward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const AttentionCase& c : attention_cases(g))
              ps.push_back(attention_forward_problem(attention_problem(c, g)));
            for (const AttentionCase& c : attention_bf16_cases(g))
              ps.push_back(bf16_variant(attention_forward_problem(rounded_to_bf16(attention_problem(c, g)), true),
                                        {"lse_BHS"}, kAttentionBf16OTol, {{"lse_BHS", kAttentionBf16LseTol}}));
            return ps;
          }};
}

// One backward problem of ap; the saved forward outputs are the reference's,
// rounded to fp32 (o to bf16 with bf16, as the bf16 variant will pass it).
// The reference's D is from that o: the op can only read the o it is given,
// so o's rounding is the forward's error, not this op's. With bf16, each
// gradient element's bound scales with its own roundings
// (kAttentionBf16BwdTol).
Problem attention_backward_problem(const AttentionProblem& ap, bool bf16 = false) {
  const AttentionDims d = ap.d;
  const float scale = ap.scale;
  const AttentionRef fwd = naive_attention(ap);
  Tensor o = from_doubles(fwd.o, ap.q.shape());
  if (bf16) o = bf16_round_trip(o);
  const std::vector<double> saved_o = values(o);
  auto r = std::make_shared<AttentionRef>(naive_attention(ap, &saved_o));
  Problem p(attention_label(ap));
  p.in("q", ap.q).in("k", ap.k).in("v", ap.v).in("o", o);
  p.in("lse_BHS", from_doubles(fwd.lse, {d.batch, d.num_heads, d.q_len})).in("do", ap.dO);
  p.in("q_pos_S", i32s(ap.c.qpos)).in("kv_pos_S", i32s(ap.c.kvpos));
  p.out("dq", ap.q.shape(), DType::f32, kAttentionBwdTol);
  p.out("dk", ap.k.shape(), DType::f32, kAttentionBwdTol);
  p.out("dv", ap.v.shape(), DType::f32, kAttentionBwdTol);
  p.call = [d, scale](const ExecContext& ctx, Bound& t) {
    Tensor ws = poisoned_workspace(ctx, attention_backward_workspace_bytes(ctx, d));
    attention_backward(ctx, d, t.at("q"), t.at("k"), t.at("v"), t.at("o"), t.at("lse_BHS"), t.at("do"),
                       t.at("q_pos_S"), t.at("kv_pos_S"), scale, t.at("dq"), t.at("dk"), t.at("dv"), ws);
  };
  p.reference = [r, ap, bf16, one_key = d.kv_len == 1](const Bound&, Refs& want) {
    want["dq"].value = r->dq;
    want["dk"].value = r->dk;
    want["dq"].may_be_zero = want["dk"].may_be_zero = one_key;  // one key: softmax ≡ 1
    want["dv"].value = r->dv;
    if (bf16) {
      for (auto [name, terms] : {std::pair{"dq", &r->dq_abs}, {"dk", &r->dk_abs}, {"dv", &r->dv_abs}}) {
        Ref& ref = want[name];
        for (size_t e = 0; e < ref.value.size(); ++e) ref.scale.push_back((*terms)[e] + std::abs(ref.value[e]));
      }
      return;
    }
    // A query that sees no key has no gradient, nor has a key no query
    // sees: those elements are held to the absolute term alone (the rest
    // to the tensor's largest, as without a scale), so a gradient leaked
    // across the mask cannot hide under the tensor's largest value.
    const std::vector<int32_t>&qpos = ap.c.qpos, &kvpos = ap.c.kvpos;
    const int32_t first_key = *std::min_element(kvpos.begin(), kvpos.end());
    const int32_t last_query = *std::max_element(qpos.begin(), qpos.end());
    const int64_t hd = ap.d.head_dim, Hq = ap.d.num_heads, Hkv = ap.d.num_kv_heads;
    const auto masked_scale = [hd](Ref& ref, int64_t heads, const std::vector<int32_t>& pos, auto sees_any) {
      double largest = 0.0;
      for (double x : ref.value) largest = std::max(largest, std::abs(x));
      const int64_t S = static_cast<int64_t>(pos.size());
      for (size_t e = 0; e < ref.value.size(); ++e)
        ref.scale.push_back(sees_any(pos[(e / (heads * hd)) % S]) ? largest : 0.0);
    };
    masked_scale(want["dq"], Hq, qpos, [first_key](int32_t q) { return q >= first_key; });
    for (const char* name : {"dk", "dv"})
      masked_scale(want[name], Hkv, kvpos, [last_query](int32_t k) { return k <= last_query; });
  };
  return p;
}

OpEntry attention_backward_entry() {
  return {"attention_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const AttentionCase& c : attention_cases(g))
              ps.push_back(attention_backward_problem(attention_problem(c, g)));
            for (const AttentionCase& c : attention_bf16_cases(g))
              ps.push_back(bf16_variant(attention_backward_problem(rounded_to_bf16(attention_problem(c, g)), true),
                                        {"lse_BHS"}, kAttentionBf16BwdTol));
            return ps;
          }};
}

// Running and partial results of the same queries over two key sets: rows
// where either or both saw no key (lse −inf, o 0), lse far apart (one side's
// weight ~e−30) and close together.
OpEntry attention_merge_entry() {
  return {"attention_merge", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (auto [B, Sq, Hq, hd] : {std::array<int64_t, 4>{2, 37, 3, 16}, {1, 5, 2, 64}, {1, 1, 1, 1}}) {
              const Shape o_shape{B, Sq, Hq, hd}, l_shape{B, Hq, Sq};
              Tensor o_acc = randn(o_shape, g), o_part = randn(o_shape, g);
              Tensor lse_acc = randn(l_shape, g, 4.0f), lse_part = randn(l_shape, g, 4.0f);
              const int64_t rows = B * Hq * Sq;
              auto empty_row = [&](Tensor& o, Tensor& lse, int64_t at) {  // at: index into lse [B, Hq, Sq]
                const int64_t b = at / (Hq * Sq), h = at / Sq % Hq, i = at % Sq;
                lse.f32()[at] = -INFINITY;
                std::fill_n(o.f32() + ((b * Sq + i) * Hq + h) * hd, hd, 0.0f);
              };
              if (rows >= 4) {
                empty_row(o_part, lse_part, 0);                          // only the running row
                empty_row(o_acc, lse_acc, 1);                            // only the part
                empty_row(o_part, lse_part, 2), empty_row(o_acc, lse_acc, 2);  // neither: stays empty
                lse_part.f32()[3] = lse_acc.f32()[3] + 30.0f;            // the part dominates
              }
              Problem p("B " + std::to_string(B) + ", Sq " + std::to_string(Sq) + ", Hq " + std::to_string(Hq) +
                        ", hd " + std::to_string(hd));
              p.in("o_part", o_part).in("lse_part", lse_part);
              p.inout("o_acc", o_acc,
                      {1e-6, 0, "two fp32 products and a sum per element, weights rounded to fp32 (of wa|oa| + wp|op|)"});
              p.inout("lse_acc", lse_acc, {1.2e-7, 0, "computed in double, rounded once to fp32 (scale |lse|)"});
              p.call = [](const ExecContext& ctx, Bound& t) {
                attention_merge(ctx, t.at("o_part"), t.at("lse_part"), t.at("o_acc"), t.at("lse_acc"));
              };
              p.reference = [B, Sq, Hq, hd](const Bound& in, Refs& want) {
                const std::vector<double> oa = values(in.at("o_acc")), op = values(in.at("o_part")),
                                          la = values(in.at("lse_acc")), lp = values(in.at("lse_part"));
                std::vector<double> o = oa, lse = la, o_scale(oa.size());
                // Rounding scales with the blended magnitudes, not the blend,
                // which a fresh draw can make cancel (wa·oa ≈ −wp·op).
                for (size_t k = 0; k < oa.size(); ++k) o_scale[k] = std::abs(oa[k]);
                for (int64_t b = 0; b < B; ++b)
                  for (int64_t h = 0; h < Hq; ++h)
                    for (int64_t i = 0; i < Sq; ++i) {
                      const int64_t l = (b * Hq + h) * Sq + i, at = ((b * Sq + i) * Hq + h) * hd;
                      if (lp[l] == -INFINITY) continue;
                      const double m = std::max(la[l], lp[l]), wa = std::exp(la[l] - m), wp = std::exp(lp[l] - m);
                      lse[l] = m + std::log(wa + wp);
                      for (int64_t e = 0; e < hd; ++e) {
                        o[at + e] = (wa * oa[at + e] + wp * op[at + e]) / (wa + wp);
                        o_scale[at + e] = (wa * std::abs(oa[at + e]) + wp * std::abs(op[at + e])) / (wa + wp);
                      }
                    }
                want["o_acc"].value = o;
                want["o_acc"].scale = o_scale;
                want["lse_acc"].value = lse;
                for (double x : lse) want["lse_acc"].scale.push_back(std::isfinite(x) ? std::abs(x) : 0.0);
              };
              // bf16 o rows (lse stays f32): the blend in fp32, rounded once to bf16.
              Problem b = bf16_variant(p, {"lse_part", "lse_acc"},
                                       {4e-3, 0, "fp32 blend of bf16 rows, rounded once to bf16: 2^-8 = 3.9e-3"},
                                       {{"lse_acc", {1.2e-7, 0, "computed in double, rounded once to fp32"}}});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> attention_ops() {
  return {attention_forward_entry(), attention_backward_entry(), attention_merge_entry()};
}

}  // namespace origami::testing::backend_ops
