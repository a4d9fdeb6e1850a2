// Multi-rank tests of context-parallel attention (dense/attention_cp.h), run
// whole by CTest under `mpirun -np N` for N = 1, 2, 4 with cp = N:
//  - the zigzag layout: every position on exactly one rank, equal counts and
//    equal causal work per rank, chunks c and 2·cp−1−c in that order (for
//    several cp locally, and across this world's cp group via MPI_Allgather);
//    cp_shard_tokens reads inputs and next-token targets at those positions;
//  - a full sequence, identical on every rank (fixed seed), sharded by
//    cp_positions: outputs and dx equal the rows of single-rank
//    attention_module_forward/backward at those positions, and the weight
//    gradients summed over the group equal the single-rank ones;
//  - the communication is one all_gather forward and one reduce_scatter
//    backward of the packed K, V (the volumes engine/plan.cpp books);
//  - a null or size-1 group is bitwise the dense module.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/groups.h"
#include "dense/attention.h"
#include "dense/attention_cp.h"
#include "grad_check.h"
#include "kernels/threads.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using comm::GroupKind;
using testing::random_tensor;

using testing::world_rank;
using testing::world_size;

constexpr comm::CommOptions kOptions{30.0};  // generous: 4 ranks share 2 cores in CI
constexpr int64_t kHq = 4, kHkv = 2, kHd = 8, kD = kHq * kHd;

// Groups with cp = W (the layout under test) and with cp = 1 (a size-1 cp
// group at every W), built once per binary; main() frees them before
// MPI_Finalize.
struct Setups {
  comm::Groups cp_world, cp_one;
};
std::unique_ptr<Setups>& setups() {
  static std::unique_ptr<Setups> s;
  if (!s) {
    comm::LayoutOptions all, none;
    all.cp = world_size();
    comm::Groups a = comm::Groups::create(comm::Layout(world_size(), all), MPI_COMM_WORLD, comm::Backend::mpi,
                                          kOptions);
    comm::Groups b = comm::Groups::create(comm::Layout(world_size(), none), MPI_COMM_WORLD, comm::Backend::mpi,
                                          kOptions);
    s = std::make_unique<Setups>(Setups{std::move(a), std::move(b)});
  }
  return s;
}
comm::Communicator& cp_group() { return setups()->cp_world[GroupKind::cp]; }

Tensor zeros_like(const Tensor& t) { return Tensor::zeros(t.shape(), DType::f32, MemCategory::grad); }
dense::AttentionWeights zero_grads(const dense::AttentionWeights& w) {
  return {zeros_like(w.wq), zeros_like(w.wk), zeros_like(w.wv), zeros_like(w.wo)};
}
dense::AttentionWeights random_weights(std::mt19937& rng) {
  return {random_tensor({kHq * kHd, kD}, rng, 0.3f), random_tensor({kHkv * kHd, kD}, rng, 0.3f),
          random_tensor({kHkv * kHd, kD}, rng, 0.3f), random_tensor({kD, kHq * kHd}, rng, 0.3f)};
}
Tensor iota(int64_t n, int32_t first = 0) {
  Tensor p = Tensor::empty({n}, DType::i32, MemCategory::activation);
  for (int64_t i = 0; i < n; ++i) p.i32()[i] = first + static_cast<int32_t>(i);
  return p;
}

// Rows of full [B·S, C] at positions pos (batch-major): [B·|pos|, C].
Tensor take_rows(const Tensor& full, int64_t B, const Tensor& pos) {
  const int64_t S = full.rows() / B, Sl = pos.numel(), C = full.cols();
  Tensor out = Tensor::empty({B * Sl, C}, DType::f32, MemCategory::activation);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sl; ++i)
      std::memcpy(out.f32() + (b * Sl + i) * C, full.f32() + (b * S + pos.i32()[i]) * C, C * sizeof(float));
  return out;
}

void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const int64_t cols = std::max<int64_t>(1, got.cols());
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(got.f32() + i, want.f32() + i, sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": row " << i / cols << " col " << i % cols << " is " << got.f32()[i] << ", want "
                    << want.f32()[i];
      return;
    }
}

