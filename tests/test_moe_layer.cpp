// Whole MoE layer on one rank (moe/moe_layer.h): forward against a naive fp64
// restatement of ARCHITECTURE.md §4 (scores, top-k by s + b, p, capacity and
// drop, Σ_j p_j·SwiGLU_{e_j}(x) + shared, aux and z losses), and
// finite-difference checks of x, gate, experts and shared expert for dropless
// softmax + aux_loss, sigmoid + normalize_topk + seq_aux_loss + z-loss, and
// capacity_factor 1.0 with drop_policy probs and position.
//
// FD validity: the objective f = Σ y ⊙ R + aux_scale·(aux + z) is smooth only
// while expert selection and capacity decisions stay fixed. Router logits are
// spread (gate std 0.5 over D = 16: logit std ~2) and tokens are redrawn until
// no decision can flip under a logit change of 0.1 (separated_input), while
// the largest step (2h = 2e-3, grad_check.h) along a unit-normal direction
// moves a logit by at most ~3e-2. Every perturbed forward also asserts that
// the selected and the kept (token, expert) pairs are exactly the unperturbed
// ones, so a flip fails loudly instead of passing as a bad derivative.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>

#include "grad_check.h"
#include "moe/moe_layer.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using moe::DropPolicy;
using moe::ExpertWeights;
using moe::LoadBalancing;
using moe::MoeLayerOptions;
using moe::MoeLayerWeights;
using moe::ScoreFunction;
using testing::expect_directional_grad;
using testing::random_tensor;

constexpr int64_t B = 2, S = 12, T = B * S, D = 16, E = 6, K = 2, F = 12, FS = 20;

Tensor zeros_like(const Tensor& t) { return Tensor::zeros(t.shape(), DType::f32, MemCategory::grad); }
ExpertWeights zeros_like(const ExpertWeights& w) {
  if (!w.w1_EFD.defined()) return {};
  return {zeros_like(w.w1_EFD), zeros_like(w.w3_EFD), zeros_like(w.w2_EDF)};
}

ExpertWeights random_experts(int64_t n, int64_t f, std::mt19937& rng) {
  return {random_tensor({n, f, D}, rng, 0.3f, MemCategory::param),
          random_tensor({n, f, D}, rng, 0.3f, MemCategory::param),
          random_tensor({n, D, f}, rng, 0.3f, MemCategory::param)};
}

struct Case {
  MoeLayerOptions opt;
  bool shared = true;
  bool bias = false;
};

MoeLayerWeights random_layer(const Case& c, std::mt19937& rng) {
  MoeLayerWeights w;
  // Logits of std ~2; separated_input then keeps every decision clear of ties.
  w.gate_ED = random_tensor({E, D}, rng, 0.5f, MemCategory::param);
  if (c.bias) {
    // Expert bias moves selection only; 0.1 is large enough to change some
    // picks relative to s alone, so p = s (not s + b) is exercised.
    w.bias_E = random_tensor({E}, rng, 0.1f, MemCategory::param);
  }
  w.experts = random_experts(E, F, rng);
  if (c.shared) w.shared = random_experts(1, FS, rng);
  return w;
}

Case dropless_softmax() {
  Case c;
  moe::RouterOptions& r = c.opt.router;
  r.num_experts = E, r.top_k = K, r.score_function = ScoreFunction::softmax;
  r.load_balancing = LoadBalancing::aux_loss, r.aux_loss_coeff = 0.5f;
  return c;
}

Case sigmoid_seq_aux_z() {
  Case c;
  moe::RouterOptions& r = c.opt.router;
  r.num_experts = E, r.top_k = K, r.score_function = ScoreFunction::sigmoid, r.normalize_topk = true;
  r.topk_scaling = 2.5f, r.load_balancing = LoadBalancing::seq_aux_loss, r.aux_loss_coeff = 0.5f;
  r.z_loss_coeff = 0.05f;
  c.bias = true;
  return c;
}

