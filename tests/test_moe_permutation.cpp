// Capacity, dropping and permutation tests (ARCHITECTURE.md §4, §9): the
// capacity formula; both drop policies against naive references with exact
// weight ties; the permuted row layout (expert, then token, then slot) with
// and without padding; permute∘unpermute; the backward passes through exact
// adjoint identities; and, at bench sizes, the cost of router + permute +
// unpermute next to the expert GEMMs they serve.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "grad_check.h"
#include "kernels/gemm.h"
#include "moe/permutation.h"
#include "moe/router.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami::moe {
namespace {

const ExecContext& ctx = testing::test_context();

using testing::random_tensor;

// Random routing: k distinct experts per token, skewed towards low experts so
// some are over capacity and some under; weights from {1, 2, 3, 4}/8 so exact
// ties happen often.
struct RandomRouting {
  Tensor expert_TK, weight_TK;
};
RandomRouting random_routing(int64_t T, int64_t K, int64_t E, std::mt19937& rng) {
  RandomRouting r{Tensor::empty({T, K}, DType::i32, MemCategory::activation),
                  Tensor::empty({T, K}, DType::f32, MemCategory::activation)};
  std::vector<double> w(E);
  for (int64_t e = 0; e < E; ++e) w[e] = 1.0 / (1 + e);
  std::uniform_int_distribution<int> q(1, 4);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> wt = w;
    for (int64_t j = 0; j < K; ++j) {
      const int e = std::discrete_distribution<int>(wt.begin(), wt.end())(rng);
      wt[e] = 0;  // distinct experts per token
      r.expert_TK.i32()[t * K + j] = e;
      r.weight_TK.f32()[t * K + j] = q(rng) / 8.0f;
    }
  }
  return r;
}

std::vector<uint8_t> naive_kept(const RandomRouting& r, int64_t E, int64_t C, DropPolicy policy) {
  const int64_t n = r.expert_TK.numel();
  std::vector<uint8_t> kept(n, 0);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> slots;  // flat index = token-major (t, j)
    for (int64_t i = 0; i < n; ++i)
      if (r.expert_TK.i32()[i] == e) slots.push_back(i);
    if (policy == DropPolicy::probs)
      std::stable_sort(slots.begin(), slots.end(),
                       [&](int64_t a, int64_t b) { return r.weight_TK.f32()[a] > r.weight_TK.f32()[b]; });
    for (int64_t i = 0; i < std::min<int64_t>(C, slots.size()); ++i) kept[slots[i]] = 1;
  }
  return kept;
}

CapacityOptions capacity_options(std::optional<double> cf, DropPolicy p = DropPolicy::probs, bool pad = false) {
  CapacityOptions o;
  o.capacity_factor = cf;
  o.drop_policy = p;
  o.pad_to_capacity = pad;
  return o;
}

TEST(MoePermutation, CapacityFormula) {
  EXPECT_EQ(expert_capacity(capacity_options(std::nullopt), 4096, 2, 8), -1);
  EXPECT_EQ(expert_capacity(capacity_options(1.0), 10, 2, 4), 5);
  EXPECT_EQ(expert_capacity(capacity_options(1.25), 10, 2, 4), 7);  // ceil(6.25)
  EXPECT_EQ(expert_capacity(capacity_options(1.0), 4096, 2, 8), 1024);
  EXPECT_EQ(expert_capacity(capacity_options(1.0), 3, 1, 8), 1);  // ceil(0.375)
  EXPECT_EQ(expert_capacity(capacity_options(0.5), 16, 2, 8), 2);
  EXPECT_EQ(expert_capacity(capacity_options(1.1), 30, 1, 10), 4);  // 3 · 1.1 = 3.3000000000000003 → 4, as Megatron
}

