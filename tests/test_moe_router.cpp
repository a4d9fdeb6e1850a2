// Router tests (ARCHITECTURE.md §4, §9): selection and weights against a naive
// double-precision reference (ties, bias, group-limited routing, normalize and
// scaling, both score functions); aux_loss / seq_aux_loss / global_aux_loss and
// z-loss values against naive references; finite-difference gradients through
// x and the gate weights for every score function × balancing loss; a
// two-rank emulation of the statistics reducer; update_expert_bias.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "grad_check.h"
#include "naive_ops.h"
#include "moe/router.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami::moe {
namespace {

const ExecContext& ctx = testing::test_context();

using testing::random_tensor;

Tensor f32(Shape s) { return Tensor::empty(std::move(s), DType::f32, MemCategory::activation); }
Tensor zeros(Shape s) { return Tensor::zeros(std::move(s), DType::f32, MemCategory::grad); }

// ------------------------------------------------------------ naive reference

// The fp64 reference of selection and weights is the kernels' own
// (tests/naive_ops.h: naive_topk, written from kernels/moe_ops.h); a
// RouterOptions is its MoeTopkParams plus the balancing settings.
using NaiveRoute = testing::NaiveTopk;

std::vector<double> logits_of(const Tensor& x, const Tensor& gate) {
  const int64_t T = x.rows(), D = x.cols(), E = gate.rows();
  std::vector<double> z(T * E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t d = 0; d < D; ++d) z[t * E + e] += double(x.f32()[t * D + d]) * gate.f32()[e * D + d];
  return z;
}

NaiveRoute naive_route(const RouterOptions& o, const std::vector<double>& z, const Tensor& bias) {
  std::vector<double> b;
  if (bias.defined()) b.assign(bias.f32(), bias.f32() + bias.numel());
  return testing::naive_topk(z, o.num_experts, o, b);
}

// aux (with coefficient) over S segments of T / S tokens, from the naive route.
double naive_aux(const RouterOptions& o, const NaiveRoute& r, int64_t S) {
  const int64_t E = o.num_experts, K = o.top_k, T = int64_t(r.lse.size()), Ts = T / S;
  double total = 0;
  for (int64_t b = 0; b < S; ++b) {
    std::vector<double> f(E, 0.0), P(E, 0.0);
    for (int64_t t = b * Ts; t < (b + 1) * Ts; ++t) {
      for (int64_t j = 0; j < K; ++j) f[r.experts[t * K + j]] += 1.0 / (Ts * K);
      double norm = 0;
      for (int64_t e = 0; e < E; ++e) norm += r.scores[t * E + e];
      for (int64_t e = 0; e < E; ++e)
        P[e] += (o.score_function == ScoreFunction::sigmoid ? r.scores[t * E + e] / norm : r.scores[t * E + e]) / Ts;
    }
    for (int64_t e = 0; e < E; ++e) total += f[e] * P[e];
  }
  return o.aux_loss_coeff * E * total / S;
}

double naive_z(const RouterOptions& o, const NaiveRoute& r) {
  double s = 0;
  for (double l : r.lse) s += l * l;
  return o.z_loss_coeff * s / double(r.lse.size());
}

RouterOptions options(int64_t E, int64_t K, ScoreFunction sf) {
  RouterOptions o;
  o.num_experts = E;
  o.top_k = K;
  o.score_function = sf;
  return o;
}

// Fails the test unless expert_TK equals the naive selection and weight_TK
// matches within rel_tol.
void expect_route(const Routing& got, const NaiveRoute& want, double rel_tol, const char* what) {
  const int64_t n = got.expert_TK.numel();
  ASSERT_EQ(n, int64_t(want.experts.size()));
  int64_t nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(got.expert_TK.i32()[i], want.experts[i]) << what << " token " << i / got.expert_TK.cols() << " slot " << i % got.expert_TK.cols();
    EXPECT_NEAR(got.weight_TK.f32()[i], want.weights[i], rel_tol * std::abs(want.weights[i]) + 1e-12) << what << " slot " << i;
    nonzero += got.weight_TK.f32()[i] != 0.0f;
  }
  EXPECT_EQ(nonzero, n) << what << ": every selected weight should be non-zero";
}