Case capacity(DropPolicy policy) {
  Case c = dropless_softmax();
  c.opt.capacity.capacity_factor = 1.0;
  c.opt.capacity.drop_policy = policy;
  return c;
}

// ---------------------------------------------------------------------------
// Naive fp64 reference of §4, token by token.

struct Naive {
  std::vector<double> y;  // [T, D]
  std::vector<std::array<int, K>> expert;
  std::vector<std::array<double, K>> p;
  std::vector<std::array<bool, K>> kept;
  std::vector<int64_t> routed, kept_count;
  double aux = 0, z = 0;
  // Distance of each decision from flipping, as the smallest max_{t,e} |Δz|
  // that could flip it: per token, the top-k selection; per expert that drops
  // under "probs", its last kept vs first dropped slot.
  std::vector<double> select_margin;
  std::vector<std::pair<int64_t, double>> boundary;  // (first dropped token, gap)
};

std::vector<double> naive_swiglu(const ExpertWeights& w, int64_t e, const float* x) {
  const int64_t f_dim = w.w1_EFD.size(1);
  const float* w1 = w.w1_EFD.f32() + e * f_dim * D;
  const float* w3 = w.w3_EFD.f32() + e * f_dim * D;
  const float* w2 = w.w2_EDF.f32() + e * D * f_dim;
  std::vector<double> h(f_dim), y(D, 0.0);
  for (int64_t f = 0; f < f_dim; ++f) {
    double g = 0, u = 0;
    for (int64_t d = 0; d < D; ++d) g += double(w1[f * D + d]) * x[d], u += double(w3[f * D + d]) * x[d];
    h[f] = g / (1 + std::exp(-g)) * u;
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t f = 0; f < f_dim; ++f) y[d] += double(w2[d * f_dim + f]) * h[f];
  return y;
}