TEST(MoePermutation, DropPoliciesMatchNaive) {
  std::mt19937 rng(testing::test_seed(51));
  const int64_t T = 60, K = 2, E = 8;
  for (DropPolicy policy : {DropPolicy::probs, DropPolicy::position}) {
    for (int64_t C : {0, 1, 3, 9, 200}) {
      const RandomRouting r = random_routing(T, K, E, rng);
      Tensor kept = apply_capacity(ctx, capacity_options(1.0, policy), r.expert_TK, r.weight_TK, E, C);
      const std::vector<uint8_t> want = naive_kept(r, E, C, policy);
      int64_t n_kept = 0;
      for (int64_t i = 0; i < T * K; ++i) {
        EXPECT_EQ(kept.data<uint8_t>()[i], want[i]) << "policy " << int(policy) << " C " << C << " slot " << i;
        n_kept += want[i];
      }
      // Non-vacuous: C = 3, 9 drop some slots and keep some.
      if (C == 3 || C == 9) {
        EXPECT_GT(n_kept, 0);
        EXPECT_LT(n_kept, T * K);
      }
    }
  }
  // Dropless keeps everything.
  const RandomRouting r = random_routing(T, K, E, rng);
  Tensor all = apply_capacity(ctx, capacity_options(std::nullopt), r.expert_TK, r.weight_TK, E, -1);
  for (int64_t i = 0; i < T * K; ++i) EXPECT_EQ(all.data<uint8_t>()[i], 1);
}

TEST(MoePermutation, ProbsPolicyBreaksWeightTiesByTokenThenSlot) {
  // Expert 0 gets five slots (tokens 0..4); token 4's weighs most, the rest
  // tie at 0.5, so capacity 2 keeps token 4's and then the earliest, token 0's.
  Tensor ex = Tensor::empty({5, 2}, DType::i32, MemCategory::activation);
  Tensor w = Tensor::empty({5, 2}, DType::f32, MemCategory::activation);
  const int32_t experts[] = {1, 0, 0, 2, 3, 0, 0, 1, 2, 0};
  for (int i = 0; i < 10; ++i) ex.i32()[i] = experts[i], w.f32()[i] = 0.5f;
  w.f32()[9] = 0.75f;  // token 4's expert-0 slot outranks everyone
  Tensor kept = apply_capacity(ctx, capacity_options(1.0, DropPolicy::probs), ex, w, 4, 2);
  const uint8_t want[] = {1, 1, 0, 1, 1, 0, 0, 1, 1, 1};  // expert 0 keeps slot 9, then slot 1 (token 0)
  for (int i = 0; i < 10; ++i) EXPECT_EQ(kept.data<uint8_t>()[i], want[i]) << "slot " << i;
}

// Naive layout: expert by expert, tokens ascending, slots ascending, then
// padding up to C.
struct NaiveLayout {
  std::vector<int32_t> token, slot;
};
NaiveLayout naive_layout(const Tensor& ex, const Tensor& kept, int64_t E, int64_t pad_to) {
  NaiveLayout l;
  const int64_t T = ex.rows(), K = ex.cols();
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j)
        if (ex.i32()[t * K + j] == e && kept.data<uint8_t>()[t * K + j]) {
          l.token.push_back(t), l.slot.push_back(j), ++n;
        }
    for (; n < pad_to; ++n) l.token.push_back(-1), l.slot.push_back(-1);
  }
  return l;
}