Routing route(const RouterOptions& o, const Tensor& x, const Tensor& gate, const Tensor& bias, int64_t seq_len,
              RouterLosses* losses = nullptr, const StatsReducer& reduce = nullptr) {
  RouterSaved saved;
  Routing r = router_forward(ctx, o, x, gate, bias, seq_len, saved, reduce);
  const RouterLosses l = router_losses(o, saved);
  if (losses) *losses = l;
  return r;
}

// ------------------------------------------------------------ selection

// Weights: fp32 logits (oneDNN) and exp_fast against fp64; ~1e-6 relative.
constexpr double kWeightTol = 2e-5;

// The CUDA router's shared-memory bound (kernels/moe_ops.h), which config
// validation applies to CUDA runs: 2E + 2G + k words of 48 KiB, exactly at
// the limit and one word over, with and without groups.
TEST(MoeRouter, CudaRouterBoundIsExactAtItsLimit) {
  EXPECT_EQ(kMoeCudaRouterWords, 12288);
  EXPECT_TRUE(moe_router_fits_cuda(6142, 1, 2));   // 12284 + 2 + 2
  EXPECT_FALSE(moe_router_fits_cuda(6142, 1, 3));  // one word over
  EXPECT_TRUE(moe_router_fits_cuda(6016, 64, 128));   // 12032 + 128 + 128
  EXPECT_FALSE(moe_router_fits_cuda(6016, 65, 128));  // + 2: over
  EXPECT_TRUE(moe_router_fits_cuda(256, 8, 8));       // DeepSeek-V3's router, far inside
}

TEST(MoeRouter, TopkMatchesNaiveAcrossOptions) {
  std::mt19937 rng(testing::test_seed(11));
  const int64_t T = 64, D = 24;
  struct Case { int64_t E, K, G, gk; ScoreFunction sf; bool norm; float scale; bool bias; };
  const Case cases[] = {{8, 2, 1, 1, ScoreFunction::softmax, false, 1.0f, false},
                        {8, 2, 1, 1, ScoreFunction::softmax, true, 2.5f, true},
                        {16, 4, 4, 2, ScoreFunction::sigmoid, true, 2.5f, true},
                        {16, 3, 1, 1, ScoreFunction::sigmoid, false, 0.5f, false},
                        {64, 8, 8, 4, ScoreFunction::sigmoid, true, 1.0f, true},
                        {12, 1, 3, 1, ScoreFunction::softmax, false, 1.0f, true}};
  for (const Case& c : cases) {
    RouterOptions o = options(c.E, c.K, c.sf);
    o.num_groups = c.G, o.group_topk = c.gk, o.normalize_topk = c.norm, o.topk_scaling = c.scale;
    Tensor x = random_tensor({T, D}, rng), gate = random_tensor({c.E, D}, rng, 0.5f);
    Tensor bias = c.bias ? random_tensor({c.E}, rng, 0.1f) : Tensor();
    Routing r = route(o, x, gate, bias, T);
    SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.K << " groups=" << c.G << "/" << c.gk);
    expect_route(r, naive_route(o, logits_of(x, gate), bias), kWeightTol, "random");
  }
}

// gate = identity with D = E makes the logits equal x exactly, so small
// integer rows give exact ties.
Tensor identity_gate(int64_t E) {
  Tensor g = zeros({E, E});
  for (int64_t e = 0; e < E; ++e) g.f32()[e * E + e] = 1.0f;
  return g;
}

Tensor rows_of(const std::vector<std::vector<float>>& rows) {
  Tensor t = f32({int64_t(rows.size()), int64_t(rows[0].size())});
  for (size_t i = 0; i < rows.size(); ++i) std::copy(rows[i].begin(), rows[i].end(), t.f32() + i * rows[i].size());
  return t;
}

