// The harness's table, dense part: rmsnorm, rope, swiglu, embedding
// (elementwise ops and reductions: ops_elementwise.cpp; AdamW and init:
// ops_update_init.cpp). Each entry:
// problems over several shapes (edge sizes included) from fresh random
// inputs, a naive fp64 reference, and a tolerance per output with its reason.
#include <cmath>

#include "backend_ops/harness.h"
#include "kernels/embedding.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

// ---------------------------------------------------------------- rmsnorm

OpEntry rmsnorm_forward_entry() {
  return {"rmsnorm_forward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            // Model widths too: 4096 (Mixtral), 12288 (past the CUDA kernel's
            // 2048 columns per pass), and 9000 short rows.
            for (auto [T, D] :
                 {std::pair<int64_t, int64_t>{13, 67}, {1, 1}, {4, 256}, {3, 1000}, {40, 4096}, {20, 12288}, {9000, 64}}) {
              const float eps = 1e-5f;
              Problem p("T " + std::to_string(T) + ", D " + std::to_string(D));
              const Tol tol{2e-6, 0, "fp32 sum of D squares, then rsqrt and two products: a few ulp"};
              p.in("x_TD", randn({T, D}, g, 2.0f)).in("w_D", randn({D}, g));
              p.out("y_TD", {T, D}, DType::f32, tol).out("rstd_T", {T}, DType::f32, tol);
              p.call = [eps](const ExecContext& ctx, Bound& t) {
                rmsnorm_forward(ctx, t.at("x_TD"), t.at("w_D"), eps, t.at("y_TD"), t.at("rstd_T"));
              };
              p.reference = [=](const Bound& in, Refs& want) {
                const std::vector<double> x = values(in.at("x_TD"));
                want["y_TD"].value = ref_rmsnorm(x, values(in.at("w_D")), T, D, eps);
                for (int64_t t = 0; t < T; ++t) {
                  double ss = 0.0;
                  for (int64_t i = 0; i < D; ++i) ss += x[t * D + i] * x[t * D + i];
                  want["rstd_T"].value.push_back(1.0 / std::sqrt(ss / D + eps));
                }
              };
              // bf16 x, w, y (CUDA only); rstd stays f32, from the same exactly widened x.
              Problem b = bf16_variant(p, {"rstd_T"}, {5e-3, 0, "y rounded once to bf16 (2^-8 of |y|) after fp32 math"},
                                       {{"rstd_T", tol}});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// dx = r·w⊙dy − r³/D · x · Σ_j w_j·dy_j·x_j per row (r = the saved rstd);
// dw += Σ_t dy ⊙ x · r.
// Under bf16 data, dw may be the f32 master gradient (CUDA only).
// dw: an fp32 sum over T rows of one product each, added to dw (exact bf16
// products into an f32 dw alike), against |dw| + Σ|products|, the scale the
// references give per element. The worst case, (T + 1)·2^-24 of it, would
// hide a lost row at T = 9000 (one row is ~1/T of the scale); the rounding
// errors of random terms add like a random walk, so 4·sqrt(T + 1)·2^-24,
// which is also at least the worst case up to T = 15.
Tol norm_dw_tol(int64_t T) {
  return {4.0 * std::sqrt(static_cast<double>(T + 1)) * 0x1p-24, 0,
          "an fp32 sum of T + 1 random terms: 4·sqrt(T + 1)·2^-24 of |dw| + Σ|terms|"};
}
// dw's reference and its per-element scale: dw0 + Σ_t dy·x·rstd.
Ref norm_dw_reference(const std::vector<double>& dy, const std::vector<double>& x, const std::vector<double>& r,
                      std::vector<double> dw, int64_t T, int64_t D) {
  Ref ref;
  ref.scale.resize(dw.size());
  for (int64_t i = 0; i < D; ++i) ref.scale[i] = std::abs(dw[i]);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D; ++i) {
      const double term = dy[t * D + i] * x[t * D + i] * r[t];
      dw[i] += term;
      ref.scale[i] += std::abs(term);
    }
  ref.value = std::move(dw);
  return ref;
}
OpEntry rmsnorm_backward_entry() {
  return {"rmsnorm_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            // Model widths (4096; 12288, past 8192 where the CUDA backward
            // splits) and 9000 tokens (chunks of more than 16 rows).
            for (auto [T, D] :
                 {std::pair<int64_t, int64_t>{13, 67}, {1, 1}, {64, 48}, {40, 4096}, {20, 12288}, {9000, 64}}) {
              Problem p("T " + std::to_string(T) + ", D " + std::to_string(D));
              Tensor x = randn({T, D}, g, 2.0f);
              std::vector<double> rstd(T);
              for (int64_t t = 0; t < T; ++t) {
                double ss = 0.0;
                for (int64_t i = 0; i < D; ++i) ss += double(x.f32()[t * D + i]) * x.f32()[t * D + i];
                rstd[t] = 1.0 / std::sqrt(ss / D + 1e-5);
              }
              p.in("dy_TD", randn({T, D}, g)).in("x_TD", x).in("w_D", randn({D}, g));
              p.in("rstd_T", from_doubles(rstd, {T}));
              p.out("dx_TD", {T, D}, DType::f32,
                    {1e-5, 0, "fp32 dot of D terms, then a difference of two terms (scale: their magnitudes)"});
              p.inout("dw_D", randn({D}, g), norm_dw_tol(T));
              p.call = [=](const ExecContext& ctx, Bound& t) {
                Tensor ws = poisoned_workspace(ctx, rmsnorm_backward_workspace_bytes(ctx, T, D));
                rmsnorm_backward(ctx, t.at("dy_TD"), t.at("x_TD"), t.at("w_D"), t.at("rstd_T"), t.at("dx_TD"),
                                 t.at("dw_D"), ws);
              };
              p.reference = [=](const Bound& in, Refs& want) {
                const std::vector<double> dy = values(in.at("dy_TD")), xv = values(in.at("x_TD")),
                                          w = values(in.at("w_D")), r = values(in.at("rstd_T"));
                std::vector<double> dx(T * D), dx_scale(T * D);
                for (int64_t t = 0; t < T; ++t) {
                  double dot = 0.0, dot_abs = 0.0;
                  for (int64_t i = 0; i < D; ++i) {
                    dot += w[i] * dy[t * D + i] * xv[t * D + i];
                    dot_abs += std::abs(w[i] * dy[t * D + i] * xv[t * D + i]);
                  }
                  const double c = r[t] * r[t] * r[t] / D;
                  for (int64_t i = 0; i < D; ++i) {
                    dx[t * D + i] = r[t] * w[i] * dy[t * D + i] - c * xv[t * D + i] * dot;
                    // At D = 1 the two terms cancel to O(eps): measure against them.
                    dx_scale[t * D + i] = std::abs(r[t] * w[i] * dy[t * D + i]) + c * std::abs(xv[t * D + i]) * dot_abs;
                  }
                }
                want["dx_TD"] = {dx, dx_scale};
                want["dw_D"] = norm_dw_reference(dy, xv, r, values(in.at("dw_D")), T, D);
              };
              // bf16 dy, x, w, dx and dw (CUDA only), then with an f32 dw (the master gradient).
              const Tol bf16_out{5e-3, 0, "rounded once to bf16 (2^-8 of |dx| <= its scale, of |dw|) after fp32 math"};
              Problem b = bf16_variant(p, {"rstd_T"}, bf16_out);
              Problem bw = bf16_variant(p, {"rstd_T", "dw_D"}, bf16_out, {{"dw_D", norm_dw_tol(T)}});
              bw.label += " (dw f32)";
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
              ps.push_back(std::move(bw));
            }
            return ps;
          }};
}

// rmsnorm_backward's two halves, each against the same reference: the input
// half's dx (no workspace) and the weight half's dw (no w).
enum class NormHalf { input, weight };
OpEntry rmsnorm_backward_half_entry(const char* name, NormHalf half) {
  return {name, [half](std::mt19937& g) {
            std::vector<Problem> ps;
            // Model widths (4096; 12288, past 8192 where the CUDA backward
            // splits) and 9000 tokens (chunks of more than 16 rows).
            for (auto [T, D] :
                 {std::pair<int64_t, int64_t>{13, 67}, {1, 1}, {64, 48}, {40, 4096}, {20, 12288}, {9000, 64}}) {
              Problem p("T " + std::to_string(T) + ", D " + std::to_string(D));
              Tensor x = randn({T, D}, g, 2.0f);
              std::vector<double> rstd(T);
              for (int64_t t = 0; t < T; ++t) {
                double ss = 0.0;
                for (int64_t i = 0; i < D; ++i) ss += double(x.f32()[t * D + i]) * x.f32()[t * D + i];
                rstd[t] = 1.0 / std::sqrt(ss / D + 1e-5);
              }
              p.in("dy_TD", randn({T, D}, g)).in("x_TD", x);
              if (half == NormHalf::input) p.in("w_D", randn({D}, g));
              p.in("rstd_T", from_doubles(rstd, {T}));
              if (half == NormHalf::input)
                p.out("dx_TD", {T, D}, DType::f32,
                      {1e-5, 0, "fp32 dot of D terms, then a difference of two terms (scale: their magnitudes)"});
              else
                p.inout("dw_D", randn({D}, g), norm_dw_tol(T));
              p.call = [=](const ExecContext& ctx, Bound& t) {
                if (half == NormHalf::input) {
                  rmsnorm_backward_input(ctx, t.at("dy_TD"), t.at("x_TD"), t.at("w_D"), t.at("rstd_T"), t.at("dx_TD"));
                  return;
                }
                Tensor ws = poisoned_workspace(ctx, rmsnorm_backward_weight_workspace_bytes(ctx, T, D));
                rmsnorm_backward_weight(ctx, t.at("dy_TD"), t.at("x_TD"), t.at("rstd_T"), t.at("dw_D"), ws);
              };
              p.reference = [=](const Bound& in, Refs& want) {
                const std::vector<double> dy = values(in.at("dy_TD")), xv = values(in.at("x_TD")),
                                          r = values(in.at("rstd_T"));
                if (half == NormHalf::weight) {
                  want["dw_D"] = norm_dw_reference(dy, xv, r, values(in.at("dw_D")), T, D);
                  return;
                }
                const std::vector<double> w = values(in.at("w_D"));
                std::vector<double> dx(T * D), dx_scale(T * D);
                for (int64_t t = 0; t < T; ++t) {
                  double dot = 0.0, dot_abs = 0.0;
                  for (int64_t i = 0; i < D; ++i) {
                    dot += w[i] * dy[t * D + i] * xv[t * D + i];
                    dot_abs += std::abs(w[i] * dy[t * D + i] * xv[t * D + i]);
                  }
                  const double c = r[t] * r[t] * r[t] / D;
                  for (int64_t i = 0; i < D; ++i) {
                    dx[t * D + i] = r[t] * w[i] * dy[t * D + i] - c * xv[t * D + i] * dot;
                    dx_scale[t * D + i] = std::abs(r[t] * w[i] * dy[t * D + i]) + c * std::abs(xv[t * D + i]) * dot_abs;
                  }
                }
                want["dx_TD"] = {dx, dx_scale};
              };
              // bf16 data (CUDA only); the weight half also into an f32 dw (the master gradient).
              ps.push_back(bf16_variant(
                  p, {"rstd_T"},
                  {5e-3, 0, "rounded once to bf16 (2^-8 of |dx| <= its scale, of |dw|) after fp32 math"}));
              if (half == NormHalf::weight) {
                ps.push_back(bf16_variant(p, {"rstd_T", "dw_D"}, {}, {{"dw_D", norm_dw_tol(T)}}));
                ps.back().label += " (dw f32)";
              }
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- rope

// x rotated by sign · angle in double: the forward (+1) and its gradient (−1).
std::vector<double> ref_rope(const std::vector<double>& x, const std::vector<int32_t>& pos, int64_t B, int64_t S,
                             int64_t H, int64_t hd, double theta, double sign) {
  std::vector<double> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const int64_t base = ((b * S + s) * H + h) * hd;
          const double ang = sign * pos[s] * std::pow(theta, -2.0 * i / hd);
          const double a = x[base + i], c = x[base + i + hd / 2];
          y[base + i] = a * std::cos(ang) - c * std::sin(ang);
          y[base + i + hd / 2] = c * std::cos(ang) + a * std::sin(ang);
        }
  return y;
}

OpEntry rope_entry(const char* name, double sign) {
  return {name, [sign](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Shape4 {
              int64_t B, S, H, hd;
              std::vector<int32_t> pos;
              float theta;
            };
            std::uniform_int_distribution<int32_t> any_pos(0, 100000);
            std::vector<int32_t> random_pos(5);
            for (int32_t& v : random_pos) v = any_pos(g);
            // Positions non-contiguous (context-parallel chunks) and large (long context).
            // B 3 at S 600: past the CUDA grid's batch groups (ceil(1024 / S) = 2), so
            // its blocks loop over batches, as a micro-batch of 2+ long sequences does.
            std::vector<int32_t> long_pos(600);
            for (int32_t i = 0; i < 600; ++i) long_pos[i] = 3 * i + 1;
            for (const Shape4& c : {Shape4{2, 6, 3, 64, {5, 17, 1000, 3, 70000, 123}, 10000.0f},
                                    Shape4{1, 1, 1, 2, {7}, 10000.0f}, Shape4{1, 5, 2, 10, random_pos, 500000.0f},
                                    Shape4{3, 600, 2, 64, long_pos, 10000.0f}}) {
              Problem p("B " + std::to_string(c.B) + ", S " + std::to_string(c.S) + ", H " + std::to_string(c.H) +
                        ", hd " + std::to_string(c.hd));
              p.inout("x_BSHd", randn({c.B, c.S, c.H, c.hd}, g),
                      {1e-6, 0, "angles in double, cos/sin rounded to fp32 once, then two products and a sum"});
              p.in("pos_S", i32s(c.pos));
              const bool forward = sign > 0;
              const float theta = c.theta;
              p.call = [forward, theta](const ExecContext& ctx, Bound& t) {
                forward ? rope_forward(ctx, t.at("x_BSHd"), t.at("pos_S"), theta)
                        : rope_backward(ctx, t.at("x_BSHd"), t.at("pos_S"), theta);
              };
              p.reference = [c, sign](const Bound& in, Refs& want) {
                want["x_BSHd"].value = ref_rope(values(in.at("x_BSHd")), c.pos, c.B, c.S, c.H, c.hd, c.theta, sign);
              };
              Problem b =
                  bf16_variant(p, {}, {5e-3, 0, "x' rounded once to bf16 (2^-8 relative) after the fp32 rotation"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- swiglu

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// gate drawn wide, with saturated σ (±95) at the first two elements. A
// one-element gate is drawn away from silu's minimum (g ≈ −1.2785, where
// silu' = σ·(1 + g(1 − σ)) cancels to 0): that element is its tensor's
// whole scale, and a last-bit difference in σ between exp implementations
// (|g|·6e-8 in silu') would pass for a relative error there.
Tensor swiglu_gate(int64_t T, int64_t F, std::mt19937& g) {
  Tensor gate = randn({T, F}, g, 3.0f);
  if (T * F >= 2) gate.f32()[0] = 95.0f, gate.f32()[1] = -95.0f;
  while (T * F == 1 && std::abs(gate.f32()[0] + 1.2785f) < 0.1f) gate = randn({T, F}, g, 3.0f);
  return gate;
}

const std::pair<int64_t, int64_t> kSwigluShapes[] = {{9, 53}, {1, 1}, {3, 8}};
const Tol kSwigluTol{1e-6, 0, "exp_fast within 2e-7 relative; one division and two products follow"};
const Tol kSwigluBf16Tol{5e-3, 0, "rounded once to bf16 (2^-8 relative) after fp32 arithmetic good to 1e-6"};

OpEntry swiglu_forward_entry() {
  return {"swiglu_forward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (auto [T, F] : kSwigluShapes) {
              Problem p("T " + std::to_string(T) + ", F " + std::to_string(F));
              p.in("gate_TF", swiglu_gate(T, F, g)).in("up_TF", randn({T, F}, g));
              p.out("h_TF", {T, F}, DType::f32, kSwigluTol);
              p.call = [](const ExecContext& ctx, Bound& t) {
                swiglu_forward(ctx, t.at("gate_TF"), t.at("up_TF"), t.at("h_TF"));
              };
              p.reference = [](const Bound& in, Refs& want) {
                const std::vector<double> gate = values(in.at("gate_TF")), up = values(in.at("up_TF"));
                for (size_t i = 0; i < gate.size(); ++i) want["h_TF"].value.push_back(silu(gate[i]) * up[i]);
              };
              Problem b = bf16_variant(p, {}, kSwigluBf16Tol);
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry swiglu_backward_entry() {
  return {"swiglu_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (auto [T, F] : kSwigluShapes) {
              Problem p("T " + std::to_string(T) + ", F " + std::to_string(F));
              p.in("dh_TF", randn({T, F}, g)).in("gate_TF", swiglu_gate(T, F, g)).in("up_TF", randn({T, F}, g));
              p.out("dgate_TF", {T, F}, DType::f32, kSwigluTol).out("dup_TF", {T, F}, DType::f32, kSwigluTol);
              p.call = [](const ExecContext& ctx, Bound& t) {
                swiglu_backward(ctx, t.at("dh_TF"), t.at("gate_TF"), t.at("up_TF"), t.at("dgate_TF"), t.at("dup_TF"));
              };
              p.reference = [](const Bound& in, Refs& want) {
                const std::vector<double> dh = values(in.at("dh_TF")), gate = values(in.at("gate_TF")),
                                          up = values(in.at("up_TF"));
                for (size_t i = 0; i < gate.size(); ++i) {
                  want["dup_TF"].value.push_back(dh[i] * silu(gate[i]));
                  // silu' by a central difference in double (error ~1e-9 at this step).
                  const double step = 1e-4 * std::max(1.0, std::abs(gate[i]));
                  want["dgate_TF"].value.push_back(dh[i] * up[i] * (silu(gate[i] + step) - silu(gate[i] - step)) /
                                                   (2 * step));
                }
              };
              Problem b = bf16_variant(p, {}, kSwigluBf16Tol);
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- embedding

struct EmbeddingCase {
  int64_t V, D, vocab_start;
  std::vector<int32_t> ids;
};

// A shard with ids of other shards (zero rows, no gradient) and repeats;
// then long runs of one id (203 and exactly 128 tokens: a device backward
// that takes a run's tokens in rounds of 128 sees a partial, a full and an
// empty round) over rows wider than one block of columns.
std::vector<EmbeddingCase> embedding_cases(std::mt19937& g) {
  std::vector<int32_t> random_ids(64);
  std::uniform_int_distribution<int32_t> id(95, 160);  // shard [100, 150) plus neighbours
  for (int32_t& v : random_ids) v = id(g);
  std::vector<int32_t> runs(812);
  std::uniform_int_distribution<int32_t> other(-5, 44);  // shard [0, 40) plus neighbours
  for (int32_t i = 0; i < 812; ++i) {
    if (i % 4 == 0) {
      runs[i] = 7;
    } else if (i % 4 == 1 && i < 512) {
      runs[i] = 39;
    } else {
      do runs[i] = other(g);
      while (runs[i] == 7 || runs[i] == 39);
    }
  }
  return {{10, 37, 20, {23, 5, 29, 23, 20, 35, 23, 21}},
          {50, 8, 100, random_ids},
          {1, 1, 3, {3, 2, 4, 3}},
          {40, 1040, 0, runs}};
}

const Tol kExactCopy{0, 0, "rows copied, or integers summed: exact"};

OpEntry embedding_forward_entry() {
  return {"embedding_forward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const EmbeddingCase& c : embedding_cases(g)) {
              const int64_t T = static_cast<int64_t>(c.ids.size());
              Problem p("V " + std::to_string(c.V) + ", D " + std::to_string(c.D) + ", T " + std::to_string(T));
              p.in("ids_T", i32s(c.ids)).in("table_VD", randn({c.V, c.D}, g));
              p.out("out_TD", {T, c.D}, DType::f32, kExactCopy);
              p.call = [c](const ExecContext& ctx, Bound& t) {
                embedding_forward(ctx, t.at("ids_T"), t.at("table_VD"), c.vocab_start, t.at("out_TD"));
              };
              p.reference = [c, T](const Bound& in, Refs& want) {
                const std::vector<double> table = values(in.at("table_VD"));
                for (int64_t t = 0; t < T; ++t) {
                  const int64_t row = c.ids[t] - c.vocab_start;
                  for (int64_t d = 0; d < c.D; ++d)
                    want["out_TD"].value.push_back(row >= 0 && row < c.V ? table[row * c.D + d] : 0.0);
                }
              };
              Problem b = bf16_variant(p, {}, {0, 0, "bf16 rows copied into bf16: exact"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry embedding_backward_entry() {
  return {"embedding_backward", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const EmbeddingCase& c : embedding_cases(g)) {
              const int64_t T = static_cast<int64_t>(c.ids.size());
              Problem p("V " + std::to_string(c.V) + ", D " + std::to_string(c.D) + ", T " + std::to_string(T));
              // Positive integers: the sums are exact and never cancel to an all-zero table.
              p.in("ids_T", i32s(c.ids)).in("dout_TD", randint({T, c.D}, g, 1, 5));
              p.inout("dtable_VD", randint({c.V, c.D}, g, 1, 9), kExactCopy);
              p.call = [c](const ExecContext& ctx, Bound& t) {
                embedding_backward(ctx, t.at("ids_T"), t.at("dout_TD"), c.vocab_start, t.at("dtable_VD"));
              };
              p.reference = [c, T](const Bound& in, Refs& want) {
                std::vector<double> dtable = values(in.at("dtable_VD"));
                const std::vector<double> dout = values(in.at("dout_TD"));
                for (int64_t t = 0; t < T; ++t) {
                  const int64_t row = c.ids[t] - c.vocab_start;
                  if (row < 0 || row >= c.V) continue;
                  for (int64_t d = 0; d < c.D; ++d) dtable[row * c.D + d] += dout[t * c.D + d];
                }
                want["dtable_VD"].value = dtable;
              };
              Problem b = bf16_variant(p, {},
                                       {4e-3, 0,
                                        "integer sums, exact in fp32, rounded once to bf16: 2^-8 of the element, "
                                        "at most 2^-8 = 3.9e-3 of the largest"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// sum_squares_add / sum_add: the same fp64 sums (of squares or values),
// added on the context's device into a running f64 [1] that starts from a
// random value.
}  // namespace

std::vector<OpEntry> dense_ops() {
  return {rmsnorm_forward_entry(),
          rmsnorm_backward_entry(),
          rmsnorm_backward_half_entry("rmsnorm_backward_input", NormHalf::input),
          rmsnorm_backward_half_entry("rmsnorm_backward_weight", NormHalf::weight),
          rope_entry("rope_forward", 1.0),
          rope_entry("rope_backward", -1.0),
          swiglu_forward_entry(),
          swiglu_backward_entry(),
          embedding_forward_entry(),
          embedding_backward_entry()};
}

}  // namespace origami::testing::backend_ops