// Routing, losses and capacity decisions; no expert outputs.
Naive naive_routing(const MoeLayerOptions& opt, const MoeLayerWeights& w, const Tensor& x) {
  const auto& ro = opt.router;
  Naive out;
  out.routed.assign(E, 0);
  std::vector<std::vector<double>> s(T, std::vector<double>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> z(E);
    for (int64_t e = 0; e < E; ++e) {
      z[e] = 0;
      for (int64_t d = 0; d < D; ++d) z[e] += double(x.f32()[t * D + d]) * w.gate_ED.f32()[e * D + d];
    }
    const double zmax = *std::max_element(z.begin(), z.end());
    double se = 0;
    for (double v : z) se += std::exp(v - zmax);
    const double lse = zmax + std::log(se);
    out.z += lse * lse / T;
    for (int64_t e = 0; e < E; ++e)
      s[t][e] = ro.score_function == ScoreFunction::softmax ? std::exp(z[e] - lse) : 1 / (1 + std::exp(-z[e]));
    // Top-k by s + b, ties to the lower index (stable sort on descending key).
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    auto key = [&](int e) { return s[t][e] + (w.bias_E.defined() ? w.bias_E.f32()[e] : 0.0); };
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) > key(b); });
    // Margin = the smallest max_e |Δz_e| that can flip the k-th and
    // (k+1)-th pick. Without bias both score functions rank by z: half the z
    // gap. With bias, keys s + b: a sigmoid score moves by ≤ δ/4, a softmax
    // score by ≤ δ/2 (Σ_j |∂s_e/∂z_j| = 2s_e(1 − s_e)), each of two keys.
    const double key_gap = key(order[K - 1]) - key(order[K]);
    out.select_margin.push_back(!w.bias_E.defined()                      ? (z[order[K - 1]] - z[order[K]]) / 2
                                : ro.score_function == ScoreFunction::sigmoid ? 2 * key_gap
                                                                              : key_gap);
    std::array<int, K> ex{};
    std::array<double, K> p{};
    double psum = 0;
    for (int j = 0; j < K; ++j) ex[j] = order[j], p[j] = s[t][order[j]], psum += p[j];
    for (int j = 0; j < K; ++j) {
      if (ro.normalize_topk) p[j] /= psum;
      p[j] *= ro.topk_scaling;
      ++out.routed[ex[j]];
    }
    out.expert.push_back(ex);
    out.p.push_back(p);
    out.kept.push_back({true, true});
  }
  out.z *= ro.z_loss_coeff;

  // Aux loss (Megatron): α·E·Σ_e f_e·P_e, f_e = routed share of the slots,
  // P_e = mean score (sigmoid scores normalized per token); seq_aux_loss is
  // the same per sequence, averaged over sequences.
  const bool per_seq = ro.load_balancing == LoadBalancing::seq_aux_loss;
  const int64_t groups = per_seq ? B : 1, len = per_seq ? S : T;
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<double> cnt(E, 0), P(E, 0);
    for (int64_t t = g * len; t < (g + 1) * len; ++t) {
      const double norm =
          ro.score_function == ScoreFunction::sigmoid ? std::accumulate(s[t].begin(), s[t].end(), 0.0) : 1;
      for (int64_t e = 0; e < E; ++e) P[e] += s[t][e] / norm / len;
      for (int j = 0; j < K; ++j) cnt[out.expert[t][j]] += 1;
    }
    double l = 0;
    for (int64_t e = 0; e < E; ++e) l += cnt[e] / double(len * K) * P[e];
    out.aux += ro.aux_loss_coeff * E * l / groups;
  }

  // Capacity: C = ceil(T·k/E·cf); probs keeps each expert's C highest p
  // (ties: lower token, then lower slot); position keeps its first C slots.
  if (opt.capacity.capacity_factor) {
    const auto C = static_cast<size_t>(std::ceil(double(T * K) / E * *opt.capacity.capacity_factor));
    for (int64_t e = 0; e < E; ++e) {
      std::vector<std::pair<int64_t, int>> slots;  // (t, j), token order then slot order
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < K; ++j)
          if (out.expert[t][j] == e) slots.push_back({t, j});
      auto p_of = [&](std::pair<int64_t, int> sl) { return out.p[sl.first][sl.second]; };
      if (opt.capacity.drop_policy == DropPolicy::probs) {
        std::stable_sort(slots.begin(), slots.end(), [&](auto a, auto b) { return p_of(a) > p_of(b); });
        // Un-normalized softmax p = scaling·s moves by ≤ scaling·δ/2, two
        // of them: margin = gap / scaling (the cases here do not normalize).
        EXPECT_TRUE(ro.score_function == ScoreFunction::softmax && !ro.normalize_topk);
        if (slots.size() > C)
          out.boundary.push_back({slots[C].first, (p_of(slots[C - 1]) - p_of(slots[C])) / ro.topk_scaling});
      }
      for (size_t i = C; i < slots.size(); ++i) out.kept[slots[i].first][slots[i].second] = false;
    }
  }
  return out;
}

Naive naive_layer(const MoeLayerOptions& opt, const MoeLayerWeights& w, const Tensor& x) {
  Naive out = naive_routing(opt, w, x);
  out.y.assign(T * D, 0.0);
  out.kept_count.assign(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.f32() + t * D;
    for (int j = 0; j < K; ++j) {
      if (!out.kept[t][j]) continue;
      ++out.kept_count[out.expert[t][j]];
      const auto ye = naive_swiglu(w.experts, out.expert[t][j], xt);
      for (int64_t d = 0; d < D; ++d) out.y[t * D + d] += out.p[t][j] * ye[d];
    }
    if (w.has_shared()) {
      const auto ys = naive_swiglu(w.shared, 0, xt);
      for (int64_t d = 0; d < D; ++d) out.y[t * D + d] += ys[d];
    }
  }
  return out;
}

