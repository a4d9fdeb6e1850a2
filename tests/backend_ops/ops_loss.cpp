// The harness's table, loss part: cross-entropy, whole-row and the
// vocab-parallel pieces (the row maximum, the local sums, the finish and the
// local backward), over vocab widths that exercise a device's row loop
// (odd, a power of two, several 16-byte loads per thread).
#include <algorithm>
#include <cmath>
#include <utility>

#include "backend_ops/harness.h"
#include "kernels/cross_entropy.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

// Logits [T, V] drawn wide; targets anywhere in [0, V), one at the last
// column (the tail of any vector loop). Every other row holds its two
// largest logits at its first and last columns, so a row loop that drops or
// repeats an edge column (a vector loop's head or tail) moves lse by a
// large share of the sum: with uniform logits a lost column moves lse by
// ~1/V, inside the sum's own error bound at these widths. The rows between
// hold their largest at an interior column instead — column 16 (a 16-wide
// chunk's edge), column 256 (a block's), or a fresh one — so a loop that
// drops a column where chunks meet, or a whole middle chunk, fails too.
struct CeInputs {
  int64_t T, V;
  Tensor logits_TV;
  std::vector<int32_t> targets;
  std::vector<double> lse;  // fp64 per row
};

CeInputs ce_inputs(int64_t T, int64_t V, std::mt19937& g) {
  CeInputs c{T, V, randn({T, V}, g, 3.0f), std::vector<int32_t>(T), std::vector<double>(T)};
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V - 1));
  for (int64_t t = 0; t < T; ++t) {
    float* row = c.logits_TV.f32() + t * V;
    const float mx = *std::max_element(row, row + V);
    if (t % 2 == 0) {
      row[0] = mx + 2.0f;
      row[V - 1] = mx + 1.5f;
    } else if (V >= 3) {
      const int64_t at[] = {16, 256, pick(g)};
      row[std::clamp<int64_t>(at[(t / 2) % 3], 1, V - 2)] = mx + 2.0f;
    }
  }
  for (int32_t& t : c.targets) t = pick(g);
  c.targets[0] = static_cast<int32_t>(V - 1);
  const std::vector<double> x = values(c.logits_TV);
  for (int64_t t = 0; t < T; ++t) ref_cross_entropy_row(x, V, t, c.targets[t], &c.lse[t]);
  return c;
}

// The last two are wide enough for a device's row loop to take several 16-byte
// loads per thread: V odd (rows start anywhere) and V a power of two.
const std::pair<int64_t, int64_t> kCeShapes[] = {{9, 1001}, {1, 2}, {5, 17}, {4, 33001}, {2, 8192}};

// Per element of dlogits = scale·(p − onehot): what its rounding scales
// with, max(|element|, scale·p·(1 + |d|)), d = x − lse. The computed p
// carries a relative error, so the target's p − 1 carries it times p, not
// times |p − 1| (at p = 0.9986, a fresh draw of V = 2, that is 700× the
// element); and d is rounded to fp32 before exp, a relative error of
// ~6e-8·|d| in p (1e-6 at |d| = 19: p ~ 6e-9).
void set_dlogits_scale(const std::vector<double>& x, int64_t T, int64_t V, const std::vector<double>& lse, float scale,
                       Ref& want) {
  want.scale.resize(want.value.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < V; ++i) {
      const size_t k = static_cast<size_t>(t * V + i);
      const double d = x[k] - lse[t];
      want.scale[k] = std::max(std::abs(want.value[k]), double(scale) * std::exp(d) * (1 + std::abs(d)));
    }
}

// bf16 problems (bf16_variant) round the logits, never the statistics; the
// reference then sees the rounded logits, so an f32 output keeps its f32
// tolerance and a bf16 one adds its single rounding.
const Tol kBf16Dlogits{4e-3, 0,
                       "fp32 (exp(x − lse) − onehot)·scale of bf16 logits, rounded once to bf16: 2^-8 of the "
                       "element, at most 2^-8 = 3.9e-3 of the largest"};

