// Layout-independent init: Philox4x32-10 against Random123's published
// known-answer vectors, the shard property (two shards generated apart equal
// the whole, bitwise), independence from the thread count, distinct streams
// per name and seed, and sample moments of init_normal.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "kernels/init.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

Tensor make(int64_t n) { return Tensor::empty({n}, DType::f32, MemCategory::param); }

TEST(Philox, MatchesRandom123KnownAnswers) {
  // Random123 v1.14 tests/kat_vectors, "philox4x32 10" lines: counter, key, output.
  using A4 = std::array<uint32_t, 4>;
  using A2 = std::array<uint32_t, 2>;
  EXPECT_EQ(philox4x32_10(A4{0, 0, 0, 0}, A2{0, 0}), (A4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10(A4{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, A2{0xffffffff, 0xffffffff}),
            (A4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10(A4{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, A2{0xa4093822, 0x299f31d0}),
            (A4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(NameHash, IsFnv1a64) {
  EXPECT_EQ(name_hash(""), 0xcbf29ce484222325ull);  // FNV offset basis
  EXPECT_EQ(name_hash("a"), 0xaf63dc4c8601ec8cull);  // published FNV-1a 64 test value
  EXPECT_NE(name_hash("model.layers.0.mlp.up_proj.weight"), name_hash("model.layers.1.mlp.up_proj.weight"));
}

TEST(InitNormal, ShardsGeneratedApartEqualTheWholeBitwise) {
  const int64_t n = 10007, split = 4099, base = 123456789012;  // offsets past 2^32 exercise the high counter word
  const char* name = "model.layers.3.self_attn.q_proj.weight";
  Tensor whole = make(n), lo = make(split), hi = make(n - split);
  init_normal(ctx, whole, 42, name, base, 0.02f);
  init_normal(ctx, hi, 42, name, base + split, 0.02f);  // the later shard first: order must not matter
  init_normal(ctx, lo, 42, name, base, 0.02f);
  for (int64_t i = 0; i < split; ++i) ASSERT_EQ(whole.f32()[i], lo.f32()[i]) << i;
  for (int64_t i = split; i < n; ++i) ASSERT_EQ(whole.f32()[i], hi.f32()[i - split]) << i;
  int64_t nonzero = 0;
  for (int64_t i = 0; i < n; ++i) nonzero += whole.f32()[i] != 0.0f;
  EXPECT_EQ(nonzero, n);
}

TEST(InitNormal, IndependentOfThreadCountAndDistinctPerNameAndSeed) {
  const int64_t n = 5000;
  Tensor a = make(n), b = make(n), other_name = make(n), other_seed = make(n);
  init_normal(ExecContext::cpu(1), a, 7, "w", 0, 1.0f);
  init_normal(ExecContext::cpu(std::max(3, ctx.threads())), b, 7, "w", 0, 1.0f);
  init_normal(ctx, other_name, 7, "v", 0, 1.0f);
  init_normal(ctx, other_seed, 8, "w", 0, 1.0f);
  int64_t same_name = 0, same_seed = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(a.f32()[i], b.f32()[i]) << i;
    same_name += a.f32()[i] == other_name.f32()[i];
    same_seed += a.f32()[i] == other_seed.f32()[i];
  }
  EXPECT_EQ(same_name, 0);
  EXPECT_EQ(same_seed, 0);
}

TEST(InitNormal, SampleMomentsMatchRequestedStd) {
  const int64_t n = 100000;
  const float std = 0.02f;
  Tensor t = make(n);
  init_normal(ctx, t, 1234, "model.embed_tokens.weight", 0, std);
  double s = 0.0, ss = 0.0, s4 = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = t.f32()[i] / static_cast<double>(std);
    s += x;
    ss += x * x;
    s4 += x * x * x * x;
  }
  const double mean = s / n, var = ss / n - mean * mean, kurt = s4 / n;
  // Standard errors for N(0,1), n = 1e5: mean 0.0032, variance 0.0045,
  // fourth moment 0.031. Bounds are ~5 standard errors.
  EXPECT_LT(std::abs(mean), 0.016);
  EXPECT_LT(std::abs(std::sqrt(var) - 1.0), 0.012);
  EXPECT_LT(std::abs(kurt - 3.0), 0.16);
}

TEST(InitConstant, FillsEveryElement) {
  Tensor t = make(1001);
  init_constant(ctx, t, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.f32()[i], 1.0f);
}

}  // namespace
}  // namespace origami
