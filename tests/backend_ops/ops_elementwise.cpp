// The harness's table, elementwise part: axpy, scaling, the reductions
// (fresh and accumulating) and the dtype cast. Each entry: problems over
// several shapes (edge sizes included) from fresh random inputs, a naive fp64
// reference, and a tolerance per output with its reason.
#include <cmath>

#include "backend_ops/harness.h"
#include "kernels/elementwise.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

OpEntry axpy_entry() {
  return {"axpy", [](std::mt19937& g) {
            std::vector<Problem> ps;
            auto add = [&](int64_t n, float a, bool integers) {
              Problem p("n " + std::to_string(n) + ", a " + std::to_string(a) + (integers ? ", integers" : ", randn"));
              // Integers: y > 0 and a·x > 0 (a < 0, x < 0), so y + a·x never
              // cancels to an all-zero reference on a one-element draw.
              p.in("x", integers ? randint({n}, g, -9, -1) : randn({n}, g));
              p.inout("y", integers ? randint({n}, g, 1, 9) : randn({n}, g),
                      integers ? Tol{0, 0, "integers plus a short binary fraction times integers: exact"}
                               : Tol{2.4e-7, 0, "a·x and the sum each rounded once: <= 2u of |y| + |a·x|"});
              p.call = [a](const ExecContext& ctx, Bound& t) { axpy(ctx, a, t.at("x"), t.at("y")); };
              p.reference = [a](const Bound& in, Refs& want) {
                const std::vector<double> x = values(in.at("x")), y = values(in.at("y"));
                Ref& r = want["y"];
                for (size_t i = 0; i < x.size(); ++i) {
                  r.value.push_back(y[i] + double(a) * x[i]);
                  r.scale.push_back(std::abs(y[i]) + std::abs(double(a) * x[i]));
                }
              };
              // bf16 x and y (CUDA only): |y + a·x| <= 31.5 in halves, 6 significant bits: exact in bf16.
              Problem b = bf16_variant(p, {},
                                       integers ? Tol{0, 0, "integers plus halves, at most 6 significant bits: exact"}
                                                : Tol{4e-3, 0, "one fp32 fma rounded once to bf16: 2^-8 of |y + a·x|"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            };
            for (int64_t n : {1, 17, 4099}) add(n, -2.5f, true);  // odd lengths: vector-loop tails
            add(1000, 0.3f, false);
            return ps;
          }};
}

OpEntry scale_inplace_entry() {
  return {"scale_inplace", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (int64_t n : {1, 33, 4099})
              for (float a : {0.5f, -3.0f}) {
                Problem p("n " + std::to_string(n) + ", a " + std::to_string(a));
                p.inout("y", randint({n}, g, -9, 9), {0, 0, "small integers times 0.5 or −3: exact"});
                p.call = [a](const ExecContext& ctx, Bound& t) { scale_inplace(ctx, t.at("y"), a); };
                p.reference = [a](const Bound& in, Refs& want) {
                  for (double y : values(in.at("y"))) want["y"].value.push_back(y * a);
                };
                Problem b = bf16_variant(p, {}, {0, 0, "small integers times 0.5 or −3 (<= 5 bits): exact in bf16"});
                ps.push_back(std::move(p));
                ps.push_back(std::move(b));
              }
            return ps;
          }};
}

// sum_squares / sum: one fp64 result, written to a host f64 [1].
OpEntry reduction_entry(const char* name, bool squares) {
  return {name, [squares](std::mt19937& g) {
            std::vector<Problem> ps;
            // 5,000,007: past the 2M elements where the CUDA reduction's
            // blocks take more than one chunk each.
            for (int64_t n : {1, 7, 4097, 30011, 5000007}) {
              Problem p("n " + std::to_string(n));
              p.in("x", randn({n}, g, 3.0f));
              // Both sides sum fp32 values (squares exact in fp64) in fp64, in different orders.
              const Tol tol{1.2e-16 * double(n), 0, "fp64 sums of n terms in any order: <= n·eps64 of Σ|terms|"};
              p.out("result", {1}, DType::f64, tol, Where::host);
              p.call = [squares](const ExecContext& ctx, Bound& t) {
                t.at("result").data<double>()[0] = squares ? sum_squares(ctx, t.at("x")) : sum(ctx, t.at("x"));
              };
              p.reference = [squares](const Bound& in, Refs& want) {
                double s = 0.0, mag = 0.0;
                for (double x : values(in.at("x"))) {
                  s += squares ? x * x : x;
                  mag += squares ? x * x : std::abs(x);
                }
                want["result"] = {{s}, {mag}};
              };
              // bf16 x (CUDA only): widened exactly, then the same fp64 sums (the result is host f64).
              Problem b = bf16_variant(p, {}, tol);
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

// cast: f32 → bf16 against an independent nearest-even rounding in fp64
// (scale the value to 8 significant bits, nearbyint — ties to even in the
// default rounding mode — and scale back), with exact ties planted; bf16 →
// f32 and same-dtype copies are exact. Every result is exactly representable.
double ref_bf16(double x) {
  if (x == 0.0) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(std::nearbyint(std::ldexp(x, 8 - e)), e - 8);
}

OpEntry cast_entry() {
  return {"cast", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const Tol exact{0, 0, "rounding to nearest even is exact arithmetic"};
            for (int64_t n : {1, 17, 4099}) {
              Tensor x = randn({n}, g, 3.0f);
              // Ties (half an ulp of bf16 above a value with an even and an odd last bit) and an ulp above.
              const float planted[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(2.0f + 0x1p-7f), 1.0f + 0x1p-8f + 0x1p-20f};
              for (int64_t i = 0; i < std::min<int64_t>(n, 4); ++i) x.f32()[i] = planted[i];
              for (auto [from, to] : {std::pair{DType::f32, DType::bf16}, {DType::bf16, DType::f32},
                                      {DType::f32, DType::f32}, {DType::bf16, DType::bf16}}) {
                Problem p("n " + std::to_string(n) + ", " + std::string(to_string(from)) + " to " +
                          std::string(to_string(to)));
                Tensor src = x;
                if (from == DType::bf16) {  // the bf16 input: x rounded by the reference rule
                  std::vector<double> r;
                  for (double v : values(x)) r.push_back(ref_bf16(v));
                  src = empty({n}, DType::bf16);
                  cast(ExecContext::cpu(1), from_doubles(r, {n}), src);
                }
                p.in("src", src).out("dst", {n}, to, exact);
                p.call = [](const ExecContext& ctx, Bound& t) { cast(ctx, t.at("src"), t.at("dst")); };
                p.reference = [to](const Bound& in, Refs& want) {
                  for (double v : values(in.at("src"))) want["dst"].value.push_back(to == DType::bf16 ? ref_bf16(v) : v);
                };
                ps.push_back(std::move(p));
              }
            }
            return ps;
          }};
}

OpEntry accumulate_entry(const char* name, bool squares) {
  return {name, [squares](std::mt19937& g) {
            std::vector<Problem> ps;
            for (int64_t n : {1, 4097, 30011}) {
              Problem p("n " + std::to_string(n));
              p.in("x", randn({n}, g, 3.0f));
              Tensor acc = empty({1}, DType::f64);
              acc.data<double>()[0] = std::normal_distribution<double>(0.0, 1e3)(g);
              const Tol tol{1.2e-16 * double(n + 1), 0,
                            "fp64 sums of the start and n terms in any order: <= (n+1)·eps64 of |start| + Σ|terms|"};
              p.inout("acc", acc, tol);
              p.call = [squares](const ExecContext& ctx, Bound& t) {
                if (squares) {
                  sum_squares_add(ctx, t.at("x"), t.at("acc"));
                } else {
                  sum_add(ctx, t.at("x"), t.at("acc"));
                }
              };
              p.reference = [squares](const Bound& in, Refs& want) {
                double s = values(in.at("acc"))[0], mag = std::abs(s);
                for (double x : values(in.at("x"))) {
                  s += squares ? x * x : x;
                  mag += squares ? x * x : std::abs(x);
                }
                want["acc"] = {{s}, {mag}};
              };
              Problem b = bf16_variant(p, {}, tol);  // acc stays f64
              ps.push_back(std::move(p));
              ps.push_back(std::move(b));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> elementwise_ops() {
  return {axpy_entry(),
          scale_inplace_entry(),
          reduction_entry("sum_squares", true),
          accumulate_entry("sum_squares_add", true),
          reduction_entry("sum", false),
          accumulate_entry("sum_add", false),
          cast_entry()};
}

}  // namespace origami::testing::backend_ops
