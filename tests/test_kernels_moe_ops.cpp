// MoE routing kernels against naive references (ARCHITECTURE.md §9): top-k
// forward on constructed logits (exact ties, group ties, bias, lse), the
// per-token backward against fp64 central differences of a naive forward,
// routing statistics over segments that straddle the 256-token chunks and
// the totals and aux coefficients read from them (exact references on small
// integers), histograms, rows per expert, the dropless mask, the expert-bias
// update (exact signs); sentinel regions around outputs to catch out-of-bounds writes;
// bitwise-equal results at 1 and 3 threads. moe/ tests cover capacity and the
// permutation layout through the module API.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/moe_ops.h"
#include "naive_ops.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();
using testing::naive_topk;
using testing::NaiveTopk;

Tensor make(Shape s, DType dt = DType::f32) { return Tensor::empty(std::move(s), dt, MemCategory::activation); }

Tensor randn(Shape s, std::mt19937& g, float sd = 1.0f) {
  Tensor t = make(std::move(s));
  std::normal_distribution<float> nd(0.0f, sd);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

// An f32 output view with 16 sentinel floats on each side of it.
struct Guarded {
  Tensor storage, view;
  explicit Guarded(Shape s) {
    const int64_t n = shape_numel(s);
    storage = make({n + 32});
    std::fill(storage.f32(), storage.f32() + n + 32, kSentinel);
    view = storage.flat_view(16, n, std::move(s));
  }
  void expect_intact(const char* what) const {
    const int64_t n = view.numel();
    for (int i = 0; i < 16; ++i) {
      EXPECT_EQ(storage.f32()[i], kSentinel) << what << ": write before the output";
      EXPECT_EQ(storage.f32()[16 + n + i], kSentinel) << what << ": write past the output";
    }
  }
};

// ------------------------------------------------------------ naive top-k (fp64)

struct NaiveTopk {
  std::vector<int> experts;
  std::vector<double> weights, scores, lse;
};

NaiveTopk naive_topk(const std::vector<double>& z, int64_t E, const MoeTopkParams& p, const std::vector<double>& bias,
                     const std::vector<int>* fixed_experts = nullptr) {
  const int64_t T = int64_t(z.size()) / E, K = p.top_k;
  NaiveTopk r;
  for (int64_t t = 0; t < T; ++t) {
    const double* zt = &z[t * E];
    const double mx = *std::max_element(zt, zt + E);
    double se = 0;
    for (int64_t e = 0; e < E; ++e) se += std::exp(zt[e] - mx);
    r.lse.push_back(mx + std::log(se));
    std::vector<double> v(E);
    for (int64_t e = 0; e < E; ++e) {
      const double s = p.score_function == MoeScore::softmax ? std::exp(zt[e] - mx) / se : 1 / (1 + std::exp(-zt[e]));
      r.scores.push_back(s);
      v[e] = s + (bias.empty() ? 0.0 : bias[e]);
    }
    auto rank = [](const std::vector<double>& x) {
      std::vector<int> idx(x.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return x[a] > x[b]; });
      return idx;
    };
    if (p.num_groups > 1) {
      const int64_t G = p.num_groups, Eg = E / G, m = K / p.group_topk;
      std::vector<double> gs(G);
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> in(v.begin() + g * Eg, v.begin() + (g + 1) * Eg);
        std::sort(in.rbegin(), in.rend());
        gs[g] = std::accumulate(in.begin(), in.begin() + m, 0.0);
      }
      const std::vector<int> gr = rank(gs);
      for (int64_t i = p.group_topk; i < G; ++i) std::fill(v.begin() + gr[i] * Eg, v.begin() + (gr[i] + 1) * Eg, -1e300);
    }
    std::vector<int> er = rank(v);
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

std::vector<double> to_double(const Tensor& t) { return std::vector<double>(t.f32(), t.f32() + t.numel()); }

struct TopkOut {
  Tensor scores, experts, weights, lse;
};
TopkOut run_topk(const Tensor& logits, const Tensor& bias, const MoeTopkParams& p,
                 const ExecContext& ctx = testing::test_context()) {
  const int64_t T = logits.rows(), E = logits.cols();
  TopkOut o{make({T, E}), make({T, p.top_k}, DType::i32), make({T, p.top_k}), make({T})};
  moe_topk_forward(ctx, logits, bias, p, o.scores, o.experts, o.weights, o.lse);
  return o;
}

TEST(KernelsMoe, TopkTiesOnConstructedLogits) {
  auto logits_of = [](std::vector<float> v, int64_t E) {
    Tensor t = make({int64_t(v.size()) / E, E});
    std::copy(v.begin(), v.end(), t.f32());
    return t;
  };
  // Expert ties: lower index first, output in descending order.
  MoeTopkParams p{MoeScore::softmax, 3, 1, 1, false, 1.0f};
  TopkOut o = run_topk(logits_of({1, 2, 2, 0, 2, 1}, 6), Tensor(), p);
  EXPECT_EQ(std::vector<int>(o.experts.i32(), o.experts.i32() + 3), (std::vector<int>{1, 2, 4}));
  // Group ties: groups {0,1}, {2,3}, {4,5}; groups 1 and 2 tie on the sum of
  // their top-2 and beat group 0; group 1 (lower) is kept.
  p = MoeTopkParams{MoeScore::sigmoid, 2, 3, 1, false, 1.0f};
  o = run_topk(logits_of({0, 0, 1, 3, 3, 1}, 6), Tensor(), p);
  EXPECT_EQ(std::vector<int>(o.experts.i32(), o.experts.i32() + 2), (std::vector<int>{3, 2}));
  // Bias moves selection; weights stay the unbiased scores.
  Tensor bias = make({6});
  std::fill(bias.f32(), bias.f32() + 6, 0.0f);
  bias.f32()[0] = 1.0f;
  p = MoeTopkParams{MoeScore::sigmoid, 1, 1, 1, false, 1.0f};
  o = run_topk(logits_of({0, 0, 1, 3, 3, 1}, 6), bias, p);
  EXPECT_EQ(o.experts.i32()[0], 0);
  EXPECT_FLOAT_EQ(o.weights.f32()[0], 0.5f);
}

// Objective the backward differentiates, in fp64 with the selection fixed.
double naive_objective(const std::vector<double>& z, int64_t E, const MoeTopkParams& p, const std::vector<int>& experts,
                       const std::vector<double>& R, const std::vector<double>& A, int64_t seg_len, double zc) {
  const NaiveTopk n = naive_topk(z, E, p, {}, &experts);
  const int64_t T = int64_t(z.size()) / E, K = p.top_k;
  double f = 0;
  for (int64_t i = 0; i < T * K; ++i) f += R[i] * n.weights[i];
  for (int64_t t = 0; t < T; ++t) {
    double norm = 0;
    for (int64_t e = 0; e < E; ++e) norm += n.scores[t * E + e];
    for (int64_t e = 0; e < E; ++e) {
      const double s = n.scores[t * E + e];
      f += A[(t / seg_len) * E + e] * (p.score_function == MoeScore::sigmoid ? s / (norm + 1e-20) : s);
    }
    f += zc * n.lse[t] * n.lse[t];
  }
  return f;
}

TEST(KernelsMoe, TopkBackwardMatchesFp64CentralDifferences) {
  std::mt19937 rng(73);
  const int64_t T = 12, E = 8, K = 3, seg = 4;
  for (MoeScore sc : {MoeScore::softmax, MoeScore::sigmoid}) {
    for (bool norm : {false, true}) {
      MoeTopkParams p{sc, K, 2, 1, norm, 1.3f};
      Tensor logits = randn({T, E}, rng, 1.5f), R = randn({T, K}, rng), A = randn({T / seg, E}, rng, 0.3f);
      const TopkOut o = run_topk(logits, Tensor(), p);
      const float zc = 0.07f;
      Tensor dz = make({T, E});
      moe_topk_backward(ctx, logits, o.scores, o.experts, R, A, seg, zc, p, dz);
      const std::vector<int> experts(o.experts.i32(), o.experts.i32() + T * K);
      std::vector<double> z = to_double(logits);
      const std::vector<double> Rd = to_double(R), Ad = to_double(A);
      // fp64 central differences, h = 1e-6: truncation ~1e-12, rounding ~1e-10.
      for (int64_t i = 0; i < T * E; ++i) {
        const double z0 = z[i];
        z[i] = z0 + 1e-6;
        const double fp = naive_objective(z, E, p, experts, Rd, Ad, seg, zc);
        z[i] = z0 - 1e-6;
        const double fm = naive_objective(z, E, p, experts, Rd, Ad, seg, zc);
        z[i] = z0;
        const double want = (fp - fm) / 2e-6;
        // The kernel runs in fp32 (exp_fast, float sums): 1e-5 of the row scale.
        EXPECT_NEAR(dz.f32()[i], want, 1e-5 * (1 + std::abs(want))) << "score " << int(sc) << " norm " << norm << " i " << i;
      }
    }
  }
}

const double* f64_data(const Tensor& t) { return t.data<double>(); }

TEST(KernelsMoe, RoutingStatsPerSegmentAcrossChunkBoundaries) {
  std::mt19937 rng(79);
  const int64_t seg = 300, S = 3, T = seg * S, E = 6, SE = S * E;  // segments straddle the 256-token chunks
  for (MoeScore sc : {MoeScore::softmax, MoeScore::sigmoid}) {
    MoeTopkParams p{sc, 2, 1, 1, false, 1.0f};
    const TopkOut o = run_topk(randn({T, E}, rng), Tensor(), p);
    Tensor stats = make({2 * SE + 2}, DType::f64);
    moe_routing_stats(ctx, o.scores, o.experts, o.lse, sc, S, stats);
    const double* got = f64_data(stats);
    std::vector<double> wc(SE, 0.0), ws(SE, 0.0);
    double lse_sq = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < 2; ++j) wc[(t / seg) * E + o.experts.i32()[t * 2 + j]] += 1;
      double norm = 0;
      for (int64_t e = 0; e < E; ++e) norm += o.scores.f32()[t * E + e];
      for (int64_t e = 0; e < E; ++e)
        ws[(t / seg) * E + e] += o.scores.f32()[t * E + e] / (sc == MoeScore::sigmoid ? norm : 1.0);
      lse_sq += double(o.lse.f32()[t]) * o.lse.f32()[t];
    }
    for (int64_t i = 0; i < SE; ++i) {
      EXPECT_EQ(got[i], wc[i]) << i;
      EXPECT_NEAR(got[SE + i], ws[i], 1e-5 * ws[i]);  // fp32 per-token normalization
      EXPECT_GT(got[SE + i], 0.0);
    }
    EXPECT_EQ(std::accumulate(got, got + SE, 0.0), double(T * 2));
    EXPECT_EQ(got[2 * SE], double(T)) << "token count";
    EXPECT_NEAR(got[2 * SE + 1], lse_sq, 1e-12 * lse_sq) << "fp64 sum of fp32 squares, another order";
    EXPECT_GT(got[2 * SE + 1], 0.0);
  }
}