TEST(MoeRouter, ExactTiesGoToTheLowerExpertIndex) {
  const std::vector<std::vector<float>> z = {{0, 3, 1, 3, 2, 0}, {2, 5, 5, 1, 5, 0}, {4, 4, 4, 4, 4, 4}};
  const std::vector<std::vector<int>> want_k1 = {{1}, {1}, {0}}, want_k2 = {{1, 3}, {1, 2}, {0, 1}};
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    for (int64_t K : {1, 2}) {
      Routing r = route(options(6, K, sf), rows_of(z), identity_gate(6), Tensor(), 3);
      const auto& want = K == 1 ? want_k1 : want_k2;
      for (int t = 0; t < 3; ++t)
        for (int j = 0; j < K; ++j) EXPECT_EQ(r.expert_TK.i32()[t * K + j], want[t][j]) << "token " << t << " k=" << K;
      // Tied experts get bitwise-equal weights.
      if (K == 2) {
        EXPECT_EQ(r.weight_TK.f32()[2], r.weight_TK.f32()[3]);
      }
    }
  }
}

TEST(MoeRouter, GroupTiesGoToTheLowerGroup) {
  // Groups {0,1} and {2,3} hold the same logits {3,1}: equal group scores.
  // Group 0 wins, so experts 0 and 1; without groups it would be 0 and 3.
  RouterOptions o = options(4, 2, ScoreFunction::sigmoid);
  Tensor x = rows_of({{3, 1, 1, 3}});
  Routing flat = route(o, x, identity_gate(4), Tensor(), 1);
  EXPECT_EQ(flat.expert_TK.i32()[1], 3);
  o.num_groups = 2, o.group_topk = 1;
  Routing grouped = route(o, x, identity_gate(4), Tensor(), 1);
  EXPECT_EQ(grouped.expert_TK.i32()[0], 0);
  EXPECT_EQ(grouped.expert_TK.i32()[1], 1);
}

TEST(MoeRouter, GroupLimitedSelectionMatchesNaiveAndDiffersFromFlat) {
  std::mt19937 rng(testing::test_seed(13));
  const int64_t T = 128, D = 16, E = 16;
  RouterOptions o = options(E, 4, ScoreFunction::sigmoid);
  o.num_groups = 4, o.group_topk = 2;
  Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.5f);
  const std::vector<double> z = logits_of(x, gate);
  Routing r = route(o, x, gate, Tensor(), T);
  expect_route(r, naive_route(o, z, Tensor()), kWeightTol, "grouped");
  // Non-vacuous: some token's flat top-4 spans more than the 2 kept groups.
  RouterOptions flat = o;
  flat.num_groups = 1;
  const NaiveRoute nf = naive_route(flat, z, Tensor());
  int64_t differ = 0;
  for (int64_t i = 0; i < T * 4; ++i) differ += nf.experts[i] != r.expert_TK.i32()[i];
  EXPECT_GT(differ, 0);
  // Every token's experts come from at most group_topk groups.
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> groups;
    for (int j = 0; j < 4; ++j) groups.push_back(r.expert_TK.i32()[t * 4 + j] / 4);
    std::sort(groups.begin(), groups.end());
    EXPECT_LE(std::unique(groups.begin(), groups.end()) - groups.begin(), 2) << "token " << t;
  }
}

TEST(MoeRouter, BiasChangesSelectionButNotWeights) {
  std::mt19937 rng(testing::test_seed(17));
  const int64_t T = 32, D = 8, E = 8;
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    RouterOptions o = options(E, 2, sf);
    Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.5f);
    Tensor bias = zeros({E});
    bias.f32()[5] = 2.0f;  // beats any score difference: expert 5 is always picked
    Routing r0 = route(o, x, gate, Tensor(), T), r1 = route(o, x, gate, bias, T);
    const NaiveRoute n = naive_route(o, logits_of(x, gate), bias);
    expect_route(r1, n, kWeightTol, "biased");
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(r1.expert_TK.i32()[t * 2], 5);
      // Weight is the unbiased score of expert 5.
      EXPECT_NEAR(r1.weight_TK.f32()[t * 2], n.scores[t * E + 5], 1e-6);
      EXPECT_LT(r1.weight_TK.f32()[t * 2], 1.0f);
    }
    int64_t changed = 0;
    for (int64_t i = 0; i < T * 2; ++i) changed += r0.expert_TK.i32()[i] != r1.expert_TK.i32()[i];
    EXPECT_GT(changed, 0);
  }
}