TEST(MoePermutation, PermutationLayoutCountsAndPadding) {
  std::mt19937 rng(testing::test_seed(53));
  const int64_t T = 50, K = 2, E = 8;
  for (bool pad : {false, true}) {
    for (std::optional<double> cf : {std::optional<double>(), std::optional<double>(0.75)}) {
      if (pad && !cf) continue;  // padding needs a capacity
      const RandomRouting r = random_routing(T, K, E, rng);
      const CapacityOptions opt = capacity_options(cf, DropPolicy::probs, pad);
      const int64_t C = expert_capacity(opt, T, K, E);
      Tensor kept = apply_capacity(ctx, opt, r.expert_TK, r.weight_TK, E, C);
      const Permutation p = make_permutation(ctx, r.expert_TK, kept, E, C, pad);
      const NaiveLayout want = naive_layout(r.expert_TK, kept, E, pad ? C : 0);
      SCOPED_TRACE(::testing::Message() << "pad " << pad << " C " << C);
      ASSERT_EQ(p.num_rows(), int64_t(want.token.size()));
      for (int64_t n = 0; n < p.num_rows(); ++n) {
        EXPECT_EQ(p.row_token_N.i32()[n], want.token[n]) << "row " << n;
        EXPECT_EQ(p.row_slot_N.i32()[n], want.slot[n]) << "row " << n;
      }
      // row_of_TK inverts the row maps; dropped slots are −1.
      int64_t drops = 0;
      for (int64_t i = 0; i < T * K; ++i) {
        const int32_t row = p.row_of_TK.i32()[i];
        if (!kept.data<uint8_t>()[i]) {
          EXPECT_EQ(row, -1);
          ++drops;
          continue;
        }
        ASSERT_GE(row, 0);
        EXPECT_EQ(p.row_token_N.i32()[row], i / K);
        EXPECT_EQ(p.row_slot_N.i32()[row], i % K);
      }
      std::vector<int64_t> hist(E, 0);
      for (int64_t i = 0; i < T * K; ++i) ++hist[r.expert_TK.i32()[i]];
      EXPECT_EQ(p.routed_per_expert, hist);
      int64_t rows = 0;
      for (int64_t e = 0; e < E; ++e) {
        rows += p.rows_per_expert[e];
        if (pad) {
          EXPECT_EQ(p.rows_per_expert[e], C) << "expert " << e;
        }
      }
      EXPECT_EQ(rows, p.num_rows());
      if (!pad) {
        EXPECT_EQ(rows, T * K - drops);
      }
      if (cf) {
        EXPECT_GT(drops, 0) << "capacity 0.75 must drop something";
      }
    }
  }
}

// Permuted buffer with drops and padding, for the identities below.
struct Routed {
  RandomRouting r;
  Tensor kept;
  Permutation perm;
};
Routed routed_setup(int64_t T, int64_t K, int64_t E, std::mt19937& rng, bool pad) {
  Routed s{random_routing(T, K, E, rng), Tensor(), Permutation()};
  const CapacityOptions opt = capacity_options(0.8, DropPolicy::position, pad);
  const int64_t C = expert_capacity(opt, T, K, E);
  s.kept = apply_capacity(ctx, opt, s.r.expert_TK, s.r.weight_TK, E, C);
  s.perm = make_permutation(ctx, s.r.expert_TK, s.kept, E, C, pad);
  return s;
}

TEST(MoePermutation, UnpermuteOfPermuteScalesEachTokenByItsKeptWeight) {
  std::mt19937 rng(testing::test_seed(57));
  const int64_t T = 40, K = 3, E = 6, D = 20;
  for (bool pad : {false, true}) {
    const Routed s = routed_setup(T, K, E, rng, pad);
    Tensor x = random_tensor({T, D}, rng);
    Tensor x_ND = permute_rows(ctx, x, s.perm);
    for (int64_t n = 0; n < s.perm.num_rows(); ++n) {
      const int32_t t = s.perm.row_token_N.i32()[n];
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(x_ND.f32()[n * D + d], t < 0 ? 0.0f : x.f32()[t * D + d]);
    }
    Tensor out = unpermute_rows(ctx, x_ND, s.perm, s.r.weight_TK, T);
    int64_t zero_tokens = 0;
    for (int64_t t = 0; t < T; ++t) {
      double w = 0;
      for (int64_t j = 0; j < K; ++j) w += s.kept.data<uint8_t>()[t * K + j] ? s.r.weight_TK.f32()[t * K + j] : 0.0f;
      zero_tokens += w == 0;
      // fp32 sum of ≤ 3 products: a few ulp.
      for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(out.f32()[t * D + d], w * x.f32()[t * D + d], 1e-6 * (1 + std::abs(x.f32()[t * D + d])));
    }
    EXPECT_LT(zero_tokens, T);
  }
}

