// Naive fp64 references that more than one test file reads: the op × backend
// harness (tests/backend_ops/) compares every op against these, and the
// kernels tests that check more (finite differences, thread-count
// determinism) build their objectives from them. Plain loops, written from
// the ops' definitions in kernels/*.h, never from their implementations.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/gemm.h"
#include "kernels/moe_ops.h"
#include "kernels/tensor.h"

namespace origami::testing {

// C = alpha · op(A) · op(B) + beta · C0, op(A) [M, K], op(B) [K, N].
inline std::vector<double> ref_gemm(const Tensor& A, Trans ta, const Tensor& B, Trans tb,
                                    const std::vector<double>& C0, int64_t M, int64_t N, int64_t K, double alpha,
                                    double beta) {
  std::vector<double> C(M * N);
  const int64_t lda = A.cols(), ldb = B.cols();
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = ta == Trans::no ? A.f32()[i * lda + k] : A.f32()[k * lda + i];
        const double b = tb == Trans::no ? B.f32()[k * ldb + j] : B.f32()[j * ldb + k];
        s += a * b;
      }
      C[i * N + j] = alpha * s + (beta == 0.0 ? 0.0 : beta * C0[i * N + j]);
    }
  return C;
}

// y = x · rsqrt(mean(x²) + eps) · w per row of x [T, D].
inline std::vector<double> ref_rmsnorm(const std::vector<double>& x, const std::vector<double>& w, int64_t T,
                                       int64_t D, double eps) {
  std::vector<double> y(T * D);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += x[t * D + i] * x[t * D + i];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) y[t * D + i] = x[t * D + i] * r * w[i];
  }
  return y;
}

// Cross-entropy of row t of x [T, V] against `target`: logsumexp − x[target];
// the row's log-sum-exp goes to *lse when asked for.
inline double ref_cross_entropy_row(const std::vector<double>& x, int64_t V, int64_t t, int64_t target,
                                    double* lse = nullptr) {
  double mx = -INFINITY, se = 0.0;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[t * V + i]);
  for (int64_t i = 0; i < V; ++i) se += std::exp(x[t * V + i] - mx);
  if (lse) *lse = mx + std::log(se);
  return mx + std::log(se) - x[t * V + target];
}

// ---------------------------------------------------------------- MoE top-k

struct NaiveTopk {
  std::vector<int> experts;  // [T, K]
  std::vector<double> weights, scores, lse;  // [T, K], [T, E], [T]
  // [T]: the smallest gap in the token's selection (between kept and dropped
  // groups, and between consecutive eligible experts through the k-th) that
  // an input perturbation must not close for the selection to hold.
  std::vector<double> margin;
};

// moe_topk_forward from its definition (kernels/moe_ops.h), with ties to the
// lower index by stable sorting; `fixed_experts` [T, K] holds the selection
// fixed (what the backward differentiates). Non-finite logits as the
// definition says: NaN propagates through the double arithmetic, NaN values
// rank last and are never eligible.
inline NaiveTopk naive_topk(const std::vector<double>& z, int64_t E, const MoeTopkParams& p,
                            const std::vector<double>& bias, const std::vector<int>* fixed_experts = nullptr) {
  const int64_t T = int64_t(z.size()) / E, K = p.top_k;
  constexpr double kMasked = -1e300;  // a group not kept
  const auto eligible = [](double v) { return !std::isnan(v) && v > -1e299; };
  NaiveTopk r;
  for (int64_t t = 0; t < T; ++t) {
    const double* zt = &z[t * E];
    double mx = -INFINITY;  // NaN skipped here reaches every score through the sum
    for (int64_t e = 0; e < E; ++e) mx = zt[e] > mx ? zt[e] : mx;
    double se = 0;
    for (int64_t e = 0; e < E; ++e) se += std::exp(zt[e] - mx);
    r.lse.push_back(mx + std::log(se));
    std::vector<double> v(E);
    for (int64_t e = 0; e < E; ++e) {
      const double s = p.score_function == MoeScore::softmax ? std::exp(zt[e] - mx) / se : 1 / (1 + std::exp(-zt[e]));
      r.scores.push_back(s);
      v[e] = s + (bias.empty() ? 0.0 : bias[e]);
    }
    // Descending, NaN last (a strict weak order), ties in index order.
    auto rank = [](const std::vector<double>& x) {
      std::vector<int> idx(x.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(),
                       [&](int a, int b) { return x[a] > x[b] || (!std::isnan(x[a]) && std::isnan(x[b])); });
      return idx;
    };
    double margin = 1e9;
    if (p.num_groups > 1) {
      const int64_t G = p.num_groups, Eg = E / G, m = K / p.group_topk;
      std::vector<double> gs(G);
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> in;
        for (int64_t e = g * Eg; e < (g + 1) * Eg; ++e)
          if (!std::isnan(v[e])) in.push_back(v[e]);
        std::sort(in.rbegin(), in.rend());
        gs[g] = int64_t(in.size()) < m ? -INFINITY : std::accumulate(in.begin(), in.begin() + m, 0.0);
      }
      const std::vector<int> gr = rank(gs);
      if (p.group_topk < G && gs[gr[p.group_topk]] > -INFINITY)
        margin = gs[gr[p.group_topk - 1]] - gs[gr[p.group_topk]];
      for (int64_t i = 0; i < G; ++i)
        if (i >= p.group_topk || !(gs[gr[i]] > -INFINITY))
          std::fill(v.begin() + gr[i] * Eg, v.begin() + (gr[i] + 1) * Eg, kMasked);
    }
    std::vector<int> er = rank(v);
    int64_t found = 0;
    while (found < K && eligible(v[er[found]])) ++found;
    for (int64_t i = 0; i < K && i + 1 < E; ++i)
      if (eligible(v[er[i + 1]])) margin = std::min(margin, v[er[i]] - v[er[i + 1]]);
    r.margin.push_back(margin);
    if (found < K && !fixed_experts) {  // the eligible ones, then the lowest experts not taken; NaN weights
      std::vector<int> pick(er.begin(), er.begin() + found);
      for (int e = 0; int64_t(pick.size()) < K; ++e)
        if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
      r.experts.insert(r.experts.end(), pick.begin(), pick.end());
      r.weights.insert(r.weights.end(), K, std::nan(""));
      continue;
    }
    if (fixed_experts) std::copy(fixed_experts->begin() + t * K, fixed_experts->begin() + (t + 1) * K, er.begin());
    double sum = 0;
    for (int64_t j = 0; j < K; ++j) sum += r.scores[t * E + er[j]];
    for (int64_t j = 0; j < K; ++j) {
      r.experts.push_back(er[j]);
      const double s = r.scores[t * E + er[j]];
      r.weights.push_back((p.normalize_topk ? s / (sum + 1e-20) : s) * p.scaling_f32());
    }
  }
  return r;
}

}  // namespace origami::testing
