// The harness's table, MoE statistics part (kernels/moe_ops.h): the router's
// statistics buffer, the host totals and the aux coefficients read from it,
// and the expert-bias update of aux-loss-free balancing. Routing inputs are
// the naive top-k of random logits, so they are valid (distinct experts per
// token, real softmax or σ scores); the buffers the readers take are the
// naive statistics of such a routing, or the sum of a few (a group's
// reduction).
#include <cmath>
#include <numeric>

#include "backend_ops/harness.h"
#include "kernels/moe_ops.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

const Tol kExact{0, 0, "integers, or values copied: exact"};

struct StatsCase {
  int64_t T, E, K, S;
  MoeScore score;
  bool lse;  // lse_T given (else Σ lse² is 0)
};

std::string stats_label(const StatsCase& c) {
  return "T " + std::to_string(c.T) + ", E " + std::to_string(c.E) + ", k " + std::to_string(c.K) + ", S " +
         std::to_string(c.S) + (c.score == MoeScore::softmax ? ", softmax" : ", sigmoid") + (c.lse ? ", lse" : "");
}

// Host inputs of moe_routing_stats: scores, selection and log-sum-exp of the
// naive top-k of random logits (lse undefined unless the case has it).
struct Routed {
  Tensor scores, experts, lse;
};
Routed random_routed(const StatsCase& c, std::mt19937& g) {
  const NaiveTopk n =
      naive_topk(values(randn({c.T, c.E}, g, 2.0f)), c.E, MoeTopkParams{c.score, c.K, 1, 1, false, 1.0}, {});
  const std::vector<int32_t> experts(n.experts.begin(), n.experts.end());
  return {from_doubles(n.scores, {c.T, c.E}), i32s(experts, {c.T, c.K}), c.lse ? from_doubles(n.lse, {c.T}) : Tensor()};
}

// stats_N = [counts_SE | scores_SE | T | Σ lse²] from moe_routing_stats's
// definition: segment b holds tokens [b·T/S, (b+1)·T/S); s' = s (softmax) or
// s / (Σ_e s + 1e-20) (sigmoid); S = 0 leaves out the two S·E parts. The
// scale is 0 for the counts and T (exact), |value| for the sums.
Ref naive_stats(const Routed& r, const StatsCase& c) {
  const int64_t T = c.T, E = c.E, K = c.K, S = c.S, SE = S * E;
  Ref ref{std::vector<double>(2 * SE + 2, 0.0), std::vector<double>(2 * SE + 2, 0.0)};
  std::vector<double>& v = ref.value;
  if (S > 0) {
    const std::vector<double> s = values(r.scores), ex = values(r.experts);
    const int64_t seg = T / S;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t b = t / seg;
      for (int64_t j = 0; j < K; ++j) v[b * E + int64_t(ex[t * K + j])] += 1;
      double norm = 0.0;
      for (int64_t e = 0; e < E; ++e) norm += s[t * E + e];
      const double div = c.score == MoeScore::softmax ? 1.0 : norm + 1e-20;
      for (int64_t e = 0; e < E; ++e) v[SE + b * E + e] += s[t * E + e] / div;
    }
  }
  v[2 * SE] = double(T);
  if (r.lse.defined())
    for (double l : values(r.lse)) v[2 * SE + 1] += l * l;
  for (int64_t i = SE; i < 2 * SE; ++i) ref.scale[i] = std::abs(v[i]);
  ref.scale[2 * SE + 1] = v[2 * SE + 1];
  ref.may_be_zero = T == 0;  // no tokens: zeros
  return ref;
}

Tensor f64s(const std::vector<double>& v) {
  Tensor t = empty({int64_t(v.size())}, DType::f64);
  std::copy(v.begin(), v.end(), t.data<double>());
  return t;
}