TEST(MoeRouter, NormalizeAndScaling) {
  std::mt19937 rng(testing::test_seed(19));
  const int64_t T = 20, D = 8, E = 8, K = 3;
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    RouterOptions o = options(E, K, sf);
    o.normalize_topk = true, o.topk_scaling = 2.5f;
    Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.5f);
    Routing r = route(o, x, gate, Tensor(), T);
    for (int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (int64_t j = 0; j < K; ++j) s += r.weight_TK.f32()[t * K + j];
      EXPECT_NEAR(s, 2.5, 1e-5) << "token " << t;  // fp32 sum of 3 terms
    }
    o.normalize_topk = false;
    Routing u = route(o, x, gate, Tensor(), T);
    expect_route(u, naive_route(o, logits_of(x, gate), Tensor()), kWeightTol, "scaled");
  }
}

// ------------------------------------------------------------ loss values

TEST(MoeRouter, AuxAndZLossValuesMatchNaive) {
  std::mt19937 rng(testing::test_seed(23));
  const int64_t B = 3, S = 10, T = B * S, D = 12, E = 8;
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    for (LoadBalancing lb : {LoadBalancing::none, LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss,
                             LoadBalancing::global_aux_loss}) {
      RouterOptions o = options(E, 2, sf);
      o.load_balancing = lb, o.aux_loss_coeff = 0.01f, o.z_loss_coeff = 0.001f;
      Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.5f);
      RouterLosses l;
      route(o, x, gate, Tensor(), S, &l);
      const NaiveRoute n = naive_route(o, logits_of(x, gate), Tensor());
      const double want_aux = lb == LoadBalancing::none ? 0.0 : naive_aux(o, n, lb == LoadBalancing::seq_aux_loss ? B : 1);
      // fp32 scores summed in fp64: ~1e-6 relative.
      EXPECT_NEAR(l.aux_loss, want_aux, 1e-5 * want_aux) << "lb " << int(lb) << " sf " << int(sf);
      EXPECT_NEAR(l.z_loss, naive_z(o, n), 1e-5 * naive_z(o, n));
      EXPECT_GT(l.z_loss, 0.0);
      if (lb != LoadBalancing::none) {
        EXPECT_GT(l.aux_loss, 0.0);
      }
    }
  }
}

TEST(MoeRouter, SeqAuxDiffersFromBatchAuxWhenSequencesDiffer) {
  // Two sequences routed to disjoint experts: each sequence is maximally
  // unbalanced (seq aux large) while the batch as a whole is balanced.
  const int64_t E = 4;
  RouterOptions o = options(E, 2, ScoreFunction::softmax);
  o.aux_loss_coeff = 1.0f;
  Tensor x = rows_of({{4, 4, 0, 0}, {4, 4, 0, 0}, {0, 0, 4, 4}, {0, 0, 4, 4}});
  RouterLosses batch, seq;
  route(o, x, identity_gate(E), Tensor(), 2, &batch);
  o.load_balancing = LoadBalancing::seq_aux_loss;
  route(o, x, identity_gate(E), Tensor(), 2, &seq);
  EXPECT_GT(seq.aux_loss, 1.8 * batch.aux_loss);
  EXPECT_NEAR(batch.aux_loss, naive_aux(o, naive_route(o, logits_of(x, identity_gate(E)), Tensor()), 1), 1e-6);
}

// ------------------------------------------------------------ gradients

// Inputs whose selection survives the ±h perturbation: each token's gaps in
// s + b (between consecutive selected experts, the k-th and the next, and the
// kept/dropped groups) are >= 0.03, while h = 1e-3 along a unit-variance
// direction moves a logit by ~|x|·h ≈ 4e-3 and a score by at most that.
void resample_until_separated(const RouterOptions& o, Tensor& x, const Tensor& gate, const Tensor& bias,
                              std::mt19937& rng) {
  const int64_t T = x.rows(), D = x.cols();
  std::normal_distribution<float> nd;
  for (int tries = 0; tries < 2000; ++tries) {
    const NaiveRoute n = naive_route(o, logits_of(x, gate), bias);
    bool ok = true;
    for (int64_t t = 0; t < T; ++t)
      if (n.margin[t] < 0.03) {
        ok = false;
        for (int64_t d = 0; d < D; ++d) x.f32()[t * D + d] = nd(rng);
      }
    if (ok) return;
  }
  FAIL() << "could not draw well-separated router inputs";
}

