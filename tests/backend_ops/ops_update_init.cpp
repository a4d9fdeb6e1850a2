// The harness's table, parameter part: AdamW (per tensor, and fused over a
// unit's runs with the clip's scale and the bf16 working copy) and the
// layout-independent init. Each entry: problems from fresh random inputs,
// a naive fp64 reference (torch.optim.AdamW's arithmetic; the Philox4x32-10
// and Box-Muller definition of init.h), a tolerance per output with its
// reason.
#include <cmath>
#include <numbers>
#include <tuple>

#include "backend_ops/harness.h"
#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "kernels/init.h"

namespace origami::testing::backend_ops {
namespace {

// ---------------------------------------------------------------- adamw

// torch.optim.AdamW (foreach=False) in double, element i with weight decay
// wd(i); the per-element scales of the bounds below.
template <class Wd>
void adamw_reference(const AdamWStep& s, const std::vector<double>& p0, const std::vector<double>& gr,
                     const std::vector<double>& m0, const std::vector<double>& v0, Wd wd, Ref& P, Ref& M, Ref& V) {
  const double b1 = s.beta1, b2 = s.beta2, lr = s.lr, eps = s.eps;
  const double bc1 = 1 - std::pow(b1, double(s.step)), bc2 = 1 - std::pow(b2, double(s.step));
  for (size_t i = 0; i < p0.size(); ++i) {
    const double m = b1 * m0[i] + (1 - b1) * gr[i], v = b2 * v0[i] + (1 - b2) * gr[i] * gr[i];
    const double p = p0[i] * (1 - lr * wd(i)) - lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
    M.value.push_back(m);
    M.scale.push_back(std::abs(b1 * m0[i]) + std::abs((1 - b1) * gr[i]));
    V.value.push_back(v);
    V.scale.push_back(std::abs(b2 * v0[i]) + std::abs((1 - b2) * gr[i] * gr[i]));
    P.value.push_back(p);
    P.scale.push_back(std::abs(p - p0[i]) + 0.1 * std::abs(p0[i]));
  }
}

// The step (O(lr)) is small next to |p|: the bound is 4e-6 of the step (its
// fp32 arithmetic — a square root, a division, two products and a sum — is
// a few ulp, ~3e-7) plus 4e-7 of |p| (fp32 rounding of p(1 − lr·wd) and of
// the subtraction, 2 ulp = 1.2e-7).
const Tol kAdamWParamTol{4e-6, 0, "a few ulp of the step + a few ulp of |p| (scale |Δ| + 0.1·|p|)"};
const Tol kAdamWMomentTol{4e-7, 0, "two rounded products and a sum: a few ulp of |β·m| + |(1−β)·g|"};

Tensor second_moment(int64_t n, std::mt19937& g) {
  Tensor v = randn({n}, g, 0.1f);
  for (int64_t i = 0; i < n; ++i) v.f32()[i] *= v.f32()[i];  // >= 0
  return v;
}

OpEntry adamw_entry() {
  return {"adamw_update", [](std::mt19937& g) {
            std::vector<Problem> ps;
            // eps 0.3, beside √v̂ ~ 0.1-0.5: where eps sits (outside the
            // square root, unscaled by √bc2) changes the step by O(1); at
            // 1e-8 it is below fp32 rounding.
            for (auto [n, step, eps] : {std::tuple<int64_t, int64_t, float>{1003, 1, 1e-8f}, {17, 3, 1e-8f},
                                        {1, 1000, 1e-8f}, {257, 2, 0.3f}}) {
              AdamWStep s;
              s.lr = 1e-2f;
              s.weight_decay = 0.1f;
              s.step = step;
              s.eps = eps;
              Problem p("n " + std::to_string(n) + ", step " + std::to_string(step) + ", eps " + std::to_string(eps));
              p.inout("param", randn({n}, g), kAdamWParamTol);
              p.in("grad", randn({n}, g, 0.5f));
              p.inout("exp_avg", randn({n}, g, 0.1f), kAdamWMomentTol)
                  .inout("exp_avg_sq", second_moment(n, g), kAdamWMomentTol);
              p.call = [s](const ExecContext& ctx, Bound& t) {
                adamw_update(ctx, t.at("param"), t.at("grad"), t.at("exp_avg"), t.at("exp_avg_sq"), s);
              };
              p.reference = [s](const Bound& in, Refs& want) {
                adamw_reference(s, values(in.at("param")), values(in.at("grad")), values(in.at("exp_avg")),
                                values(in.at("exp_avg_sq")), [&](size_t) { return double(s.weight_decay); },
                                want["param"], want["exp_avg"], want["exp_avg_sq"]);
              };
              // A bf16 grad (CUDA only), widened exactly: the fp32 state's bounds stand.
              Problem b = bf16_variant(p, {"param", "exp_avg", "exp_avg_sq"}, kAdamWMomentTol,
                                       {{"param", kAdamWParamTol}});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// One unit's step: the clip scale applied to the gradient in place, runs of
// different weight decay (a 1-element run, one that starts off a 16-byte
// boundary, an empty one), and in bf16 the working copy written as the
// master rounded.
OpEntry adamw_fused_entry() {
  return {"adamw_update_fused", [](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Case {
              std::vector<AdamWSegment> segments;
              float grad_scale;
              int64_t step;
            };
            const std::vector<Case> cases = {
                {{{0, 1, 0.0f}, {1, 690, 0.1f}, {691, 0, 0.0f}, {691, 312, 0.0f}}, 0.37f, 3},
                {{{0, 1003, 0.1f}}, 1.0f, 1},
                {{{0, 5, 0.0f}, {5, 12, 0.1f}}, 0.5f, 1000}};
            for (const Case& c : cases) {
              const int64_t n = c.segments.back().begin + c.segments.back().numel;
              AdamWStep s;
              s.lr = 1e-2f;
              s.step = c.step;
              const auto label = "n " + std::to_string(n) + " in " + std::to_string(c.segments.size()) +
                                 " runs, scale " + std::to_string(c.grad_scale) + ", step " + std::to_string(c.step);
              // The base carries the bf16 working copy as an f32 out for
              // bf16_variant to turn into bf16; only the variant runs with it.
              Problem p(label);
              p.inout("master", randn({n}, g), kAdamWParamTol);
              const Tol grad_tol = c.grad_scale == 1.0f ? Tol{0, 0, "scale 1: untouched"}
                                                        : Tol{6e-8, 0, "one f32 product, rounded once"};
              p.inout("grad", randn({n}, g, 0.5f), grad_tol);
              p.inout("exp_avg", randn({n}, g, 0.1f), kAdamWMomentTol)
                  .inout("exp_avg_sq", second_moment(n, g), kAdamWMomentTol);
              Problem with_copy = p;
              with_copy.out("param", {n}, DType::f32, {});
              const auto call = [c, s](const ExecContext& ctx, Bound& t) {
                Tensor none;
                const auto it = t.find("param");
                adamw_update_fused(ctx, t.at("master"), t.at("grad"), t.at("exp_avg"), t.at("exp_avg_sq"),
                                   it == t.end() ? none : it->second, c.segments, c.grad_scale, s);
              };
              // A bf16 gradient is read as scale_inplace leaves it: the
              // product rounded to bf16.
              const auto reference = [c, s](const Bound& in, Refs& want) {
                std::vector<double> gr = values(in.at("grad"));
                const bool bf16 = in.at("grad").dtype() == DType::bf16;
                for (double& x : gr) {
                  if (c.grad_scale == 1.0f) continue;
                  const float scaled = static_cast<float>(x * c.grad_scale);
                  x = bf16 ? bf16_value(bf16_bits(scaled)) : double(scaled);
                }
                Ref& G = want["grad"];
                G.value = gr;
                for (double x : gr) G.scale.push_back(std::abs(x));
                std::vector<double> wd(gr.size());
                for (const AdamWSegment& r : c.segments)
                  for (int64_t i = r.begin; i < r.begin + r.numel; ++i) wd[i] = r.weight_decay;
                adamw_reference(s, values(in.at("master")), gr, values(in.at("exp_avg")), values(in.at("exp_avg_sq")),
                                [&](size_t i) { return wd[i]; }, want["master"], want["exp_avg"], want["exp_avg_sq"]);
                if (!in.count("param")) return;
                const Ref& M = want["master"];
                Ref& P = want["param"];
                P.value = M.value;
                // |p| for the rounding, + the master's own bound (4e-6 of its
                // scale: 1e-3 of it at the 4e-3 below).
                for (size_t i = 0; i < M.value.size(); ++i)
                  P.scale.push_back(std::abs(M.value[i]) + 1e-3 * M.scale[i]);
              };
              p.call = with_copy.call = call;
              p.reference = with_copy.reference = reference;
              ps.push_back(std::move(p));
              // bf16 grad and working copy; master and moments stay f32.
              ps.push_back(bf16_variant(with_copy, {"master", "exp_avg", "exp_avg_sq"}, kAdamWMomentTol,
                                        {{"master", kAdamWParamTol},
                                         {"grad", c.grad_scale == 1.0f ? Tol{0, 0, "scale 1: untouched"}
                                                                       : Tol{4e-3, 0, "rounded to bf16 once: 2^-8"}},
                                         {"param", Tol{4e-3, 0, "the master rounded to bf16 once: 2^-8 of |p|, "
                                                                "+ its own bound"}}}));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- init

// init.h's definition: Philox4x32-10 with key = name_hash(name), counter =
// (element, seed); one Box-Muller draw (cosine branch) from two 53-bit
// uniforms, in double.
double ref_init_normal(uint64_t seed, uint64_t hash, uint64_t i) {
  const auto r = philox4x32_10({uint32_t(i), uint32_t(i >> 32), uint32_t(seed), uint32_t(seed >> 32)},
                               {uint32_t(hash), uint32_t(hash >> 32)});
  auto uniform53 = [](uint32_t hi, uint32_t lo) { return double(((uint64_t(hi) << 32) | lo) >> 11) * 0x1.0p-53; };
  const double u1 = 1.0 - uniform53(r[0], r[1]), u2 = uniform53(r[2], r[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

OpEntry init_normal_entry() {
  return {"init_normal", [](std::mt19937& g) {
            std::vector<Problem> ps;
            // Offsets past 2^32 exercise the counter's high word.
            for (auto [n, offset] : {std::pair<int64_t, int64_t>{1, 0}, {1000, 123456789012}, {37, 5}}) {
              const uint64_t seed = g();
              const float sd = 0.02f;
              Problem p("n " + std::to_string(n) + ", offset " + std::to_string(offset));
              p.out("out", {n}, DType::f32,
                    {1.2e-7, 0, "a double sample rounded once to fp32 (per-element scale |want|)"});
              p.call = [=](const ExecContext& ctx, Bound& t) {
                init_normal(ctx, t.at("out"), seed, "layers.0.w", offset, sd);
              };
              p.reference = [=](const Bound&, Refs& want) {
                for (int64_t j = 0; j < n; ++j) {
                  const double v = double(sd) * ref_init_normal(seed, name_hash("layers.0.w"), uint64_t(offset + j));
                  want["out"].value.push_back(v);
                  want["out"].scale.push_back(std::abs(v));
                }
              };
              Problem b = bf16_variant(p, {}, {4e-3, 0, "the fp32 sample rounded once more, to bf16: 2^-8 of |want|"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

OpEntry init_constant_entry() {
  return {"init_constant", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (int64_t n : {1, 1001}) {
              const float value = std::uniform_real_distribution<float>(0.5f, 2.0f)(g);
              Problem p("n " + std::to_string(n));
              p.out("out", {n}, DType::f32, {0, 0, "a copied constant: exact"});
              p.call = [value](const ExecContext& ctx, Bound& t) { init_constant(ctx, t.at("out"), value); };
              p.reference = [n, value](const Bound&, Refs& want) { want["out"].value.assign(n, value); };
              Problem b = bf16_variant(p, {}, {4e-3, 0, "the constant rounded once to bf16: 2^-8 relative"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> update_init_ops() {
  return {adamw_entry(), adamw_fused_entry(), init_normal_entry(), init_constant_entry()};
}

}  // namespace origami::testing::backend_ops
