// The harness's table, GEMM part: gemm (every transpose, alpha and beta,
// rank-3 operands, K = 0) and the grouped GEMM's three products over the
// segment lists of tests/grouped_gemm_cases.h. Each entry: problems from
// fresh random inputs, a naive fp64 reference, a tolerance with its reason.
#include <cmath>

#include "backend_ops/harness.h"
#include "grouped_gemm_cases.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "naive_ops.h"

namespace origami::testing::backend_ops {
namespace {

const char* trans_name(Trans t) { return t == Trans::no ? "n" : "t"; }

// An input as f32 for the references (bf16 variants hand them bf16; exact).
Tensor as_f32(const Tensor& t) {
  if (t.dtype() == DType::f32) return t;
  static const ExecContext host = ExecContext::cpu(1);
  Tensor f = empty(t.shape());
  cast(host, t, f);
  return f;
}

// ---------------------------------------------------------------- gemm

OpEntry gemm_entry() {
  return {"gemm", [](std::mt19937& g) {
            std::vector<Problem> ps;
            const Tol exact{0, 0, "small integers, |Σ| <= K·16, alpha and beta short binary fractions: exact"};
            auto add = [&](std::string label, Tensor A, Trans ta, Tensor B, Trans tb, Tensor C, bool overwrite,
                           float alpha, float beta, Tol tol) {
              const int64_t M = ta == Trans::no ? A.rows() : A.cols(), K = ta == Trans::no ? A.cols() : A.rows();
              const int64_t N = tb == Trans::no ? B.cols() : B.rows();
              Problem p(label + " " + trans_name(ta) + trans_name(tb));
              p.in("A", A).in("B", B);
              overwrite ? p.out("C", C.shape(), DType::f32, tol) : p.inout("C", C, tol);
              p.call = [=](const ExecContext& ctx, Bound& t) {
                gemm(ctx, t.at("A"), ta, t.at("B"), tb, t.at("C"), alpha, beta);
              };
              p.reference = [=](const Bound& in, Refs& want) {
                const std::vector<double> C0 = overwrite ? std::vector<double>(M * N) : values(in.at("C"));
                want["C"].value = ref_gemm(as_f32(in.at("A")), ta, as_f32(in.at("B")), tb, C0, M, N, K, alpha, beta);
              };
              // bf16 A and B (CUDA only): C in bf16, and C in f32.
              Problem c_bf16 = bf16_variant(
                  p, {}, {4e-3, 0, "C rounded to bf16 once (2^-8 relative) after fp32 alpha·Σ + beta·C"});
              Problem c_f32 = bf16_variant(
                  p, {"C"},
                  tol.rel == 0 ? tol : Tol{1e-5, 0, "bf16 products exact in fp32; fp32 (tensor-core) sums of 64"});
              ps.push_back(std::move(p));
              ps.push_back(std::move(c_bf16));
              ps.push_back(std::move(c_f32));
            };
            for (Trans ta : {Trans::no, Trans::yes})
              for (Trans tb : {Trans::no, Trans::yes}) {
                const int64_t M = 37, N = 29, K = 45;  // odd sizes: no kernel-friendly multiples
                Tensor A = ta == Trans::no ? randint({M, K}, g, -4, 4) : randint({K, M}, g, -4, 4);
                Tensor B = tb == Trans::no ? randint({K, N}, g, -4, 4) : randint({N, K}, g, -4, 4);
                add("M37 N29 K45 alpha 0.5 beta -1.5", A, ta, B, tb, randint({M, N}, g, -8, 8), false, 0.5f, -1.5f,
                    exact);
                // beta = 0 overwrites, even over the NaN poison (BLAS semantics).
                add("M37 N29 K45 beta 0", A, ta, B, tb, empty({M, N}), true, 1.0f, 0.0f, exact);
              }
            add("rank-3 A [3, 10, 64] read as [30, 64], randn", randn({3, 10, 64}, g), Trans::no, randn({70, 64}, g),
                Trans::yes, empty({3, 10, 70}), true, 1.0f, 0.0f,
                {1e-6, 0, "fp32 dot products of 64 unit normals: ~√64 ulp of the largest output"});
            add("M1 N1 K1", randint({1, 1}, g, 1, 9), Trans::no, randint({1, 1}, g, 1, 9), Trans::no,
                randint({1, 1}, g, 1, 9), false, 2.0f, 1.0f, exact);
            add("K0 scales C by beta", empty({4, 0}), Trans::no, empty({0, 5}), Trans::no, randint({4, 5}, g, 1, 9),
                false, 1.0f, 2.0f, exact);
            return ps;
          }};
}

// ---------------------------------------------------------------- grouped GEMM

// Y_s = X_s · op(W[g]) + beta · Y0_s, with the scale Σ|terms| + |beta · old|.
Ref naive_rows(const Tensor& X, const Tensor& W, Trans trans_w, const Segments& segs, const std::vector<double>& Y0,
               float beta) {
  const int64_t M = trans_w == Trans::yes ? W.size(1) : W.size(2);
  const int64_t K = trans_w == Trans::yes ? W.size(2) : W.size(1);
  const int64_t N = total_rows(segs);
  Ref r{std::vector<double>(N * M), std::vector<double>(N * M)};
  int64_t n0 = 0;
  for (const GemmSegment& s : segs) {
    const float* w = W.f32() + s.group * M * K;
    for (int64_t n = n0; n < n0 + s.rows; ++n)
      for (int64_t m = 0; m < M; ++m) {
        double v = beta == 0.0f ? 0.0 : double(beta) * Y0[n * M + m];
        double a = std::abs(v);
        for (int64_t k = 0; k < K; ++k) {
          const double wv = trans_w == Trans::yes ? w[m * K + k] : w[k * M + m];
          const double t = double(X.f32()[n * K + k]) * wv;
          v += t;
          a += std::abs(t);
        }
        r.value[n * M + m] = v;
        r.scale[n * M + m] = a;
      }
    n0 += s.rows;
  }
  return r;
}

// dW[g] = beta · dW0[g] + Σ_{s: g_s = g} dY_sᵀ · X_s, with the same scale.
Ref naive_wgrad(const Tensor& dY, const Tensor& X, const Segments& segs, const std::vector<double>& dW0, int64_t G,
                int64_t M, int64_t K, float beta) {
  Ref r{std::vector<double>(G * M * K), std::vector<double>(G * M * K)};
  for (int64_t i = 0; i < G * M * K; ++i) {
    r.value[i] = beta == 0.0f ? 0.0 : double(beta) * dW0[i];
    r.scale[i] = std::abs(r.value[i]);
  }
  int64_t n0 = 0;
  for (const GemmSegment& s : segs) {
    for (int64_t n = n0; n < n0 + s.rows; ++n)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) {
          const double t = double(dY.f32()[n * M + m]) * X.f32()[n * K + k];
          r.value[(s.group * M + m) * K + k] += t;
          r.scale[(s.group * M + m) * K + k] += std::abs(t);
        }
    n0 += s.rows;
  }
  return r;
}

// fp32 GEMMs with FMA accumulate an inner dimension of up to ~2600 terms
// (the weight gradient sums over a group's rows): ~u·√K·Σ|terms| in
// practice (u = 6e-8: ~3e-6 at K = 2600), K·u·Σ|terms| at worst. 2e-5 is
// ~7x the practical size and far below a wrong group, offset or transpose.
const Tol kGroupedTol{2e-5, 1e-30, "fp32 sums of <= 2600 products: ~u·√K of Σ|terms|"};
// bf16 outputs (CUDA only): Y is rounded to bf16 once (2^-8 of |Y| <= Σ|terms|); dW once per
// segment of its group (each round of the CUDA weight gradient stores it), at most 3 here.
const Tol kGroupedBf16Tol{4e-3, 1e-30, "Y rounded to bf16 once (2^-8 of Σ|terms|), fp32 sums"};
const Tol kWgradBf16Tol{1.2e-2, 1e-30, "dW rounded to bf16 once per segment of its group (<= 3: 3·2^-8 of Σ|terms|)"};

OpEntry grouped_gemm_entry() {
  return {"grouped_gemm", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const GroupedGemmCase& c : grouped_gemm_cases())
              for (Trans trans_w : {Trans::yes, Trans::no})  // forward Y = X·Wᵀ; data gradient dX = dY·W
                for (const float beta : {0.0f, 1.0f, 0.5f}) {
                  const int64_t N = total_rows(c.segs);
                  const bool fwd = trans_w == Trans::yes;
                  const int64_t in_cols = fwd ? c.K : c.M, out_cols = fwd ? c.M : c.K;
                  Problem p(std::string(c.name) + (trans_w == Trans::yes ? ", X·Wᵀ" : ", dY·W") + ", beta " +
                            std::to_string(beta));
                  p.in("X", randn({N, in_cols}, g)).in("W", randn({c.G, c.M, c.K}, g));
                  beta == 0.0f ? p.out("Y", {N, out_cols}, DType::f32, kGroupedTol)
                               : p.inout("Y", randn({N, out_cols}, g), kGroupedTol);
                  const Segments segs = c.segs;
                  p.call = [=](const ExecContext& ctx, Bound& t) {
                    grouped_gemm(ctx, t.at("X"), t.at("W"), trans_w, segs, t.at("Y"), beta);
                  };
                  p.reference = [=, fwd = fwd](const Bound& in, Refs& want) {
                    const std::vector<double> Y0 = beta == 0.0f ? std::vector<double>() : values(in.at("Y"));
                    want["Y"] = naive_rows(as_f32(in.at("X")), as_f32(in.at("W")), trans_w, segs, Y0, beta);
                    want["Y"].may_be_zero = beta == 0.0f && (fwd ? c.K : c.M) == 0;  // no products, overwritten
                  };
                  // bf16 X and W (CUDA only): Y in bf16 (the grouped cuBLAS call), and Y in f32
                  // (per-segment cuBLASLt).
                  Problem y_bf16 = bf16_variant(p, {}, kGroupedBf16Tol);
                  Problem y_f32 = bf16_variant(p, {"Y"}, kGroupedTol);
                  ps.push_back(std::move(p));
                  ps.push_back(std::move(y_bf16));
                  ps.push_back(std::move(y_f32));
                }
            return ps;
          }};
}