using GradParam = std::tuple<ScoreFunction, LoadBalancing, bool /*z-loss*/, bool /*weight term*/>;
class RouterGrad : public ::testing::TestWithParam<GradParam> {};

TEST_P(RouterGrad, FiniteDifferencesThroughXAndGate) {
  const auto [sf, lb, with_z, with_weights] = GetParam();
  std::mt19937 rng(testing::test_seed(1000 + int(sf) * 100 + int(lb) * 10 + with_z * 2 + with_weights));
  const int64_t B = 3, S = 6, T = B * S, D = 16, E = 8, K = 2;
  RouterOptions o = options(E, K, sf);
  o.load_balancing = lb;
  o.aux_loss_coeff = 0.7f;
  o.z_loss_coeff = with_z ? 0.1f : 0.0f;
  o.normalize_topk = sf == ScoreFunction::sigmoid || lb == LoadBalancing::aux_loss;
  o.topk_scaling = 1.7f;
  if (lb == LoadBalancing::seq_aux_loss) o.num_groups = 4, o.group_topk = 2;
  if (lb == LoadBalancing::global_aux_loss) o.num_groups = 2, o.group_topk = 1;
  const float aux_scale = 0.5f;
  Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.5f);
  Tensor bias = random_tensor({E}, rng, 0.05f);
  resample_until_separated(o, x, gate, bias, rng);
  Tensor R = with_weights ? random_tensor({T, K}, rng) : zeros({T, K});

  RouterSaved saved;
  const Routing base = router_forward(ctx, o, x, gate, bias, S, saved);
  router_losses(o, saved);
  auto objective = [&] {
    RouterSaved s;
    Routing r = router_forward(ctx, o, x, gate, bias, S, s);
    const RouterLosses l = router_losses(o, s);
    for (int64_t i = 0; i < T * K; ++i)
      EXPECT_EQ(r.expert_TK.i32()[i], base.expert_TK.i32()[i]) << "selection flipped under the perturbation";
    return testing::dot(r.weight_TK, R) + aux_scale * (l.aux_loss + l.z_loss);
  };
  Tensor dgate = zeros({E, D});
  // No weight term: pass an undefined dweight (the aux-only caller's form).
  Tensor dx = router_backward(ctx, o, saved, gate, with_weights ? R : Tensor(), aux_scale, dgate);
  testing::expect_directional_grad("dx", x, dx, rng, objective);
  testing::expect_directional_grad("dgate", gate, dgate, rng, objective);
}

std::string grad_name(const ::testing::TestParamInfo<GradParam>& info) {
  const char* lb[] = {"none", "aux", "seq", "global"};
  return std::string(std::get<0>(info.param) == ScoreFunction::softmax ? "softmax_" : "sigmoid_") +
         lb[int(std::get<1>(info.param))] + (std::get<2>(info.param) ? "_z" : "") +
         (std::get<3>(info.param) ? "_weights" : "_lossonly");
}

// Every score function × balancing loss × z-loss on/off × weight term on/off,
// except the one objective with no term at all (none, no z, no weights).
std::vector<GradParam> grad_params() {
  std::vector<GradParam> out;
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid})
    for (LoadBalancing lb : {LoadBalancing::none, LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss,
                             LoadBalancing::global_aux_loss})
      for (bool z : {false, true})
        for (bool w : {false, true})
          if (lb != LoadBalancing::none || z || w) out.emplace_back(sf, lb, z, w);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllLosses, RouterGrad, ::testing::ValuesIn(grad_params()), grad_name);

// ------------------------------------------------------------ reducer

// Two ranks of a tp-cp group each hold a shard of every sequence; the reducer
// sums the other rank's local statistics (a faithful all-reduce on one
// process). The group's loss must equal the single-rank loss on the combined
// tokens, and the two ranks' gradients must add up to the single-rank ones.
class RouterReducer : public ::testing::TestWithParam<std::tuple<ScoreFunction, LoadBalancing>> {};