OpEntry routing_stats_entry() {
  return {"moe_routing_stats", [](std::mt19937& g) {
            std::vector<Problem> ps;
            // Segments of 300 straddle the op's 256-token chunks, segments of
            // 256 match them; S = 0 is the buffer without the aux part; T = 0.
            const StatsCase cases[] = {{900, 6, 2, 3, MoeScore::softmax, true}, {900, 6, 2, 3, MoeScore::sigmoid, true},
                                       {1024, 8, 3, 4, MoeScore::sigmoid, false},
                                       {257, 4, 1, 1, MoeScore::softmax, false},
                                       {1, 1, 1, 1, MoeScore::sigmoid, true},  {40, 5, 2, 0, MoeScore::softmax, true},
                                       {40, 5, 2, 0, MoeScore::sigmoid, false}, {0, 5, 2, 1, MoeScore::softmax, true},
                                       {0, 5, 2, 0, MoeScore::sigmoid, true}};
            for (const StatsCase& c : cases) {
              const Routed r = random_routed(c, g);
              Problem p(stats_label(c));
              p.in("scores_TE", r.scores).in("expert_TK", r.experts);
              if (c.lse) p.in("lse_T", r.lse);
              p.out("stats_N", {2 * c.S * c.E + 2}, DType::f64,
                    {1e-6, 0,
                     "counts and T exact (scale 0); score sums: sigmoid's fp32 per-token normalization, "
                     "(E + 1)·u <= 6e-7 of each positive term for E <= 8, softmax fp64 sums; Σ lse²: fp64 sums "
                     "(scale |want|)"});
              p.call = [c](const ExecContext& ctx, Bound& t) {
                const Tensor lse = t.count("lse_T") ? t.at("lse_T") : Tensor();
                moe_routing_stats(ctx, t.at("scores_TE"), t.at("expert_TK"), lse, c.score, c.S, t.at("stats_N"));
              };
              p.reference = [c](const Bound& in, Refs& want) {
                want["stats_N"] = naive_stats({in.at("scores_TE"), in.at("expert_TK"),
                                               in.count("lse_T") ? in.at("lse_T") : Tensor()},
                                              c);
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// A statistics buffer as the readers get it: the naive statistics of
// `ranks` random routings of the case, summed elementwise (the group's
// reduction; one rank: a single forward).
struct BufferCase {
  StatsCase c;
  int ranks;
};
std::vector<double> random_buffer(const BufferCase& b, std::mt19937& g) {
  std::vector<double> sum;
  for (int r = 0; r < b.ranks; ++r) {
    const std::vector<double> v = naive_stats(random_routed(b.c, g), b.c).value;
    if (sum.empty()) sum.assign(v.size(), 0.0);
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  return sum;
}
std::string buffer_label(const BufferCase& b) {
  return stats_label(b.c) + (b.ranks > 1 ? ", summed over " + std::to_string(b.ranks) + " ranks" : "");
}

OpEntry routing_totals_entry() {
  return {"moe_routing_totals", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const BufferCase cases[] = {{{96, 7, 2, 3, MoeScore::sigmoid, true}, 1},
                                        {{600, 16, 4, 1, MoeScore::softmax, true}, 1},
                                        {{64, 8, 2, 2, MoeScore::softmax, true}, 4},
                                        {{40, 5, 2, 0, MoeScore::softmax, true}, 1},
                                        {{1, 1, 1, 1, MoeScore::sigmoid, true}, 1}};
            for (const BufferCase& b : cases) {
              const StatsCase c = b.c;
              Problem p(buffer_label(b));
              p.in("stats_N", f64s(random_buffer(b, g)));
              // totals_3's three fields, each compared at its own tolerance:
              // copied on the device into f64 [1] outputs of their own.
              p.out("tokens", {1}, DType::f64, kExact);
              p.out("balance", {1}, DType::f64,
                    {1e-14, 0, "fp64: S·E <= 21 positive terms of 3 roundings each, any order: <= (S·E + 3)·eps64"});
              p.out("lse_sq_sum", {1}, DType::f64, kExact);
              p.call = [c](const ExecContext& ctx, Bound& t) {
                Tensor totals = ctx.empty({3}, DType::f64, MemCategory::workspace);
                moe_routing_totals(ctx, t.at("stats_N"), c.S, c.E, c.K, totals);
                const char* fields[3] = {"tokens", "balance", "lse_sq_sum"};  // MoeRoutingTotals' order
                for (int64_t i = 0; i < 3; ++i) ctx.copy(t.at(fields[i]), totals.flat_view(i, 1, {1}));
              };
              p.reference = [c](const Bound& in, Refs& want) {
                // Σ_b Σ_e f_be · P_be, f = count / (T_b · k), P = score sum / T_b, T_b = T / S.
                const std::vector<double> s = values(in.at("stats_N"));
                const int64_t SE = c.S * c.E;
                double balance = 0.0;
                if (c.S > 0) {
                  const double Tb = s[2 * SE] / double(c.S);
                  for (int64_t i = 0; i < SE; ++i) balance += s[i] / (Tb * double(c.K)) * (s[SE + i] / Tb);
                }
                want["tokens"].value = {s[2 * SE]};
                want["balance"] = {{balance}, {balance}};
                want["balance"].may_be_zero = c.S == 0;  // no aux part: no balance term
                want["lse_sq_sum"].value = {s[2 * SE + 1]};
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

OpEntry aux_coefficients_entry() {
  return {"moe_aux_coefficients", [](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Case {
              BufferCase b;
              double scale;
            };
            const Case cases[] = {{{{96, 7, 2, 3, MoeScore::sigmoid, true}, 1}, 0.0123},
                                  {{{600, 16, 4, 1, MoeScore::softmax, false}, 1}, -3.7e-4},
                                  {{{64, 8, 2, 2, MoeScore::softmax, true}, 4}, 1.0 / 3.0},
                                  {{{1, 1, 1, 1, MoeScore::softmax, true}, 1}, 0.1}};
            for (const Case& k : cases) {
              const StatsCase c = k.b.c;
              const double scale = k.scale;
              Problem p(buffer_label(k.b) + ", scale " + std::to_string(scale));
              p.in("stats_N", f64s(random_buffer(k.b, g)));
              p.out("aux_SE", {c.S, c.E}, DType::f32,
                    {0, 0, "fp32(scale · count), the definition's one rounding: exact"});
              p.call = [scale](const ExecContext& ctx, Bound& t) {
                moe_aux_coefficients(ctx, t.at("stats_N"), scale, t.at("aux_SE"));
              };
              p.reference = [c, scale](const Bound& in, Refs& want) {
                const std::vector<double> s = values(in.at("stats_N"));
                for (int64_t i = 0; i < c.S * c.E; ++i)
                  want["aux_SE"].value.push_back(static_cast<float>(scale * s[i]));
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// Loads in [0, hi] with expert E / 2 exactly at the mean (E·load = Σ load,
// sign 0): the other loads are drawn, expert 0 moved up until E − 1 divides
// their sum.
std::vector<int64_t> loads_with_one_at_the_mean(int64_t E, int64_t hi, std::mt19937& g) {
  std::vector<int64_t> load(E);
  std::uniform_int_distribution<int64_t> d(0, hi);
  for (int64_t& l : load) l = d(g);
  const int64_t m = E / 2;
  load[m] = 0;
  int64_t rest = std::accumulate(load.begin(), load.end(), int64_t{0});
  load[0] += (E - 1 - rest % (E - 1)) % (E - 1);
  rest = std::accumulate(load.begin(), load.end(), int64_t{0});
  load[m] = rest / (E - 1);
  return load;
}

OpEntry expert_bias_update_entry() {
  return {"moe_expert_bias_update", [](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Case {
              std::string name;
              std::vector<int64_t> load;
              float rate;
            };
            std::vector<Case> cases;
            cases.push_back({"E 9, one expert at the mean", loads_with_one_at_the_mean(9, 50, g), 0.125f});
            std::vector<int64_t> many(64);
            std::uniform_int_distribution<int64_t> d(0, 1000000);
            for (int64_t& l : many) l = d(g);
            cases.push_back({"E 64, loads up to 1e6", many, 1e-3f});
            // Near 2^53 a mean in doubles rounds; the signs must still be exact.
            std::vector<int64_t> big = loads_with_one_at_the_mean(8, 16, g);
            for (int64_t& l : big) l += int64_t{1} << 53;
            cases.push_back({"E 8, loads near 2^53, one at the mean", big, 1e-3f});
            // Past one block of 1024 threads: a second launch's share (kernels/cuda/moe_stats.cu).
            std::vector<int64_t> wide(1500);
            for (int64_t& l : wide) l = d(g);
            cases.push_back({"E 1500, past one block", wide, 1e-3f});
            cases.push_back({"E 4, balanced: no move", {7, 7, 7, 7}, 0.5f});
            cases.push_back({"E 1", {12}, 0.5f});
            for (const Case& c : cases) {
              const int64_t E = int64_t(c.load.size());
              const std::vector<int64_t> load = c.load;
              const float rate = c.rate;
              Problem p(c.name + ", rate " + std::to_string(rate));
              p.inout("bias_E", randn({E}, g, 0.1f),
                      {6e-8, 0, "b + rate·sign, one fp32 add: <= 2^-24 of |want| (scale |want|)"});
              p.call = [load, rate](const ExecContext& ctx, Bound& t) {
                moe_expert_bias_update(ctx, t.at("bias_E"), load, rate);
              };
              p.reference = [load, rate](const Bound& in, Refs& want) {
                // bias_e += rate · sign(mean(load) − load_e), the sign in integers: Σ load − E·load_e.
                const int64_t n = int64_t(load.size()), sum = std::accumulate(load.begin(), load.end(), int64_t{0});
                const std::vector<double> b = values(in.at("bias_E"));
                Ref& r = want["bias_E"];
                for (int64_t e = 0; e < n; ++e) {
                  const int64_t diff = sum - n * load[e];
                  r.value.push_back(b[e] + double(rate) * double((diff > 0) - (diff < 0)));
                  r.scale.push_back(std::abs(r.value.back()));
                }
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> moe_stats_ops() {
  return {routing_stats_entry(), routing_totals_entry(), aux_coefficients_entry(), expert_bias_update_entry()};
}

}  // namespace origami::testing::backend_ops