// |got − want| ≤ rtol · max|want| elementwise, with the worst element
// reported. The runs differ only in fp32 reassociation (GEMMs over other row
// blocks, dK and dV summed in per-rank parts by reduce_scatter, weight
// gradients summed over ranks), whose error scales with the summands — the
// tensor's magnitude — not with an element that happens to cancel to ~0.
// Returns the worst ratio |got − want| / max|want|.
double expect_close(const Tensor& got, const Tensor& want, double rtol, const std::string& what,
                    const Tensor* row_pos = nullptr) {
  EXPECT_EQ(got.shape(), want.shape()) << what;
  if (got.shape() != want.shape()) return INFINITY;
  double scale = 0, worst = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(double(want.f32()[i])));
  EXPECT_GT(scale, 1e-3) << what << ": reference is (near) zero; the check would be vacuous";
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double e = std::abs(double(got.f32()[i]) - double(want.f32()[i]));
    if (!(e <= worst)) worst = e, at = i;  // NaN lands here too
  }
  const int64_t cols = std::max<int64_t>(1, want.cols()), row = at / cols;
  std::string where = "row " + std::to_string(row);
  if (row_pos) {  // rows are [b][local i]: name the global position
    const int64_t Sl = row_pos->numel();
    where = "batch " + std::to_string(row / Sl) + " position " + std::to_string(row_pos->i32()[row % Sl]);
  }
  EXPECT_LE(worst, rtol * scale) << what << ": " << where << " col " << at % cols << " is " << got.f32()[at]
                                 << ", want " << want.f32()[at] << " (scale " << scale << ")";
  return worst / scale;
}