OpEntry cross_entropy_forward_entry() {
  return {"cross_entropy_forward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (auto [T, V] : kCeShapes) {
              const CeInputs c = ce_inputs(T, V, g);
              Problem p("T " + std::to_string(T) + ", V " + std::to_string(V));
              p.in("logits_TV", c.logits_TV).in("targets_T", i32s(c.targets));
              // lse = m + log Σ: the relative error of the fp32 sum of V terms (each
              // <= 1; the CPU adds them in order: <= V·2^-24) is lse's absolute error.
              const double sum_err = double(V) * 0x1p-24;
              const Tol loss_tol{2e-6, sum_err, "lse's error: exp_fast's against |lse|, plus the sum's V·2^-24"};
              const Tol lse_tol{1e-6, sum_err, "exp_fast's 2e-7 of |lse|, plus the fp32 sum of V terms: V·2^-24"};
              p.out("loss_T", {T}, DType::f32, loss_tol).out("lse_T", {T}, DType::f32, lse_tol);
              p.call = [](const ExecContext& ctx, Bound& t) {
                cross_entropy_forward(ctx, t.at("logits_TV"), t.at("targets_T"), t.at("loss_T"), t.at("lse_T"));
              };
              p.reference = [c](const Bound& in, Refs& want) {
                const std::vector<double> x = values(in.at("logits_TV"));
                for (int64_t t = 0; t < c.T; ++t) {
                  double lse = 0.0;
                  ref_cross_entropy_row(x, c.V, t, c.targets[t], &lse);
                  want["loss_T"].value.push_back(lse - x[t * c.V + c.targets[t]]);
                  want["loss_T"].scale.push_back(std::abs(lse));
                  want["lse_T"].value.push_back(lse);
                }
              };
              Problem b = bf16_variant(p, {"loss_T", "lse_T"}, lse_tol, {{"loss_T", loss_tol}});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// (exp(logit − lse) − [column is the target]) · grad_scale over columns
// [vocab_start, vocab_start + Vr) of a row.
std::vector<double> ref_dlogits(const std::vector<double>& x, int64_t T, int64_t Vr, const std::vector<int32_t>& tgt,
                                const std::vector<double>& lse, int64_t vocab_start, double scale) {
  std::vector<double> d(T * Vr);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < Vr; ++i)
      d[t * Vr + i] = scale * (std::exp(x[t * Vr + i] - lse[t]) - (vocab_start + i == tgt[t] ? 1.0 : 0.0));
  return d;
}

OpEntry cross_entropy_backward_entry() {
  return {"cross_entropy_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (auto [T, V] : kCeShapes) {
              const CeInputs c = ce_inputs(T, V, g);
              const float scale = 0.37f;
              Problem p("T " + std::to_string(T) + ", V " + std::to_string(V));
              p.in("logits_TV", c.logits_TV).in("targets_T", i32s(c.targets)).in("lse_T", from_doubles(c.lse, {T}));
              p.out("dlogits_TV", {T, V}, DType::f32,
                    {2e-6, 0, "exp_fast's 2e-7 of each probability, times scale (set_dlogits_scale)"});
              p.call = [scale](const ExecContext& ctx, Bound& t) {
                cross_entropy_backward(ctx, t.at("logits_TV"), t.at("targets_T"), t.at("lse_T"), scale,
                                       t.at("dlogits_TV"));
              };
              p.reference = [c, scale](const Bound& in, Refs& want) {
                const std::vector<double> x = values(in.at("logits_TV")), lse = values(in.at("lse_T"));
                want["dlogits_TV"].value = ref_dlogits(x, c.T, c.V, c.targets, lse, 0, scale);
                set_dlogits_scale(x, c.T, c.V, lse, scale, want["dlogits_TV"]);
              };
              Problem b = bf16_variant(p, {"lse_T"}, kBf16Dlogits);
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// One tensor-parallel rank's shard: columns [start, start + Vr) of c's logits.
Tensor shard(const CeInputs& c, int64_t start, int64_t Vr) {
  Tensor s = empty({c.T, Vr});
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t i = 0; i < Vr; ++i) s.f32()[t * Vr + i] = c.logits_TV.f32()[t * c.V + start + i];
  return s;
}

std::vector<double> row_max(const Tensor& x_TV) {
  const int64_t T = x_TV.rows(), V = x_TV.cols();
  const std::vector<double> x = values(x_TV);  // any dtype (bf16 variants)
  std::vector<double> m(T, -INFINITY);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < V; ++i) m[t] = std::max(m[t], x[t * V + i]);
  return m;
}

struct ShardCase {
  int64_t T, vocab, start, Vr;
};
// A middle shard (targets on and off it), the whole vocabulary, one column.
const ShardCase kShards[] = {{9, 1001, 250, 250}, {4, 10, 0, 10}, {3, 7, 6, 1}};

OpEntry cross_entropy_local_max_entry() {
  return {"cross_entropy_local_max", [](std::mt19937& g) {
            std::vector<Problem> ps;
            std::vector<ShardCase> cases(std::begin(kShards), std::end(kShards));
            cases.push_back({3, 8, 8, 0});  // a rank holding no columns: −inf
            for (const ShardCase& s : cases) {
              const CeInputs c = ce_inputs(s.T, s.vocab, g);
              Problem p("T " + std::to_string(s.T) + ", columns [" + std::to_string(s.start) + ", +" +
                        std::to_string(s.Vr) + ")");
              p.in("logits_TV", shard(c, s.start, s.Vr));
              p.out("max_T", {s.T}, DType::f32, {0, 0, "a maximum of fp32 values: exact"});
              p.call = [](const ExecContext& ctx, Bound& t) {
                cross_entropy_local_max(ctx, t.at("logits_TV"), t.at("max_T"));
              };
              p.reference = [](const Bound& in, Refs& want) { want["max_T"].value = row_max(in.at("logits_TV")); };
              Problem b = bf16_variant(p, {"max_T"}, {0, 0, "a maximum of bf16 values, widened to f32: exact"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry cross_entropy_local_sums_entry() {
  return {"cross_entropy_local_sums", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const ShardCase& s : kShards) {
              CeInputs c = ce_inputs(s.T, s.vocab, g);
              c.targets[s.T - 1] = static_cast<int32_t>(s.start);  // at least one target on this shard
              const Tensor x = shard(c, s.start, s.Vr);
              Problem p("T " + std::to_string(s.T) + ", columns [" + std::to_string(s.start) + ", +" +
                        std::to_string(s.Vr) + ") of " + std::to_string(s.vocab));
              p.in("logits_TV", x).in("targets_T", i32s(c.targets)).in("max_T", from_doubles(row_max(x), {s.T}));
              const Tol sums_tol{2e-6, 0,
                                 "row 0: exp of the fp32-rounded logit − max (~1e-6 at |x − max| <= 20); row 1 copied"};
              p.out("sums_2T", {2, s.T}, DType::f64, sums_tol);
              p.call = [s](const ExecContext& ctx, Bound& t) {
                cross_entropy_local_sums(ctx, t.at("logits_TV"), t.at("targets_T"), t.at("max_T"), s.start, s.vocab,
                                         t.at("sums_2T"));
              };
              p.reference = [s, c](const Bound& in, Refs& want) {
                const std::vector<double> xv = values(in.at("logits_TV")), mx = values(in.at("max_T"));
                Ref& r = want["sums_2T"];
                r.value.assign(2 * s.T, 0.0);
                for (int64_t t = 0; t < s.T; ++t) {
                  for (int64_t i = 0; i < s.Vr; ++i) r.value[t] += std::exp(xv[t * s.Vr + i] - mx[t]);
                  const int64_t local = c.targets[t] - s.start;
                  if (local >= 0 && local < s.Vr) r.value[s.T + t] = xv[t * s.Vr + local];
                }
                for (double v : r.value) r.scale.push_back(std::abs(v));
              };
              Problem b = bf16_variant(p, {"max_T"}, sums_tol);  // sums stay f64, max_T f32
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry cross_entropy_finish_entry() {
  return {"cross_entropy_finish", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (int64_t T : {1, 9, 100}) {
              std::vector<double> sums(2 * T);
              std::uniform_real_distribution<double> row0(1.0, 1000.0);  // Σ exp(x − max) >= 1
              std::normal_distribution<double> row1(0.0, 3.0);
              for (int64_t t = 0; t < T; ++t) sums[t] = row0(g), sums[T + t] = row1(g);
              Tensor sums_2T = empty({2, T}, DType::f64);
              std::copy(sums.begin(), sums.end(), sums_2T.data<double>());
              Problem p("T " + std::to_string(T));
              p.in("max_T", randn({T}, g, 3.0f)).in("sums_2T", sums_2T);
              const Tol once{1.2e-7, 0, "computed in double, rounded once to fp32 (scale |lse| + |loss|)"};
              p.out("loss_T", {T}, DType::f32, once).out("lse_T", {T}, DType::f32, once);
              p.call = [](const ExecContext& ctx, Bound& t) {
                cross_entropy_finish(ctx, t.at("max_T"), t.at("sums_2T"), t.at("loss_T"), t.at("lse_T"));
              };
              p.reference = [T](const Bound& in, Refs& want) {
                const std::vector<double> mx = values(in.at("max_T")), s = values(in.at("sums_2T"));
                for (int64_t t = 0; t < T; ++t) {
                  const double lse = mx[t] + std::log(s[t]), loss = lse - s[T + t];
                  want["loss_T"].value.push_back(loss);
                  want["lse_T"].value.push_back(lse);
                  want["loss_T"].scale.push_back(std::abs(lse) + std::abs(loss));
                  want["lse_T"].scale.push_back(std::abs(lse) + std::abs(loss));
                }
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

OpEntry cross_entropy_local_backward_entry() {
  return {"cross_entropy_local_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const ShardCase& s : kShards) {
              CeInputs c = ce_inputs(s.T, s.vocab, g);
              c.targets[s.T - 1] = static_cast<int32_t>(s.start);
              const float scale = 0.37f;
              Problem p("T " + std::to_string(s.T) + ", columns [" + std::to_string(s.start) + ", +" +
                        std::to_string(s.Vr) + ") of " + std::to_string(s.vocab));
              p.in("logits_TV", shard(c, s.start, s.Vr)).in("targets_T", i32s(c.targets));
              p.in("lse_T", from_doubles(c.lse, {s.T}));  // the whole row's, as after the reductions
              p.out("dlogits_TV", {s.T, s.Vr}, DType::f32,
                    {1e-6, 0, "expf of an fp32-rounded difference (~1e-6 at |difference| <= 20), times scale"});
              p.call = [s, scale](const ExecContext& ctx, Bound& t) {
                cross_entropy_local_backward(ctx, t.at("logits_TV"), t.at("targets_T"), t.at("lse_T"), s.start, scale,
                                             t.at("dlogits_TV"));
              };
              p.reference = [s, c, scale](const Bound& in, Refs& want) {
                const std::vector<double> x = values(in.at("logits_TV")), lse = values(in.at("lse_T"));
                want["dlogits_TV"].value = ref_dlogits(x, s.T, s.Vr, c.targets, lse, s.start, scale);
                set_dlogits_scale(x, s.T, s.Vr, lse, scale, want["dlogits_TV"]);
              };
              Problem b = bf16_variant(p, {"lse_T"}, kBf16Dlogits);
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> loss_ops() {
  return {cross_entropy_forward_entry(),       cross_entropy_backward_entry(),
          cross_entropy_local_max_entry(),     cross_entropy_local_sums_entry(),
          cross_entropy_finish_entry(),        cross_entropy_local_backward_entry()};
}

}  // namespace origami::testing::backend_ops