// S = 0 keeps only [T | Σ lse²]; no lse gives 0; T = 0 gives zeros.
TEST(KernelsMoe, RoutingStatsWithoutAuxPartOrTokens) {
  std::mt19937 rng(80);
  const int64_t T = 40, E = 5;
  const TopkOut o = run_topk(randn({T, E}, rng), Tensor(), MoeTopkParams{MoeScore::softmax, 2, 1, 1, false, 1.0f});
  Tensor stats = make({2}, DType::f64);
  moe_routing_stats(ctx, o.scores, o.experts, o.lse, MoeScore::softmax, 0, stats);
  EXPECT_EQ(f64_data(stats)[0], double(T));
  EXPECT_GT(f64_data(stats)[1], 0.0);
  moe_routing_stats(ctx, o.scores, o.experts, Tensor(), MoeScore::softmax, 0, stats);
  EXPECT_EQ(f64_data(stats)[1], 0.0);
  const TopkOut none = run_topk(make({0, E}), Tensor(), MoeTopkParams{MoeScore::softmax, 2, 1, 1, false, 1.0f});
  Tensor empty = make({2 * E + 2}, DType::f64);
  std::fill(empty.data<double>(), empty.data<double>() + 2 * E + 2, 7.0);
  moe_routing_stats(ctx, none.scores, none.experts, none.lse, MoeScore::softmax, 1, empty);
  for (int64_t i = 0; i < 2 * E + 2; ++i) EXPECT_EQ(f64_data(empty)[i], 0.0) << i;
}