void all_sum(Tensor& t) {
  MPI_Allreduce(MPI_IN_PLACE, t.f32(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}
double all_max(double x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return x;
}

// ---------------------------------------------------------------------------
// The zigzag layout.

TEST(ContextParallel, PositionsPartitionTheSequenceWithEqualCausalWork) {
  for (int64_t cp : {1, 2, 3, 4, 8})
    for (int64_t S : {2 * cp, 6 * cp, 64 * cp}) {
      SCOPED_TRACE("cp " + std::to_string(cp) + " S " + std::to_string(S));
      const int64_t C = S / (2 * cp);
      std::vector<int> seen(static_cast<size_t>(S), 0);
      int64_t work0 = -1;
      for (int64_t r = 0; r < cp; ++r) {
        const Tensor pos = dense::cp_positions(ctx, S, cp, r);
        ASSERT_EQ(pos.numel(), S / cp);
        int64_t work = 0;  // causal (query, key) pairs of this rank's queries
        for (int64_t i = 0; i < pos.numel(); ++i) {
          const int32_t p = pos.i32()[i];
          ASSERT_TRUE(p >= 0 && p < S) << "position " << p;
          ++seen[static_cast<size_t>(p)];
          work += p + 1;
          if (i > 0) {
            EXPECT_LT(pos.i32()[i - 1], p) << "local positions ascend";
          }
          const int64_t chunk = i < C ? r : 2 * cp - 1 - r;
          EXPECT_EQ(p, chunk * C + i % C) << "rank " << r << " row " << i;
        }
        if (work0 < 0) work0 = work;
        EXPECT_EQ(work, work0) << "rank " << r << " does other causal work than rank 0";
      }
      for (int64_t p = 0; p < S; ++p) EXPECT_EQ(seen[static_cast<size_t>(p)], 1) << "position " << p;
    }
}

TEST(ContextParallel, GroupRanksTogetherHoldEveryPositionOnce) {
  comm::Communicator& cp = cp_group();
  const int64_t S = 16 * cp.size();
  const Tensor pos = dense::cp_positions(ctx, S, cp.size(), cp.rank());
  ASSERT_EQ(pos.numel(), S / cp.size());
  std::vector<int32_t> all(static_cast<size_t>(S));
  cp.all_gather(std::span<const int32_t>(pos.i32(), pos.numel()), std::span<int32_t>(all));
  std::sort(all.begin(), all.end());
  for (int64_t p = 0; p < S; ++p) ASSERT_EQ(all[static_cast<size_t>(p)], p);
}

TEST(ContextParallel, ShardTokensReadsInputsAndNextTokensAtTheRanksPositions) {
  const int64_t B = 3, S = 24;
  Tensor windows = Tensor::empty({B, S + 1}, DType::i32, MemCategory::activation);
  for (int64_t b = 0; b < B; ++b)  // token = 1000·b + position: a misread names itself
    for (int64_t s = 0; s <= S; ++s) windows.i32()[b * (S + 1) + s] = static_cast<int32_t>(1000 * b + s);
  for (int64_t cp : {1, 2, 3, 4}) {
    std::vector<int> input_seen(static_cast<size_t>(B * S), 0);
    for (int64_t r = 0; r < cp; ++r) {
      const dense::CpTokens t = dense::cp_shard_tokens(ctx, windows, cp, r);
      const Tensor want_pos = dense::cp_positions(ctx, S, cp, r);
      const int64_t Sl = S / cp;
      ASSERT_EQ(t.pos_S.numel(), Sl);
      ASSERT_EQ(t.ids_T.numel(), B * Sl);
      ASSERT_EQ(t.targets_T.numel(), B * Sl);
      for (int64_t i = 0; i < Sl; ++i) ASSERT_EQ(t.pos_S.i32()[i], want_pos.i32()[i]);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Sl; ++i) {
          const int32_t p = t.pos_S.i32()[i];
          EXPECT_EQ(t.ids_T.i32()[b * Sl + i], 1000 * b + p) << "cp " << cp << " rank " << r;
          EXPECT_EQ(t.targets_T.i32()[b * Sl + i], 1000 * b + p + 1) << "cp " << cp << " rank " << r;
          ++input_seen[static_cast<size_t>(b * S + p)];
        }
    }
    for (int64_t i = 0; i < B * S; ++i) EXPECT_EQ(input_seen[static_cast<size_t>(i)], 1) << "cp " << cp;
  }
}

// ---------------------------------------------------------------------------
// Attention over the cp group against the single-rank module.

struct Case {
  int64_t B, S;
};

void check_against_single_rank(const Case& c, uint32_t seed) {
  comm::Communicator& cp = cp_group();
  const int n = cp.size();
  const std::string at = "B " + std::to_string(c.B) + " S " + std::to_string(c.S) + " cp " + std::to_string(n) +
                         " [rank " + std::to_string(world_rank()) + "]";
  SCOPED_TRACE(at);
  // Identical on every rank: the whole model input and output gradient.
  std::mt19937 rng(seed);
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  const dense::AttentionWeights w = random_weights(rng);
  const Tensor x = random_tensor({c.B * c.S, kD}, rng);
  const Tensor dy = random_tensor({c.B * c.S, kD}, rng);

  dense::AttentionSaved ref_saved;
  const Tensor pos_full = iota(c.S);
  const Tensor y_ref = dense::attention_module_forward(ctx, opt, w, x, c.B, pos_full, ref_saved);
  dense::AttentionWeights g_ref = zero_grads(w);
  const Tensor dx_ref = dense::attention_module_backward(ctx, opt, w, ref_saved, dy, g_ref);

  const Tensor pos = dense::cp_positions(ctx, c.S, n, cp.rank());
  const Tensor x_local = take_rows(x, c.B, pos), dy_local = take_rows(dy, c.B, pos);
  cp.reset_stats();
  dense::CpAttentionSaved saved;
  const Tensor y = dense::cp_attention_forward(ctx, opt, w, x_local, c.B, pos, &cp, saved);
  const int64_t kv_floats = 2 * c.B * (c.S / n) * kHkv * kHd;  // packed K, V of one rank
  EXPECT_EQ(cp.stats(comm::CommOp::all_gather).calls, n > 1 ? 1 : 0);
  EXPECT_EQ(cp.stats(comm::CommOp::all_gather).bytes,
            n > 1 ? comm::ring_bytes::all_gather(kv_floats, sizeof(float), n) : 0);
  dense::AttentionWeights g = zero_grads(w);
  const Tensor dx = dense::cp_attention_backward(ctx, opt, w, saved, dy_local, &cp, g);
  EXPECT_EQ(cp.stats(comm::CommOp::reduce_scatter).calls, n > 1 ? 1 : 0);
  EXPECT_EQ(cp.stats(comm::CommOp::reduce_scatter).bytes,
            n > 1 ? comm::ring_bytes::reduce_scatter(kv_floats, sizeof(float), n) : 0);
  EXPECT_EQ(cp.total_bytes(), cp.stats(comm::CommOp::all_gather).bytes + cp.stats(comm::CommOp::reduce_scatter).bytes)
      << "no other communication";

  // 1e-5 of the tensor's scale: fp32 reassociation only (measured worst is
  // printed by rank 0), far below the O(1) error of a misplaced key or a
  // missed share of dK.
  constexpr double kRtol = 1e-5;
  double worst = 0;
  worst = std::max(worst, expect_close(y, take_rows(y_ref, c.B, pos), kRtol, "y", &pos));
  worst = std::max(worst, expect_close(dx, take_rows(dx_ref, c.B, pos), kRtol, "dx", &pos));
  Tensor* parts[4] = {&g.wq, &g.wk, &g.wv, &g.wo};
  const Tensor* refs[4] = {&g_ref.wq, &g_ref.wk, &g_ref.wv, &g_ref.wo};
  const char* names[4] = {"dWq (summed over cp)", "dWk (summed over cp)", "dWv (summed over cp)",
                          "dWo (summed over cp)"};
  for (int i = 0; i < 4; ++i) {
    all_sum(*parts[i]);
    worst = std::max(worst, expect_close(*parts[i], *refs[i], kRtol, names[i]));
  }
  worst = all_max(worst);
  if (world_rank() == 0) std::printf("[          ] %s: worst |cp - single| / scale = %.2e\n", at.c_str(), worst);
}

// The brief's shape: S % (2·cp) == 0 for cp up to 4, keys in one tile.
TEST(ContextParallel, MatchesSingleRankAttentionGqa) { check_against_single_rank({2, 16}, 1234); }

// Past one 128-key tile with a partial last tile (264 = 2·128 + 8), chunks of
// 33 that straddle tile boundaries: exercises the kernel's causal tile skipping
// with zigzag query positions.
TEST(ContextParallel, MatchesSingleRankAcrossKeyTiles) { check_against_single_rank({1, 264}, 99); }

// ---------------------------------------------------------------------------
// Without a group: the dense module, bitwise (positions need not be zigzag).

TEST(ContextParallel, NullOrSizeOneGroupIsTheDenseModuleBitwise) {
  comm::Communicator& one = setups()->cp_one[GroupKind::cp];
  ASSERT_EQ(one.size(), 1);
  const int64_t B = 2, S = 13;
  std::mt19937 rng(55);
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  const dense::AttentionWeights w = random_weights(rng);
  const Tensor x = random_tensor({B * S, kD}, rng), dy = random_tensor({B * S, kD}, rng);
  const Tensor pos = iota(S, 37);  // offset positions: RoPE far from zero

  dense::AttentionSaved ref_saved;
  const Tensor y_ref = dense::attention_module_forward(ctx, opt, w, x, B, pos, ref_saved);
  dense::AttentionWeights g_ref = zero_grads(w);
  const Tensor dx_ref = dense::attention_module_backward(ctx, opt, w, ref_saved, dy, g_ref);

  for (comm::Communicator* cp : {static_cast<comm::Communicator*>(nullptr), &one}) {
    SCOPED_TRACE(cp ? "size-1 group" : "null group");
    one.reset_stats();
    dense::CpAttentionSaved saved;
    const Tensor y = dense::cp_attention_forward(ctx, opt, w, x, B, pos, cp, saved);
    dense::AttentionWeights g = zero_grads(w);
    const Tensor dx = dense::cp_attention_backward(ctx, opt, w, saved, dy, cp, g);
    EXPECT_EQ(one.total_bytes(), 0);
    expect_bitwise(y, y_ref, "y");
    expect_bitwise(dx, dx_ref, "dx");
    expect_bitwise(g.wq, g_ref.wq, "dWq");
    expect_bitwise(g.wk, g_ref.wk, "dWk");
    expect_bitwise(g.wv, g_ref.wv, "dWv");
    expect_bitwise(g.wo, g_ref.wo, "dWo");
  }
}


}  // namespace
}  // namespace origami

int main(int argc, char** argv) {
  return origami::testing::run_mpi_tests(argc, argv, 0, [] { origami::setups().reset(); });
}
