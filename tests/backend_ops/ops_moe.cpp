// The harness's table, MoE part (kernels/moe_ops.h): top-k forward and
// backward, histograms, capacity masks, rows per expert, permutation maps
// and the row gathers/scatters (the routing statistics and the balancing
// update are in ops_moe_stats.cpp). Integer routing inputs are always valid:
// distinct experts per token, rows_E at least each expert's kept count, row
// maps built by the naive permutation below.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "backend_ops/harness.h"
#include "kernels/moe_ops.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

// ---------------------------------------------------------------- routing inputs

struct Routing {
  std::string name;
  int64_t T, K, E;
  std::vector<int32_t> expert;  // [T, K], distinct per token
  std::vector<uint8_t> kept;    // [T, K]; empty: every slot kept (kept_TK undefined)
  std::vector<int64_t> rows;    // [E], >= each expert's kept slots
};

Routing random_routing(std::string name, int64_t T, int64_t K, int64_t E, bool with_kept, int max_pad,
                       std::mt19937& g) {
  Routing r{std::move(name), T, K, E, {}, {}, std::vector<int64_t>(E, 0)};
  std::vector<int32_t> perm(E);
  std::bernoulli_distribution keep(0.75);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    r.expert.insert(r.expert.end(), perm.begin(), perm.begin() + K);
    for (int64_t j = 0; j < K; ++j) {
      const bool kept = !with_kept || keep(g);
      if (with_kept) r.kept.push_back(kept);
      r.rows[perm[j]] += kept;
    }
  }
  std::uniform_int_distribution<int> pad(0, max_pad);
  for (int64_t& n : r.rows) n += pad(g);
  return r;
}

// A hand-made one (token 4's expert-1 slot dropped, 4 rows per expert), two
// random ones with and without drops, a single slot, and two with many
// slots per token.
std::vector<Routing> routing_cases(std::mt19937& g) {
  Routing small{"T 5, K 2, E 3, one drop", 5, 2, 3, {0, 1, 1, 2, 0, 2, 1, 0, 2, 1}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 0},
                {4, 4, 4}};
  return {small, random_routing("T 50, K 2, E 5, drops, padding", 50, 2, 5, true, 3, g),
          random_routing("T 40, K 3, E 7, no kept_TK", 40, 3, 7, false, 2, g),
          random_routing("T 1, K 1, E 1", 1, 1, 1, false, 0, g),
          // Fine-grained top-6 and top-8 (DeepSeek-like): the CUDA kernels sum
          // a token's slots in groups of four past K = 3.
          random_routing("T 30, K 6, E 64, drops", 30, 6, 64, true, 1, g),
          random_routing("T 20, K 8, E 16, no kept_TK", 20, 8, 16, false, 0, g)};
}

Tensor expert_tensor(const Routing& r) { return i32s(r.expert, {r.T, r.K}); }
Tensor kept_tensor(const Routing& r) {
  if (r.kept.empty()) return Tensor();
  Tensor t = empty({r.T, r.K}, DType::u8);
  std::copy(r.kept.begin(), r.kept.end(), t.data<uint8_t>());
  return t;
}
int64_t total_rows(const Routing& r) { return std::accumulate(r.rows.begin(), r.rows.end(), int64_t{0}); }

struct Maps {
  std::vector<int32_t> row_of, row_token, row_slot;  // [T, K], [N], [N]
};

// Expert e's rows start at Σ_{e'<e} rows_E[e'], filled by its kept slots in
// token-major order; the rest are padding (−1).
Maps naive_maps(const Routing& r) {
  const int64_t N = total_rows(r);
  Maps m{std::vector<int32_t>(r.T * r.K), std::vector<int32_t>(N, -1), std::vector<int32_t>(N, -1)};
  std::vector<int64_t> next(r.E, 0);
  for (int64_t e = 1; e < r.E; ++e) next[e] = next[e - 1] + r.rows[e - 1];
  for (int64_t i = 0; i < r.T * r.K; ++i) {
    if (!r.kept.empty() && !r.kept[i]) {
      m.row_of[i] = -1;
      continue;
    }
    const int64_t row = next[r.expert[i]]++;
    m.row_of[i] = static_cast<int32_t>(row);
    m.row_token[row] = static_cast<int32_t>(i / r.K);
    m.row_slot[row] = static_cast<int32_t>(i % r.K);
  }
  return m;
}