// Redraws the tokens whose routing or capacity decision could flip under a
// logit change of kMargin, until none can. The largest finite-difference
// step, 2h = 2e-3, along a unit-normal direction moves a logit by
// ~2h·|x_t| ≈ 8e-3 (gate direction) or 2h·|W_e| ≈ 4e-3 (x direction), at most
// ~3e-2 over all T·E logits, so kMargin = 0.1 keeps every finite-difference evaluation on the same routing;
// it also keeps fp32 and the fp64 reference from disagreeing on near-ties.
constexpr double kMargin = 0.1;
Tensor separated_input(const Case& c, const MoeLayerWeights& w, std::mt19937& rng) {
  Tensor x = random_tensor({T, D}, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int round = 0; round < 200; ++round) {
    const Naive n = naive_routing(c.opt, w, x);
    std::vector<int64_t> redraw;
    for (int64_t t = 0; t < T; ++t)
      if (n.select_margin[t] < kMargin) redraw.push_back(t);
    for (auto [t, gap] : n.boundary)
      if (gap < kMargin) redraw.push_back(t);
    if (redraw.empty()) return x;
    for (int64_t t : redraw)
      for (int64_t d = 0; d < D; ++d) x.f32()[t * D + d] = normal(rng);
  }
  ADD_FAILURE() << "could not draw tokens with routing margins >= " << kMargin;
  return x;
}

// separated_input, redrawn whole until capacity drops some assignment: a
// fresh draw at capacity factor 1.0 can balance exactly (2 draws in 60).
Tensor dropping_input(const Case& c, const MoeLayerWeights& w, std::mt19937& rng) {
  for (int draw = 0; draw < 50; ++draw) {
    Tensor x = separated_input(c, w, rng);
    const Naive n = naive_routing(c.opt, w, x);
    for (const auto& kept_K : n.kept)
      if (std::find(kept_K.begin(), kept_K.end(), false) != kept_K.end()) return x;
  }
  ADD_FAILURE() << "50 draws at capacity factor 1.0 dropped nothing";
  return separated_input(c, w, rng);
}

// fp32 layer vs fp64 reference: sums of ≤ 20 O(1) products and a softmax,
// errors ~1e-6; 1e-5 relative to max(|y|, 1) catches any misrouted or
// mis-weighted row (errors O(|y|)) and an intermediate rounded short of fp32.
void expect_matches_naive(const Case& c, const MoeLayerWeights& w, const Tensor& x) {
  moe::MoeLayerSaved saved;
  moe::MoeLayerStats stats;
  Tensor y = moe::moe_layer_forward(ctx, c.opt, w, x, S, saved, stats);
  const Naive ref = naive_layer(c.opt, w, x);
  check_shape(y, {T, D}, "y");
  double max_abs = 0;
  for (int64_t i = 0; i < T * D; ++i) {
    EXPECT_NEAR(y.f32()[i], ref.y[i], 1e-5 * std::max(1.0, std::abs(ref.y[i]))) << "element " << i;
    max_abs = std::max(max_abs, std::abs(ref.y[i]));
  }
  EXPECT_GT(max_abs, 1e-2) << "reference output is (near) zero";
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < K; ++j) {
      EXPECT_EQ(saved.routing.expert_TK.i32()[t * K + j], ref.expert[t][j]) << "token " << t << " slot " << j;
      EXPECT_NEAR(saved.routing.weight_TK.f32()[t * K + j], ref.p[t][j], 1e-5) << "token " << t << " slot " << j;
    }
  EXPECT_EQ(stats.routed_per_expert, ref.routed);
  EXPECT_EQ(stats.kept_per_expert, ref.kept_count);
  EXPECT_NEAR(stats.losses.aux_loss, ref.aux, 1e-5 * std::max(1.0, ref.aux));
  EXPECT_NEAR(stats.losses.z_loss, ref.z, 1e-5 * std::max(1.0, ref.z));
}

TEST(MoeLayer, ForwardMatchesNaiveDroplessSoftmax) {
  std::mt19937 rng(testing::test_seed(31));
  const Case c = dropless_softmax();
  MoeLayerWeights w = random_layer(c, rng);
  Tensor x = separated_input(c, w, rng);
  expect_matches_naive(c, w, x);
}