// Totals and coefficients from a buffer of small integers and halves, so
// the fp64 reference in the same summation order is exact.
TEST(KernelsMoe, RoutingTotalsAndAuxCoefficientsFromTheBuffer) {
  std::mt19937 rng(81);
  const int64_t S = 3, E = 7, K = 2, SE = S * E;
  std::uniform_int_distribution<int> small(1, 9);
  Tensor stats = make({2 * SE + 2}, DType::f64);
  double* b = stats.data<double>();
  for (int64_t i = 0; i < 2 * SE; ++i) b[i] = small(rng) * (i < SE ? 1.0 : 0.5);
  b[2 * SE] = 96.0;   // tokens: T_b = 32
  b[2 * SE + 1] = 12.25;
  const MoeRoutingTotals r = moe_routing_totals(ctx, stats, S, E, K);
  EXPECT_EQ(r.tokens, 96.0);
  EXPECT_EQ(r.lse_sq_sum, 12.25);
  double want = 0;
  for (int64_t i = 0; i < SE; ++i) want += b[i] / (32.0 * K) * (b[SE + i] / 32.0);
  EXPECT_EQ(r.balance, want);
  EXPECT_GT(r.balance, 0.0);
  Tensor short_stats = make({2}, DType::f64);
  short_stats.data<double>()[0] = 5, short_stats.data<double>()[1] = 3;
  const MoeRoutingTotals z = moe_routing_totals(ctx, short_stats, 0, E, K);
  EXPECT_EQ(z.tokens, 5.0);
  EXPECT_EQ(z.balance, 0.0);

  Guarded aux({S, E});
  const double scale = 0.1;  // fp32(0.1 · count), the cast the kernel documents
  moe_aux_coefficients(ctx, stats, scale, aux.view);
  aux.expect_intact("aux coefficients");
  for (int64_t i = 0; i < SE; ++i) EXPECT_EQ(aux.view.f32()[i], static_cast<float>(scale * b[i])) << i;
}