TEST_P(RouterReducer, TwoRankGroupMatchesTheCombinedBatch) {
  const auto [sf, lb] = GetParam();
  std::mt19937 rng(testing::test_seed(31 + int(lb)));
  const int64_t B = 2, Sl = 5, T = B * Sl, D = 12, E = 8, K = 2;
  RouterOptions o = options(E, K, sf);
  o.load_balancing = lb, o.aux_loss_coeff = 0.3f, o.z_loss_coeff = 0.05f, o.normalize_topk = true;
  Tensor xa = random_tensor({T, D}, rng), xb = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.5f);
  Tensor ra = random_tensor({T, K}, rng), rb = random_tensor({T, K}, rng);
  // Combined batch: sequence b = rank a's shard b, then rank b's shard b.
  Tensor xc = f32({2 * T, D}), rc = f32({2 * T, K});
  for (int64_t b = 0; b < B; ++b)
    for (int r = 0; r < 2; ++r) {
      const Tensor& xs = r ? xb : xa;
      const Tensor& rs = r ? rb : ra;
      const int64_t dst = b * 2 * Sl + r * Sl;
      std::copy(xs.f32() + b * Sl * D, xs.f32() + (b + 1) * Sl * D, xc.f32() + dst * D);
      std::copy(rs.f32() + b * Sl * K, rs.f32() + (b + 1) * Sl * K, rc.f32() + dst * K);
    }
  const int64_t S = lb == LoadBalancing::seq_aux_loss ? B : 1;
  std::vector<double> local_a, local_b;
  int calls = 0;
  auto capture = [&](std::vector<double>& into) {
    return [&into, &calls, n_want = 2 * S * E + 2](const Tensor& stats) {
      ++calls;
      EXPECT_EQ(stats.dtype(), DType::f64);
      EXPECT_EQ(stats.numel(), n_want) << "buffer layout [counts | score sums | tokens | Σ lse²]";
      into.assign(stats.data<double>(), stats.data<double>() + stats.numel());
    };
  };
  auto plus = [&calls](const std::vector<double>& other) {
    return [&other, &calls](const Tensor& stats) {
      ++calls;
      ASSERT_EQ(stats.numel(), int64_t(other.size()));
      for (int64_t i = 0; i < stats.numel(); ++i) stats.data<double>()[i] += other[i];
    };
  };
  RouterLosses la_local, la, lb_, lc;
  route(o, xa, gate, Tensor(), Sl, &la_local, capture(local_a));
  route(o, xb, gate, Tensor(), Sl, nullptr, capture(local_b));
  EXPECT_EQ(calls, 2);
  EXPECT_DOUBLE_EQ(local_a[2 * S * E], double(T)) << "local token count";

  RouterSaved sa, sb, sc;
  router_forward(ctx, o, xa, gate, Tensor(), Sl, sa, plus(local_b));
  router_forward(ctx, o, xb, gate, Tensor(), Sl, sb, plus(local_a));
  router_forward(ctx, o, xc, gate, Tensor(), 2 * Sl, sc);
  la = router_losses(o, sa);
  lb_ = router_losses(o, sb);
  lc = router_losses(o, sc);
  EXPECT_EQ(calls, 4);
  EXPECT_DOUBLE_EQ(sa.aux_tokens, double(2 * T));
  // oneDNN may round a token's fp32 logits differently at M = 10 and M = 20
  // rows (measured ~1e-7 relative in the losses); a wrong token count or a
  // missing rank's statistics is off by O(1).
  EXPECT_NEAR(la.aux_loss, lc.aux_loss, 1e-6 * lc.aux_loss);
  EXPECT_NEAR(lb_.aux_loss, lc.aux_loss, 1e-6 * lc.aux_loss);
  EXPECT_NEAR(la.z_loss, lc.z_loss, 1e-6 * lc.z_loss);
  EXPECT_GT(lc.aux_loss, 0.0);
  // Non-vacuous: rank a alone sees different statistics.
  EXPECT_GT(std::abs(la_local.aux_loss - lc.aux_loss) + std::abs(la_local.z_loss - lc.z_loss), 1e-6 * lc.z_loss);

  Tensor ga = zeros({E, D}), gb = zeros({E, D}), gc = zeros({E, D});
  Tensor dxa = router_backward(ctx, o, sa, gate, ra, 0.5f, ga);
  Tensor dxb = router_backward(ctx, o, sb, gate, rb, 0.5f, gb);
  Tensor dxc = router_backward(ctx, o, sc, gate, rc, 0.5f, gc);
  // fp32 GEMM sums over different token sets: 1e-5 of the largest entry.
  double scale = 0;
  for (int64_t i = 0; i < E * D; ++i) scale = std::max(scale, double(std::abs(gc.f32()[i])));
  for (int64_t i = 0; i < E * D; ++i) EXPECT_NEAR(ga.f32()[i] + gb.f32()[i], gc.f32()[i], 1e-5 * scale) << i;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sl * D; ++i) {
      EXPECT_NEAR(dxa.f32()[b * Sl * D + i], dxc.f32()[(b * 2 * Sl) * D + i], 1e-5);
      EXPECT_NEAR(dxb.f32()[b * Sl * D + i], dxc.f32()[(b * 2 * Sl + Sl) * D + i], 1e-5);
    }
}