TEST(MoeLayer, ForwardMatchesNaiveSigmoidNormalizedWithBias) {
  std::mt19937 rng(testing::test_seed(32));
  const Case c = sigmoid_seq_aux_z();
  MoeLayerWeights w = random_layer(c, rng);
  Tensor x = separated_input(c, w, rng);
  expect_matches_naive(c, w, x);
}

TEST(MoeLayer, ForwardMatchesNaiveWithDropping) {
  for (DropPolicy policy : {DropPolicy::probs, DropPolicy::position}) {
    SCOPED_TRACE(policy == DropPolicy::probs ? "probs" : "position");
    std::mt19937 rng(testing::test_seed(33));
    const Case c = capacity(policy);
    MoeLayerWeights w = random_layer(c, rng);
    Tensor x = dropping_input(c, w, rng);
    expect_matches_naive(c, w, x);
    const Naive ref = naive_layer(c.opt, w, x);
    const int64_t routed = std::accumulate(ref.routed.begin(), ref.routed.end(), int64_t{0});
    const int64_t kept = std::accumulate(ref.kept_count.begin(), ref.kept_count.end(), int64_t{0});
    EXPECT_LT(kept, routed) << "capacity 1.0 dropped nothing; the case would not test dropping";
  }
}

// pad_to_capacity adds zero rows only: same output, every expert exactly C rows.
TEST(MoeLayer, PadToCapacityChangesNothingButRowCounts) {
  std::mt19937 rng(testing::test_seed(34));
  Case c = capacity(DropPolicy::probs);
  MoeLayerWeights w = random_layer(c, rng);
  Tensor x = separated_input(c, w, rng);
  moe::MoeLayerSaved s1, s2;
  moe::MoeLayerStats st1, st2;
  Tensor y1 = moe::moe_layer_forward(ctx, c.opt, w, x, S, s1, st1);
  c.opt.capacity.pad_to_capacity = true;
  Tensor y2 = moe::moe_layer_forward(ctx, c.opt, w, x, S, s2, st2);
  const int64_t C = moe::expert_capacity(c.opt.capacity, T, K, E);
  EXPECT_EQ(s2.perm.rows_per_expert, std::vector<int64_t>(E, C));
  for (int64_t i = 0; i < T * D; ++i) EXPECT_NEAR(y1.f32()[i], y2.f32()[i], 1e-6) << "element " << i;
  EXPECT_EQ(st1.kept_per_expert, st2.kept_per_expert);
}

// ---------------------------------------------------------------------------
// Finite differences.

enum class Drops { none, some };
// full: f = Σ y ⊙ R + aux_scale·(aux + z); losses_only: R = 0.
enum class Objective { full, losses_only };