OpEntry grouped_gemm_wgrad_entry() {
  return {"grouped_gemm_wgrad", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const GroupedGemmCase& c : grouped_gemm_cases())
              for (const float beta : {0.0f, 1.0f, 0.5f}) {
                const int64_t N = total_rows(c.segs), G = c.G, M = c.M, K = c.K;
                Problem p(std::string(c.name) + ", beta " + std::to_string(beta));
                p.in("dY", randn({N, M}, g)).in("X", randn({N, K}, g));
                // beta = 0 overwrites every group, unused ones with zeros.
                beta == 0.0f ? p.out("dW", {G, M, K}, DType::f32, kGroupedTol)
                             : p.inout("dW", randn({G, M, K}, g), kGroupedTol);
                const Segments segs = c.segs;
                p.call = [=](const ExecContext& ctx, Bound& t) {
                  grouped_gemm_wgrad(ctx, t.at("dY"), t.at("X"), segs, t.at("dW"), beta);
                };
                p.reference = [=](const Bound& in, Refs& want) {
                  const std::vector<double> dW0 = beta == 0.0f ? std::vector<double>() : values(in.at("dW"));
                  want["dW"] = naive_wgrad(as_f32(in.at("dY")), as_f32(in.at("X")), segs, dW0, G, M, K, beta);
                  want["dW"].may_be_zero = N == 0 && beta == 0.0f;  // no rows, overwritten: exactly zero
                };
                // bf16 dY and X (CUDA only): dW in bf16, and dW in f32 (the fp32 master gradient).
                Problem dw_bf16 = bf16_variant(p, {}, kWgradBf16Tol);
                Problem dw_f32 = bf16_variant(p, {"dW"}, kGroupedTol);
                ps.push_back(std::move(p));
                ps.push_back(std::move(dw_bf16));
                ps.push_back(std::move(dw_f32));
              }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> gemm_ops() { return {gemm_entry(), grouped_gemm_entry(), grouped_gemm_wgrad_entry()}; }

}  // namespace origami::testing::backend_ops