double dot_d(const Tensor& a, const Tensor& b) { return testing::dot(a, b); }
// Σ |a_i·b_i|: the scale of a dot product's rounding (a fresh draw can make the
// dot itself cancel to 1e-3 of it, so a tolerance relative to the dot fails).
double abs_dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += std::abs(static_cast<double>(a.f32()[i]) * b.f32()[i]);
  return s;
}

TEST(MoePermutation, BackwardPassesAreExactAdjoints) {
  std::mt19937 rng(testing::test_seed(59));
  const int64_t T = 45, K = 2, E = 8, D = 24;
  for (bool pad : {false, true}) {
    const Routed s = routed_setup(T, K, E, rng, pad);
    const int64_t N = s.perm.num_rows();
    // permute: <permute(x), g> = <x, permute_backward(g)>; backward accumulates.
    Tensor x = random_tensor({T, D}, rng), g_ND = random_tensor({N, D}, rng);
    Tensor base = random_tensor({T, D}, rng), dx = Tensor::empty({T, D}, DType::f32, MemCategory::grad);
    dx.copy_from(base);
    permute_rows_backward(ctx, g_ND, s.perm, dx);
    for (int64_t i = 0; i < T * D; ++i) dx.f32()[i] -= base.f32()[i];
    const double lhs = dot_d(permute_rows(ctx, x, s.perm), g_ND), rhs = dot_d(x, dx);
    // fp32 row sums of ≤ K terms, accumulated onto base and differenced: a few
    // ulp of |dx| + |base| per element, so 1e-6 of the dot's absolute scale.
    EXPECT_NEAR(lhs, rhs, 1e-6 * (abs_dot(x, dx) + abs_dot(x, base)));
    EXPECT_GT(std::abs(lhs), 1e-3);

    // unpermute is bilinear in (y, p): <unpermute(y, p), g> = <y, dy> = Σ p·dweight.
    Tensor y = random_tensor({N, D}, rng), g_TD = random_tensor({T, D}, rng);
    Tensor dy = Tensor::empty({N, D}, DType::f32, MemCategory::grad), dw;
    std::fill(dy.f32(), dy.f32() + N * D, 7.0f);  // must be overwritten, padding included
    unpermute_rows_backward(ctx, g_TD, y, s.perm, s.r.weight_TK, dy, dw);
    const Tensor unpermuted = unpermute_rows(ctx, y, s.perm, s.r.weight_TK, T);
    const double f = dot_d(unpermuted, g_TD);
    // Each side: fp32 products and sums of ≤ K terms (a few ulp each), dotted
    // in fp64; 1e-6 of the absolute scale Σ|y·dy| (or Σ|p·dw|, Σ|out·g|).
    EXPECT_NEAR(dot_d(y, dy), f, 1e-6 * (abs_dot(y, dy) + abs_dot(unpermuted, g_TD)));
    EXPECT_NEAR(dot_d(s.r.weight_TK, dw), f, 1e-6 * (abs_dot(s.r.weight_TK, dw) + abs_dot(unpermuted, g_TD)));
    EXPECT_GT(std::abs(f), 1e-3);
    for (int64_t n = 0; n < N; ++n) {
      if (s.perm.row_token_N.i32()[n] >= 0) continue;
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dy.f32()[n * D + d], 0.0f) << "padding row " << n;
    }
    for (int64_t i = 0; i < T * K; ++i) {
      const int32_t row = s.perm.row_of_TK.i32()[i];
      if (row < 0) {
        EXPECT_EQ(dw.f32()[i], 0.0f) << "dropped slot " << i;
        continue;
      }
      double want = 0;  // dweight = <g_t, y_row>, directly
      for (int64_t d = 0; d < D; ++d) want += double(g_TD.f32()[(i / K) * D + d]) * y.f32()[row * D + d];
      EXPECT_NEAR(dw.f32()[i], want, 1e-5 * (1 + std::abs(want)));
    }
  }
}