void check_layer_gradients(const Case& c, uint32_t seed, Drops drops, Objective objective_kind = Objective::full) {
  const bool aux_only = objective_kind == Objective::losses_only;
  std::mt19937 rng(testing::test_seed(seed));
  MoeLayerWeights w = random_layer(c, rng);
  Tensor x = drops == Drops::some ? dropping_input(c, w, rng) : separated_input(c, w, rng);
  Tensor r = aux_only ? Tensor::zeros({T, D}, DType::f32, MemCategory::activation) : random_tensor({T, D}, rng);
  const float aux_scale = 0.5f;

  moe::MoeLayerSaved saved;
  moe::MoeLayerStats stats;
  Tensor y = moe::moe_layer_forward(ctx, c.opt, w, x, S, saved, stats);
  EXPECT_GT(testing::dot(y, y), 1e-4) << "layer output is zero";
  const double losses = stats.losses.aux_loss + stats.losses.z_loss;
  EXPECT_GT(losses, 0.0);
  const int64_t routed = std::accumulate(stats.routed_per_expert.begin(), stats.routed_per_expert.end(), int64_t{0});
  const int64_t kept = std::accumulate(stats.kept_per_expert.begin(), stats.kept_per_expert.end(), int64_t{0});
  EXPECT_EQ(routed, T * K);
  if (drops == Drops::some) {
    EXPECT_LT(kept, routed) << "nothing dropped; the capacity case would be vacuous";
  } else {
    EXPECT_EQ(kept, routed);
  }

  // Every perturbed evaluation must select and keep the same (token, expert)
  // pairs as the base point. The order of a token's k picks may change (two
  // of its top-k scores can cross): that reorders slots but leaves f smooth.
  auto decisions = [](const moe::MoeLayerSaved& sv) {
    std::vector<std::array<int32_t, 3>> out;  // (token, expert, kept)
    const int32_t* expert_TK = sv.routing.expert_TK.i32();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) out.push_back({int32_t(t), expert_TK[t * K + j], 0});
    for (int64_t row = 0; row < sv.perm.num_rows(); ++row) {
      const int32_t t = sv.perm.row_token_N.i32()[row], j = sv.perm.row_slot_N.i32()[row];
      if (t >= 0) out.push_back({t, expert_TK[t * K + j], 1});
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  const auto base_decisions = decisions(saved);
  auto objective = [&] {
    moe::MoeLayerSaved s;
    moe::MoeLayerStats st;
    const Tensor yy = moe::moe_layer_forward(ctx, c.opt, w, x, S, s, st);
    EXPECT_TRUE(decisions(s) == base_decisions)
        << "a finite-difference step changed expert selection or capacity decisions";
    return testing::dot(yy, r) + aux_scale * (st.losses.aux_loss + st.losses.z_loss);
  };

  MoeLayerWeights g;
  g.gate_ED = zeros_like(w.gate_ED);
  g.experts = zeros_like(w.experts);
  g.shared = zeros_like(w.shared);
  Tensor dx = moe::moe_layer_backward(ctx, c.opt, w, saved, r, aux_scale, g);
  check_shape(dx, {T, D}, "dx");
  expect_directional_grad("dx", x, dx, rng, objective);
  expect_directional_grad("dgate", w.gate_ED, g.gate_ED, rng, objective);
  if (aux_only) return;  // experts do not reach the aux/z losses
  expect_directional_grad("dW1", w.experts.w1_EFD, g.experts.w1_EFD, rng, objective);
  expect_directional_grad("dW3", w.experts.w3_EFD, g.experts.w3_EFD, rng, objective);
  expect_directional_grad("dW2", w.experts.w2_EDF, g.experts.w2_EDF, rng, objective);
  if (w.has_shared()) {
    expect_directional_grad("shared dW1", w.shared.w1_EFD, g.shared.w1_EFD, rng, objective);
    expect_directional_grad("shared dW3", w.shared.w3_EFD, g.shared.w3_EFD, rng, objective);
    expect_directional_grad("shared dW2", w.shared.w2_EDF, g.shared.w2_EDF, rng, objective);
  }
}

TEST(MoeLayerGrad, DroplessSoftmaxAuxLossWithSharedExpert) {
  check_layer_gradients(dropless_softmax(), 41, Drops::none);
}

TEST(MoeLayerGrad, SigmoidNormalizedSeqAuxZLossWithBias) {
  Case c = sigmoid_seq_aux_z();
  c.shared = false;
  check_layer_gradients(c, 42, Drops::none);
}

TEST(MoeLayerGrad, CapacityDropByProbs) { check_layer_gradients(capacity(DropPolicy::probs), 43, Drops::some); }

TEST(MoeLayerGrad, CapacityDropByPosition) { check_layer_gradients(capacity(DropPolicy::position), 44, Drops::some); }

// With R = 0 the objective is aux_scale·(aux + z) alone: checks that the
// layer hands aux_scale to the router and adds its dx.
TEST(MoeLayerGrad, AuxAndZLossOnly) {
  Case c = sigmoid_seq_aux_z();
  c.opt.router.score_function = ScoreFunction::softmax;
  c.opt.router.load_balancing = LoadBalancing::aux_loss;
  check_layer_gradients(c, 45, Drops::none, Objective::losses_only);
}

}  // namespace
}  // namespace origami