std::vector<double> as_doubles(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

// Adds the kept_TK argument when the routing has one; the call reads it back
// with kept_or_none.
void add_kept(Problem& p, const Routing& r) {
  if (!r.kept.empty()) p.in("kept_TK", kept_tensor(r));
}
Tensor kept_or_none(const Bound& t) { return t.count("kept_TK") ? t.at("kept_TK") : Tensor(); }

const Tol kExact{0, 0, "integers, or rows copied: exact"};

// ---------------------------------------------------------------- top-k forward and backward

struct TopkCase {
  int64_t T, E;
  MoeTopkParams p;
  bool bias, lse;
  // Logits set to NaN or ±inf, {token, expert, value}: a diverged run's router.
  std::vector<std::tuple<int64_t, int64_t, float>> nonfinite = {};
};

std::string topk_label(const TopkCase& c) {
  return "T " + std::to_string(c.T) + ", E " + std::to_string(c.E) + ", k " + std::to_string(c.p.top_k) +
         ", groups " + std::to_string(c.p.num_groups) + "/" + std::to_string(c.p.group_topk) +
         (c.p.score_function == MoeScore::softmax ? ", softmax" : ", sigmoid") +
         (c.p.normalize_topk ? ", normalized" : "") +
         (c.bias ? ", bias" : "") + (c.lse ? ", lse" : "") + (c.nonfinite.empty() ? "" : ", non-finite logits");
}

// Token by token, the non-finite cases (kernels/moe_ops.h's rule): softmax,
// top-2 of 8: a NaN logit, all NaN, +inf (each: every score NaN, experts
// 0 and 1, NaN weights), -inf (score 0, a normal selection). Sigmoid, 16
// experts in 4 groups of 4, top-2 groups, top-4: one NaN (skipped), a group
// all NaN (not eligible), three groups with 3 NaN each (fewer than 2 values:
// only group 0 is eligible, its 4 experts are the selection), the same with
// expert 0 NaN too (experts 1-3 eligible, then expert 0, the lowest not
// taken; NaN weights), and
// ±inf (scores 1 and ~0).
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
std::vector<std::tuple<int64_t, int64_t, float>> softmax_nonfinite() {
  std::vector<std::tuple<int64_t, int64_t, float>> v{{1, 3, kNaN}, {3, 5, kInf}, {4, 0, -kInf}};
  for (int64_t e = 0; e < 8; ++e) v.emplace_back(2, e, kNaN);
  return v;
}
std::vector<std::tuple<int64_t, int64_t, float>> sigmoid_nonfinite() {
  std::vector<std::tuple<int64_t, int64_t, float>> v{{1, 2, kNaN}, {4, 0, kNaN}, {5, 7, kInf}, {5, 9, -kInf}};
  for (int64_t e = 0; e < 4; ++e) v.emplace_back(2, e, kNaN);
  for (int64_t t : {3, 4})
    for (int64_t e : {4, 5, 6, 8, 9, 10, 12, 13, 14}) v.emplace_back(t, e, kNaN);
  return v;
}

OpEntry topk_forward_entry() {
  return {"moe_topk_forward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const TopkCase cases[] = {{50, 8, {MoeScore::softmax, 2, 1, 1, false, 1.5f}, false, true},
                                      {50, 16, {MoeScore::sigmoid, 4, 4, 2, true, 1.5f}, true, true},
                                      {50, 32, {MoeScore::softmax, 6, 8, 3, true, 1.5f}, true, false},
                                      {50, 5, {MoeScore::sigmoid, 5, 1, 1, false, 1.5f}, true, true},
                                      {1, 1, {MoeScore::softmax, 1, 1, 1, false, 1.0f}, false, true},
                                      // Past a warp's 32 lanes: DeepSeek-V2-Lite's 64 top-6 and V3's
                                      // 256 in 8 groups, top-4 groups, top-8.
                                      {40, 64, {MoeScore::sigmoid, 6, 1, 1, true, 2.5f}, true, true},
                                      {20, 256, {MoeScore::sigmoid, 8, 8, 4, true, 2.5f}, true, false},
                                      // At the CUDA router's shared-memory bound (kernels/moe_ops.h:
                                      // 2E + 2G + K = 12288 words), where a block holds one warp.
                                      {3, 6142, {MoeScore::softmax, 2, 1, 1, true, 1.0f}, false, true},
                                      {5, 8, {MoeScore::softmax, 2, 1, 1, false, 1.0f}, false, true, softmax_nonfinite()},
                                      {6, 16, {MoeScore::sigmoid, 4, 4, 2, true, 1.0f}, true, true, sigmoid_nonfinite()}};
            for (const TopkCase& c : cases) {
              const int64_t T = c.T, E = c.E, K = c.p.top_k;
              Problem p(topk_label(c));
              Tensor logits = randn({T, E}, g, 2.0f);
              const Tensor bias = c.bias ? randn({E}, g, 0.1f) : Tensor();
              // The selection is compared exactly, so no token's may hang on a
              // near-tie that fp32 scores (exp_fast, ~1e-6 relative) could
              // order otherwise than the double reference: a token whose
              // selection margin (naive_ops.h) is under 1e-5 is drawn again.
              // Some seeds gave one (E 256, groups 8/4: two experts swapped).
              for (int redraws = 0;; ++redraws) {
                const NaiveTopk n = naive_topk(values(logits), E, c.p, c.bias ? values(bias) : std::vector<double>{});
                bool separated = true;
                for (int64_t t = 0; t < T; ++t) {
                  if (n.margin[t] >= 1e-5) continue;
                  separated = false;
                  const Tensor row = randn({E}, g, 2.0f);
                  std::copy(row.f32(), row.f32() + E, logits.f32() + t * E);
                }
                if (separated) break;
                ORIGAMI_CHECK(redraws < 100, "no separated selection after 100 draws: ", topk_label(c));
              }
              for (const auto& [t, e, v] : c.nonfinite) logits.f32()[t * E + e] = v;
              p.in("logits_TE", logits);
              if (c.bias) p.in("bias_E", bias);
              // exp_fast and fp32 sums: < 1e-6 relative, per element.
              p.out("scores_TE", {T, E}, DType::f32, {2e-6, 1e-12, "exp_fast and an fp32 sum (scale |s|)"});
              p.out("expert_TK", {T, K}, DType::i32, {0, 0, "the selection: exact"});
              p.out("weight_TK", {T, K}, DType::f32, {2e-6, 0, "the selected scores, normalized (scale |w|)"});
              if (c.lse) p.out("lse_T", {T}, DType::f32, {1e-6, 0, "fp32 log-sum-exp (scale 1 + |lse|)"});
              const MoeTopkParams params = c.p;
              p.call = [params](const ExecContext& ctx, Bound& t) {
                Tensor bias = t.count("bias_E") ? t.at("bias_E") : Tensor();
                Tensor lse = t.count("lse_T") ? t.at("lse_T") : Tensor();
                moe_topk_forward(ctx, t.at("logits_TE"), bias, params, t.at("scores_TE"), t.at("expert_TK"),
                                 t.at("weight_TK"), lse);
              };
              p.reference = [c, E](const Bound& in, Refs& want) {
                const NaiveTopk n = naive_topk(values(in.at("logits_TE")), E, c.p,
                                               c.bias ? values(in.at("bias_E")) : std::vector<double>{});
                want["scores_TE"] = {n.scores, n.scores};
                want["expert_TK"].value.assign(n.experts.begin(), n.experts.end());
                want["expert_TK"].may_be_zero = E == 1;  // one expert: index 0
                want["weight_TK"] = {n.weights, n.weights};
                for (double l : n.lse) want["lse_T"].value.push_back(l), want["lse_T"].scale.push_back(1 + std::abs(l));
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// ∂/∂z of Σ_tj dweight·p + Σ_te aux[seg(t), e]·s' + z_coef·Σ_t lse², the
// selection fixed, by the chain rule in double: first g = ∂f/∂s, then
// through softmax or σ; the z-loss through softmax(z) whatever the score.
std::vector<double> naive_topk_backward(const std::vector<double>& z, int64_t E, const MoeTopkParams& p,
                                        const std::vector<int>& experts, const std::vector<double>& R,
                                        const std::vector<double>& A, int64_t seg_len, double zc) {
  const NaiveTopk n = naive_topk(z, E, p, {}, &experts);
  const int64_t T = int64_t(z.size()) / E, K = p.top_k;
  std::vector<double> dz(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const double* s = &n.scores[t * E];
    std::vector<double> gs(E, 0.0);
    if (!R.empty()) {  // p_j = c·s_j / (Σ_sel s + ε) when normalized, else c·s_j
      double den = 1e-20, rs = 0.0;
      for (int64_t j = 0; j < K; ++j) den += s[experts[t * K + j]], rs += R[t * K + j] * s[experts[t * K + j]];
      for (int64_t j = 0; j < K; ++j) {
        const double r = R[t * K + j];
        const double c = p.scaling_f32();
        gs[experts[t * K + j]] += p.normalize_topk ? c * (r / den - rs / (den * den)) : c * r;
      }
    }
    if (!A.empty()) {  // s' = s (softmax) or s / (Σ_e s + ε) (sigmoid)
      const double* a = &A[(t / seg_len) * E];
      double den = 1e-20, as = 0.0;
      for (int64_t e = 0; e < E; ++e) den += s[e], as += a[e] * s[e];
      const bool softmax = p.score_function == MoeScore::softmax;
      for (int64_t e = 0; e < E; ++e) gs[e] += softmax ? a[e] : a[e] / den - as / (den * den);
    }
    double gdot = 0.0;
    for (int64_t e = 0; e < E; ++e) gdot += gs[e] * s[e];
    for (int64_t e = 0; e < E; ++e) {
      dz[t * E + e] = p.score_function == MoeScore::softmax ? s[e] * (gs[e] - gdot) : gs[e] * s[e] * (1 - s[e]);
      dz[t * E + e] += 2 * zc * n.lse[t] * std::exp(z[t * E + e] - n.lse[t]);
    }
  }
  return dz;
}

OpEntry topk_backward_entry() {
  return {"moe_topk_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Case {
              TopkCase c;
              int64_t seg;
              bool dweight, aux;
              float zc;
            };
            std::vector<Case> cases;
            for (MoeScore sc : {MoeScore::softmax, MoeScore::sigmoid})
              for (bool norm : {false, true})
                cases.push_back({{12, 8, {sc, 3, 2, 1, norm, 1.3f}, false, false}, 4, true, true, 0.07f});
            cases.push_back({{12, 8, {MoeScore::softmax, 2, 1, 1, false, 1.0f}, false, false}, 12, false, true, 0.0f});
            cases.push_back({{12, 8, {MoeScore::sigmoid, 2, 1, 1, true, 1.0f}, false, false}, 4, true, false, 0.07f});
            cases.push_back({{1, 2, {MoeScore::sigmoid, 1, 1, 1, false, 1.0f}, false, false}, 1, true, true, 0.1f});
            // Past a warp's 32 lanes (64 experts, top-6 and top-8).
            cases.push_back({{12, 64, {MoeScore::sigmoid, 6, 1, 1, true, 2.5f}, false, false}, 4, true, true, 0.07f});
            cases.push_back({{12, 64, {MoeScore::softmax, 8, 4, 2, false, 1.0f}, false, false}, 6, true, true, 0.07f});
            // At the CUDA router's shared-memory bound, one warp per block (as forward).
            cases.push_back({{3, 6142, {MoeScore::softmax, 2, 1, 1, true, 1.0f}, false, false}, 3, true, true, 0.07f});
            for (const Case& k : cases) {
              const int64_t T = k.c.T, E = k.c.E, K = k.c.p.top_k;
              const MoeTopkParams params = k.c.p;
              Tensor logits = randn({T, E}, g, 1.5f);
              const NaiveTopk n = naive_topk(values(logits), E, params, {});
              Problem p(topk_label(k.c) + ", seg " + std::to_string(k.seg) + (k.dweight ? ", dweight" : "") +
                        (k.aux ? ", aux" : "") + ", z_coef " + std::to_string(k.zc));
              p.in("logits_TE", logits).in("scores_TE", from_doubles(n.scores, {T, E}));
              p.in("expert_TK", i32s(std::vector<int32_t>(n.experts.begin(), n.experts.end()), {T, K}));
              if (k.dweight) p.in("dweight_TK", randn({T, K}, g));
              if (k.aux) p.in("aux_SE", randn({T / k.seg, E}, g, 0.3f));
              p.out("dlogits_TE", {T, E}, DType::f32,
                    {2e-6, 0, "the fp32 chain rule over E terms with exp_fast: a few ulp of the largest"});
              const int64_t seg = k.seg;
              const float zc = k.zc;
              p.call = [=](const ExecContext& ctx, Bound& t) {
                Tensor dw = t.count("dweight_TK") ? t.at("dweight_TK") : Tensor();
                Tensor aux = t.count("aux_SE") ? t.at("aux_SE") : Tensor();
                moe_topk_backward(ctx, t.at("logits_TE"), t.at("scores_TE"), t.at("expert_TK"), dw, aux, seg, zc,
                                  params, t.at("dlogits_TE"));
              };
              p.reference = [=](const Bound& in, Refs& want) {
                const std::vector<double> ex = values(in.at("expert_TK"));
                want["dlogits_TE"].value = naive_topk_backward(
                    values(in.at("logits_TE")), E, params, std::vector<int>(ex.begin(), ex.end()),
                    in.count("dweight_TK") ? values(in.at("dweight_TK")) : std::vector<double>{},
                    in.count("aux_SE") ? values(in.at("aux_SE")) : std::vector<double>{}, seg, zc);
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- histogram, capacity, maps

OpEntry histogram_entry() {
  return {"moe_expert_histogram", [](std::mt19937& g) {
            std::vector<Problem> ps;
            std::vector<Routing> cases = routing_cases(g);
            cases.push_back(random_routing("T 333, K 3, E 17, drops", 333, 3, 17, true, 0, g));
            // Past the CUDA kernel's shared-memory bins (8192 experts): its
            // global-atomics path.
            cases.push_back(random_routing("T 700, K 4, E 9000, drops", 700, 4, 9000, true, 0, g));
            for (const Routing& r : cases) {
              Problem p(r.name);
              p.in("expert_TK", expert_tensor(r));
              add_kept(p, r);
              p.out("count_E", {r.E}, DType::i64, kExact);
              const int64_t E = r.E;
              p.call = [E](const ExecContext& ctx, Bound& t) {
                moe_expert_histogram(ctx, t.at("expert_TK"), kept_or_none(t), E, t.at("count_E"));
              };
              p.reference = [r](const Bound&, Refs& want) {
                std::vector<double> count(r.E, 0.0);
                for (int64_t i = 0; i < r.T * r.K; ++i) count[r.expert[i]] += r.kept.empty() || r.kept[i];
                want["count_E"].value = count;
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// probs: an expert keeps its C slots of highest weight, ties to the lower
// token, then slot (a stable sort of the token-major slots); position: its
// first C slots. C < 0 (dropless): every slot.
std::vector<double> naive_capacity(const Routing& r, const std::vector<double>& w, int64_t C, MoeDrop policy) {
  std::vector<double> kept(r.T * r.K, 0.0);
  for (int64_t e = 0; e < r.E; ++e) {
    std::vector<int64_t> slots;
    for (int64_t i = 0; i < r.T * r.K; ++i)
      if (r.expert[i] == e) slots.push_back(i);
    if (policy == MoeDrop::probs)
      std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return w[a] > w[b]; });
    const int64_t keep = C < 0 ? int64_t(slots.size()) : std::min<int64_t>(C, int64_t(slots.size()));
    for (int64_t n = 0; n < keep; ++n) kept[slots[n]] = 1.0;
  }
  return kept;
}

OpEntry capacity_mask_entry() {
  return {"moe_capacity_mask", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const Routing r = random_routing("T 40, K 2, E 4", 40, 2, 4, false, 0, g);
            const Routing one = random_routing("T 1, K 1, E 1", 1, 1, 1, false, 0, g);
            struct Case {
              const Routing* r;
              int64_t capacity;
              bool ties;  // weights from {0.25, 0.5, 0.75, 1}: the tie rule decides
            };
            for (MoeDrop policy : {MoeDrop::probs, MoeDrop::position})
              for (const Case& c : {Case{&r, 0, false}, Case{&r, 3, false}, Case{&r, 15, true}, Case{&r, 100, false},
                                    Case{&one, 1, false}, Case{&r, -1, false}, Case{&r, -7, true},
                                    Case{&one, -1, false}}) {
                Tensor w = c.ties ? randint({c.r->T, c.r->K}, g, 1, 4) : randn({c.r->T, c.r->K}, g);
                if (c.ties)
                  for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] *= 0.25f;
                Problem p(c.r->name + ", capacity " + std::to_string(c.capacity) +
                          (policy == MoeDrop::probs ? ", probs" : ", position") + (c.ties ? ", tied weights" : ""));
                p.in("expert_TK", expert_tensor(*c.r)).in("weight_TK", w);
                p.out("kept_TK", {c.r->T, c.r->K}, DType::u8, kExact);
                const int64_t E = c.r->E, C = c.capacity;
                p.call = [=](const ExecContext& ctx, Bound& t) {
                  moe_capacity_mask(ctx, t.at("expert_TK"), t.at("weight_TK"), E, C, policy, t.at("kept_TK"));
                };
                const Routing rr = *c.r;
                p.reference = [rr, C, policy](const Bound& in, Refs& want) {
                  want["kept_TK"].value = naive_capacity(rr, values(in.at("weight_TK")), C, policy);
                  want["kept_TK"].may_be_zero = C == 0;  // capacity 0 drops every slot
                };
                ps.push_back(std::move(p));
              }
            return ps;
          }};
}

OpEntry expert_rows_entry() {
  return {"moe_expert_rows", [](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Case {
              int64_t E, pad;
            };
            // pad_rows < 0: the kept counts; >= 0: the padding for every expert (0 included).
            for (const Case& c : {Case{5, -1}, Case{5, 6}, Case{17, -1}, Case{17, 0}, Case{1, -1}, Case{1, 3}}) {
              std::vector<int64_t> kept(c.E);
              std::uniform_int_distribution<int64_t> d(0, 40);
              for (int64_t& n : kept) n = d(g);
              kept[0] = 1 + d(g);  // never all zeros
              Problem p("E " + std::to_string(c.E) + ", pad_rows " + std::to_string(c.pad));
              p.in("kept_E", i64s(kept));
              p.out("rows_E", {c.E}, DType::i64, kExact);
              const int64_t pad = c.pad;
              p.call = [pad](const ExecContext& ctx, Bound& t) {
                moe_expert_rows(ctx, t.at("kept_E"), pad, t.at("rows_E"));
              };
              p.reference = [pad](const Bound& in, Refs& want) {
                for (double n : values(in.at("kept_E"))) want["rows_E"].value.push_back(pad >= 0 ? double(pad) : n);
                want["rows_E"].may_be_zero = pad == 0;  // padding to 0 rows: every expert owns none
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

OpEntry permutation_maps_entry() {
  return {"moe_permutation_maps", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const Routing& r : routing_cases(g)) {
              const int64_t N = total_rows(r);
              Problem p(r.name + ", N " + std::to_string(N));
              p.in("expert_TK", expert_tensor(r));
              add_kept(p, r);
              p.in("rows_E", i64s(r.rows));
              p.out("row_of_TK", {r.T, r.K}, DType::i32, kExact);
              p.out("row_token_N", {N}, DType::i32, kExact).out("row_slot_N", {N}, DType::i32, kExact);
              p.call = [](const ExecContext& ctx, Bound& t) {
                moe_permutation_maps(ctx, t.at("expert_TK"), kept_or_none(t), t.at("rows_E"), t.at("row_of_TK"),
                                     t.at("row_token_N"), t.at("row_slot_N"));
              };
              p.reference = [r](const Bound&, Refs& want) {
                const Maps m = naive_maps(r);
                want["row_of_TK"].value = as_doubles(m.row_of);
                want["row_token_N"].value = as_doubles(m.row_token);
                want["row_slot_N"].value = as_doubles(m.row_slot);
                // A single slot maps to row 0, token 0, slot 0.
                for (const char* name : {"row_of_TK", "row_token_N", "row_slot_N"}) want[name].may_be_zero = r.T == 1;
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- row gathers and scatters

// (routing case, D): widths off the vector width, one on it (D = 64: the
// CUDA kernels' 16-byte packs), and with K = 6 and 8 one past a warp's pass
// of packs (D = 1040 > 256) and one on the packs.
struct RowCase {
  size_t routing;
  int64_t D;
};
const RowCase kRowCases[] = {{0, 7}, {1, 33}, {2, 5}, {3, 1}, {1, 64}, {4, 1040}, {5, 72}};

OpEntry permute_rows_entry() {
  return {"moe_permute_rows", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const std::vector<Routing> cases = routing_cases(g);
            for (const RowCase& rc : kRowCases) {
              const Routing& r = cases[rc.routing];
              const int64_t D = rc.D, N = total_rows(r);
              const Maps m = naive_maps(r);
              Problem p(r.name + ", D " + std::to_string(D));
              p.in("x_TD", randn({r.T, D}, g)).in("row_token_N", i32s(m.row_token));
              p.out("x_ND", {N, D}, DType::f32, kExact);
              p.call = [](const ExecContext& ctx, Bound& t) {
                moe_permute_rows(ctx, t.at("x_TD"), t.at("row_token_N"), t.at("x_ND"));
              };
              p.reference = [m, D](const Bound& in, Refs& want) {
                const std::vector<double> x = values(in.at("x_TD"));
                for (int32_t tok : m.row_token)
                  for (int64_t d = 0; d < D; ++d) want["x_ND"].value.push_back(tok < 0 ? 0.0 : x[tok * D + d]);
              };
              Problem b = bf16_variant(p, {}, {0, 0, "bf16 rows copied into bf16, padding zero: exact"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry permute_rows_backward_entry() {
  return {"moe_permute_rows_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const std::vector<Routing> cases = routing_cases(g);
            for (const RowCase& rc : kRowCases) {
              const Routing& r = cases[rc.routing];
              const int64_t D = rc.D, N = total_rows(r);
              const Maps m = naive_maps(r);
              Problem p(r.name + ", D " + std::to_string(D));
              // Positive: a sum onto the base can never cancel to an all-zero reference.
              p.in("dx_ND", randint({N, D}, g, 1, 9)).in("row_of_TK", i32s(m.row_of, {r.T, r.K}));
              p.inout("dx_TD", randint({r.T, D}, g, 1, 9), {0, 0, "sums of small integers: exact"});
              p.call = [](const ExecContext& ctx, Bound& t) {
                moe_permute_rows_backward(ctx, t.at("dx_ND"), t.at("row_of_TK"), t.at("dx_TD"));
              };
              p.reference = [m, D, K = r.K](const Bound& in, Refs& want) {
                std::vector<double> dx = values(in.at("dx_TD"));
                const std::vector<double> src = values(in.at("dx_ND"));
                for (size_t s = 0; s < m.row_of.size(); ++s)
                  if (m.row_of[s] >= 0)
                    for (int64_t d = 0; d < D; ++d) dx[(s / K) * D + d] += src[m.row_of[s] * D + d];
                want["dx_TD"].value = dx;
              };
              Problem b = bf16_variant(
                  p, {}, {0, 0, "integers |x| <= 9·(K + 1) = 36: exact in bf16 inputs, fp32 sums and the bf16 result"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry unpermute_rows_entry() {
  return {"moe_unpermute_rows", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const std::vector<Routing> cases = routing_cases(g);
            for (const RowCase& rc : kRowCases) {
              const Routing& r = cases[rc.routing];
              const int64_t D = rc.D, N = total_rows(r), K = r.K;
              const Maps m = naive_maps(r);
              Problem p(r.name + ", D " + std::to_string(D));
              p.in("y_ND", randn({N, D}, g)).in("row_of_TK", i32s(m.row_of, {r.T, K}));
              p.in("weight_TK", randn({r.T, K}, g));
              // Dropped-everywhere tokens get zeros (the hand-made and random cases have some slots dropped).
              p.out("out_TD", {r.T, D}, DType::f32,
                    {2.4e-7 * double(K), 1e-30, "K rounded products and their fp32 sum: <= 2K·u of Σ|terms|"});
              p.call = [](const ExecContext& ctx, Bound& t) {
                moe_unpermute_rows(ctx, t.at("y_ND"), t.at("row_of_TK"), t.at("weight_TK"), t.at("out_TD"));
              };
              p.reference = [m, D, K, T = r.T](const Bound& in, Refs& want) {
                const std::vector<double> y = values(in.at("y_ND")), w = values(in.at("weight_TK"));
                Ref& o = want["out_TD"];
                o.value.assign(T * D, 0.0);
                o.scale.assign(T * D, 0.0);
                for (size_t s = 0; s < m.row_of.size(); ++s)
                  if (m.row_of[s] >= 0)
                    for (int64_t d = 0; d < D; ++d) {
                      o.value[(s / K) * D + d] += w[s] * y[m.row_of[s] * D + d];
                      o.scale[(s / K) * D + d] += std::abs(w[s] * y[m.row_of[s] * D + d]);
                    }
              };
              Problem b = bf16_variant(p, {"weight_TK"},
                                       {5e-3, 1e-30,
                                        "y rounded to bf16 (the reference reads the rounded values), K products "
                                        "summed in fp32 (<= 2K·2^-24), the sum rounded once to bf16: 2^-8 of "
                                        "|out| <= Σ|terms|"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry unpermute_rows_backward_entry() {
  return {"moe_unpermute_rows_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const std::vector<Routing> cases = routing_cases(g);
            for (const RowCase& rc : kRowCases) {
              const Routing& r = cases[rc.routing];
              const int64_t D = rc.D, N = total_rows(r), K = r.K;
              const Maps m = naive_maps(r);
              Problem p(r.name + ", D " + std::to_string(D));
              p.in("dout_TD", randn({r.T, D}, g)).in("y_ND", randn({N, D}, g));
              p.in("row_of_TK", i32s(m.row_of, {r.T, K})).in("row_token_N", i32s(m.row_token));
              p.in("weight_TK", randn({r.T, K}, g));
              p.out("dy_ND", {N, D}, DType::f32, {1.2e-7, 0, "one rounded product (scale |want|); padding rows zero"});
              p.out("dweight_TK", {r.T, K}, DType::f32,
                    {1.2e-7 * double(D), 1e-30, "an fp32 dot of D terms: <= D·2u of Σ|terms|; dropped slots 0"});
              p.call = [](const ExecContext& ctx, Bound& t) {
                moe_unpermute_rows_backward(ctx, t.at("dout_TD"), t.at("y_ND"), t.at("row_of_TK"), t.at("row_token_N"),
                                            t.at("weight_TK"), t.at("dy_ND"), t.at("dweight_TK"));
              };
              p.reference = [m, D, K, N, T = r.T](const Bound& in, Refs& want) {
                const std::vector<double> dout = values(in.at("dout_TD")), y = values(in.at("y_ND")),
                                          w = values(in.at("weight_TK"));
                Ref &dy = want["dy_ND"], &dw = want["dweight_TK"];
                dy.value.assign(N * D, 0.0);
                dw.value.assign(T * K, 0.0);
                dw.scale.assign(T * K, 0.0);
                for (size_t s = 0; s < m.row_of.size(); ++s) {
                  const int64_t row = m.row_of[s], t = int64_t(s) / K;
                  if (row < 0) continue;
                  for (int64_t d = 0; d < D; ++d) {
                    dy.value[row * D + d] = w[s] * dout[t * D + d];
                    dw.value[s] += dout[t * D + d] * y[row * D + d];
                    dw.scale[s] += std::abs(dout[t * D + d] * y[row * D + d]);
                  }
                }
                for (double v : dy.value) dy.scale.push_back(std::abs(v));
              };
              Problem b = bf16_variant(
                  p, {"weight_TK", "dweight_TK"},
                  {5e-3, 0, "weight · dout in fp32 (2^-24), rounded once to bf16 (2^-8 of |want|, plus the fp32 "
                            "rounding before it); padding rows zero"},
                  {{"dweight_TK",
                    {1.2e-7 * double(D), 1e-30,
                     "bf16 · bf16 products are exact in fp32, so only the fp32 dot of D terms: <= D·2u of Σ|terms|"}}});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> moe_ops() {
  return {topk_forward_entry(),    topk_backward_entry(),         histogram_entry(),
          capacity_mask_entry(),   expert_rows_entry(),           permutation_maps_entry(),
          permute_rows_entry(),    permute_rows_backward_entry(), unpermute_rows_entry(),
          unpermute_rows_backward_entry()};
}

}  // namespace origami::testing::backend_ops