TEST(KernelsMoe, HistogramCountsKeptSlots) {
  Tensor ex = make({4, 2}, DType::i32), kept = make({4, 2}, DType::u8), cnt = make({3}, DType::i64);
  const int32_t e[] = {0, 2, 2, 1, 2, 0, 1, 2};
  const uint8_t k[] = {1, 1, 0, 1, 1, 1, 0, 1};
  std::copy(e, e + 8, ex.i32());
  std::copy(k, k + 8, kept.data<uint8_t>());
  moe_expert_histogram(ctx, ex, Tensor(), 3, cnt);
  EXPECT_EQ(std::vector<int64_t>(cnt.data<int64_t>(), cnt.data<int64_t>() + 3), (std::vector<int64_t>{2, 2, 4}));
  moe_expert_histogram(ctx, ex, kept, 3, cnt);
  EXPECT_EQ(std::vector<int64_t>(cnt.data<int64_t>(), cnt.data<int64_t>() + 3), (std::vector<int64_t>{2, 1, 3}));
}

TEST(KernelsMoe, ExpertRowsAreKeptCountsOrThePadding) {
  Tensor kept = make({4}, DType::i64), rows = make({4}, DType::i64);
  const int64_t k[] = {3, 0, 5, 1};
  std::copy(k, k + 4, kept.data<int64_t>());
  moe_expert_rows(ctx, kept, -1, rows);
  EXPECT_EQ(std::vector<int64_t>(rows.data<int64_t>(), rows.data<int64_t>() + 4), (std::vector<int64_t>{3, 0, 5, 1}));
  moe_expert_rows(ctx, kept, 6, rows);
  EXPECT_EQ(std::vector<int64_t>(rows.data<int64_t>(), rows.data<int64_t>() + 4), (std::vector<int64_t>{6, 6, 6, 6}));
}

TEST(KernelsMoe, CapacityMaskWithoutCapacityKeepsEverySlot) {
  std::mt19937 rng(82);
  const int64_t T = 33, K = 3, E = 4;
  Tensor ex = make({T, K}, DType::i32), w = randn({T, K}, rng), kept = make({T, K}, DType::u8);
  for (int64_t i = 0; i < T * K; ++i) ex.i32()[i] = static_cast<int32_t>(rng() % E);
  std::fill(kept.data<uint8_t>(), kept.data<uint8_t>() + T * K, 0);
  for (MoeDrop policy : {MoeDrop::probs, MoeDrop::position}) {
    moe_capacity_mask(ctx, ex, w, E, -1, policy, kept);
    for (int64_t i = 0; i < T * K; ++i) ASSERT_EQ(kept.data<uint8_t>()[i], 1) << i;
  }
}