// ------------------------------------------------------------ cost at bench sizes

// Best wall time of fn over reps runs, after one warm-up. The minimum, not
// the median: on shared cores (CI, concurrent builds) a descheduled OpenMP
// thread stalls a whole parallel region for a time slice, which says nothing
// about the op's cost.
template <class F>
double best_ms(int reps, F fn) {
  fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return *std::min_element(ms.begin(), ms.end());
}

// The budget: router + permute + unpermute (fwd + bwd) ≤ 25% of a MoE
// layer's fwd + bwd at T = 4096, D = 512, E = 8, k = 2. The expert part is at
// least 9 GEMMs of [T·k, D] × [D, F] (3 forward, 6 backward); F = D = 512 is a
// small expert, so the budget checked here is stricter than the real one.
// Measured on one thread: with more threads than free cores (CI, concurrent
// builds) every parallel region's barrier can wait a whole time slice, and
// the router has four such regions to the GEMM's one. The ops themselves are
// memory-bound and gain less from threads than the GEMMs, so the 1-thread
// ratio understates the real one a little; measured 1-2%, far under 25%.
TEST(MoePermutation, RoutingCostIsSmallNextToExpertGemmsAtBenchSize) {
  const ExecContext one_thread = ExecContext::cpu(1);
  const ExecContext& ctx = one_thread;
  std::mt19937 rng(testing::test_seed(61));
  const int64_t T = 4096, D = 512, E = 8, K = 2, F = 512;
  RouterOptions ro;
  ro.num_experts = E, ro.top_k = K, ro.aux_loss_coeff = 0.01f, ro.z_loss_coeff = 0.001f;
  Tensor x = random_tensor({T, D}, rng), gate = random_tensor({E, D}, rng, 0.02f);
  Tensor dgate = Tensor::zeros({E, D}, DType::f32, MemCategory::grad);
  Tensor dw_TK = random_tensor({T, K}, rng);
  const double router_ms = best_ms(7, [&] {
    RouterSaved saved;
    router_forward(ctx, ro, x, gate, Tensor(), 512, saved);
    router_losses(ro, saved);
    router_backward(ctx, ro, saved, gate, dw_TK, 1.0f, dgate);
  });
  RouterSaved saved;
  const Routing routing = router_forward(ctx, ro, x, gate, Tensor(), 512, saved);
  Tensor dout = random_tensor({T, D}, rng), dx = Tensor::zeros({T, D}, DType::f32, MemCategory::grad);
  const double perm_ms = best_ms(7, [&] {
    const Permutation p = make_permutation(ctx, routing.expert_TK, Tensor(), E, -1, false);
    Tensor x_ND = permute_rows(ctx, x, p);
    Tensor out = unpermute_rows(ctx, x_ND, p, routing.weight_TK, T);
    Tensor dy, dweight;
    unpermute_rows_backward(ctx, dout, x_ND, p, routing.weight_TK, dy, dweight);
    permute_rows_backward(ctx, dy, p, dx);
  });
  Tensor a = random_tensor({T * K, D}, rng), b = random_tensor({F, D}, rng), c = random_tensor({T * K, F}, rng);
  const double gemm_ms = best_ms(5, [&] { gemm(ctx, a, Trans::no, b, Trans::yes, c); });
  std::printf("1 thread: router fwd+bwd %.2f ms, permute+unpermute fwd+bwd %.2f ms, one expert GEMM [%lld x %lld x %lld] %.2f ms\n",
              router_ms, perm_ms, static_cast<long long>(T * K), static_cast<long long>(D),
              static_cast<long long>(F), gemm_ms);
  const double expert_ms = 9 * gemm_ms, routing_ms = router_ms + perm_ms;
  EXPECT_LE(routing_ms, 0.25 * (routing_ms + expert_ms))
      << "routing " << routing_ms << " ms vs expert GEMMs ≥ " << expert_ms << " ms";
}

}  // namespace
}  // namespace origami::moe