INSTANTIATE_TEST_SUITE_P(Losses, RouterReducer,
                         ::testing::Combine(::testing::Values(ScoreFunction::softmax, ScoreFunction::sigmoid),
                                            ::testing::Values(LoadBalancing::aux_loss, LoadBalancing::seq_aux_loss,
                                                              LoadBalancing::global_aux_loss)));

TEST(MoeRouter, ReducerIsCalledOnlyWhenALossNeedsStatistics) {
  std::mt19937 rng(testing::test_seed(37));
  const int64_t T = 8, D = 4, E = 4;
  Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng);
  struct Case { LoadBalancing lb; float aux, z; int calls; int64_t n; };
  const Case cases[] = {{LoadBalancing::none, 1.0f, 0.0f, 0, 0},   {LoadBalancing::aux_loss, 0.0f, 0.0f, 0, 0},
                        {LoadBalancing::none, 0.0f, 0.1f, 1, 2},   {LoadBalancing::aux_loss, 0.1f, 0.0f, 1, 2 * E + 2},
                        {LoadBalancing::seq_aux_loss, 0.1f, 0.0f, 1, 2 * 2 * E + 2}};
  for (const Case& c : cases) {
    RouterOptions o = options(E, 2, ScoreFunction::softmax);
    o.load_balancing = c.lb, o.aux_loss_coeff = c.aux, o.z_loss_coeff = c.z;
    int calls = 0;
    int64_t got_n = 0;
    RouterLosses l;
    route(o, x, gate, Tensor(), T / 2, &l, [&](const Tensor& stats) { ++calls, got_n = stats.numel(); });
    EXPECT_EQ(calls, c.calls) << "lb " << int(c.lb) << " aux " << c.aux << " z " << c.z;
    if (c.calls) {
      EXPECT_EQ(got_n, c.n);
    }
    if (c.aux == 0.0f || c.lb == LoadBalancing::none) {
      EXPECT_EQ(l.aux_loss, 0.0);
    }
  }
}

// ------------------------------------------------------------ expert bias

TEST(MoeRouter, UpdateExpertBiasFollowsSignOfMeanMinusLoad) {
  Tensor b = f32({4});
  const float init[] = {0.5f, -0.25f, 1.0f, 0.0f};
  std::copy(init, init + 4, b.f32());
  update_expert_bias(ctx, b, {5, 3, 4, 4}, 0.125f);  // mean 4: signs -1, +1, 0, 0
  EXPECT_EQ(b.f32()[0], 0.375f);
  EXPECT_EQ(b.f32()[1], -0.125f);
  EXPECT_EQ(b.f32()[2], 1.0f);
  EXPECT_EQ(b.f32()[3], 0.0f);

  std::mt19937 rng(testing::test_seed(41));
  const int64_t E = 16;
  std::vector<int64_t> load(E);
  std::uniform_int_distribution<int64_t> d(0, 100);
  for (auto& l : load) l = d(rng);
  Tensor r = random_tensor({E}, rng), before = f32({E});
  before.copy_from(r);
  update_expert_bias(ctx, r, load, 1e-3f);
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / E;
  for (int64_t e = 0; e < E; ++e) {
    const double s = (mean > load[e]) - (mean < load[e]);
    EXPECT_FLOAT_EQ(r.f32()[e], before.f32()[e] + float(1e-3 * s)) << e;
  }
}

}  // namespace
}  // namespace origami::moe