// Exact signs in integers: loads around the mean, one equal to it.
TEST(KernelsMoe, ExpertBiasUpdateFollowsTheSignOfMeanMinusLoad) {
  std::mt19937 rng(84);
  const int64_t E = 9;
  std::vector<int64_t> load(E);
  std::uniform_int_distribution<int64_t> d(0, 50);
  for (auto& l : load) l = d(rng);
  load[4] = 0;
  const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0}) - load[4];
  // Make expert 4 exactly the mean: E·l = Σ load, solvable when E − 1 divides the rest.
  load[0] += (E - 1) - total % (E - 1);
  load[4] = (total + (E - 1) - total % (E - 1)) / (E - 1);
  Tensor bias = randn({E}, rng), before = make({E});
  before.copy_from(bias);
  const float rate = 0.125f;
  moe_expert_bias_update(ctx, bias, load, rate);
  const int64_t sum = std::accumulate(load.begin(), load.end(), int64_t{0});
  int moved = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t diff = sum - E * load[e];
    const float sign = static_cast<float>((diff > 0) - (diff < 0));
    EXPECT_EQ(bias.f32()[e], before.f32()[e] + rate * sign) << e;
    moved += sign != 0.0f;
  }
  EXPECT_EQ(sum, E * load[4]) << "expert 4 sits at the mean";
  EXPECT_EQ(bias.f32()[4], before.f32()[4]);
  EXPECT_GT(moved, 0);
}

// Row maps for a small routing with one drop and padding to 3 rows/expert.
struct Maps {
  Tensor row_of, token, slot;
};
Maps small_maps(const Tensor& ex, const Tensor& kept, int64_t E, int64_t rows_each) {
  Tensor rows = make({E}, DType::i64);
  std::fill(rows.data<int64_t>(), rows.data<int64_t>() + E, rows_each);
  Maps m{make(ex.shape(), DType::i32), make({E * rows_each}, DType::i32), make({E * rows_each}, DType::i32)};
  moe_permutation_maps(ctx, ex, kept, rows, m.row_of, m.token, m.slot);
  return m;
}

// Every op gives bitwise-identical results at 1 and 3 threads.
TEST(KernelsMoe, ResultsDoNotDependOnThreadCount) {
  std::mt19937 rng(89);
  const int64_t T = 700, E = 16, K = 4, D = 33;
  MoeTopkParams p{MoeScore::sigmoid, K, 4, 2, true, 2.0f};
  Tensor logits = randn({T, E}, rng, 2.0f), R = randn({T, K}, rng), A = randn({1, E}, rng), x = randn({T, D}, rng);
  auto run = [&](int threads) {
    const ExecContext local = ExecContext::cpu(threads);
    const ExecContext& ctx = local;
    std::vector<float> out;
    const TopkOut o = run_topk(logits, Tensor(), p, ctx);
    Tensor stats = make({2 * E + 2}, DType::f64);
    moe_routing_stats(ctx, o.scores, o.experts, o.lse, p.score_function, 1, stats);
    const double* c = stats.data<double>();
    const double* s = c + E;
    Tensor dz = make({T, E});
    moe_topk_backward(ctx, logits, o.scores, o.experts, R, A, T, 0.01f, p, dz);
    const Maps m = small_maps(o.experts, Tensor(), E, T);
    Tensor x_ND = make({E * T, D}), y = make({T, D}), dy = make({E * T, D}), dw = make({T, K});
    moe_permute_rows(ctx, x, m.token, x_ND);
    moe_unpermute_rows(ctx, x_ND, m.row_of, o.weights, y);
    moe_unpermute_rows_backward(ctx, x, x_ND, m.row_of, m.token, o.weights, dy, dw);
    Tensor dx = make({T, D});
    std::fill(dx.f32(), dx.f32() + T * D, 0.0f);
    moe_permute_rows_backward(ctx, dy, m.row_of, dx);
    for (const Tensor& t : {o.scores, o.weights, dz, y, dw, dx}) out.insert(out.end(), t.f32(), t.f32() + t.numel());
    for (int64_t e = 0; e < E; ++e)
      out.push_back(float(c[e])), out.push_back(float(s[e])), out.push_back(float(s[e] - float(s[e])));
    return out;
  };
  const std::vector<float> one = run(1), three = run(3);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(one[i], three[i]) << "element " << i;
}

}  // namespace
}  // namespace origami
