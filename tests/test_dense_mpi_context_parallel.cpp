// Multi-rank tests of context-parallel attention (dense/attention_cp.h), run
// whole by CTest under `mpirun -np N` for N = 1, 2, 4 with cp = N:
//  - the zigzag layout: every position on exactly one rank, equal counts and
//    equal causal work per rank, chunks c and 2·cp−1−c in that order (for
//    several cp locally, and across this world's cp group via MPI_Allgather);
//    cp_shard_tokens reads inputs and next-token targets at those positions;
//  - a full sequence, identical on every rank (the job's one test seed), sharded by
//    cp_positions: outputs and dx equal the rows of single-rank
//    attention_module_forward/backward at those positions, and the weight
//    gradients summed over the group equal the single-rank ones;
//  - the communication is one all_gather forward and one reduce_scatter
//    backward of the packed K, V, or under ring attention cp − 1 sends
//    forward and 2·cp − 1 backward of the same block (the volumes
//    engine/plan_comm.cpp books);
//  - ring attention against the single-rank module and against all_gather,
//    and what each keeps and moves through the tracked allocator (the
//    planner's KvMemory);
//  - a null or size-1 group is bitwise the dense module, for either method.
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
#include "kernels/allocator.h"
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

// Generous timeout: 4 ranks share 2 cores in CI. By NCCL's rules: the
// in-flight check (comm/in_flight_check.h) and messages paired by order.
constexpr comm::CommOptions kOptions{.timeout_s = 30.0, .check_in_flight = true, .p2p_by_order = true};
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
        const dense::CpPositions made = dense::cp_positions(ctx, S, cp, r);
        // What cp_attention_forward checks under a group, on the host.
        EXPECT_TRUE(made.is_zigzag_shard(S, cp, r));
        if (cp > 1) {
          EXPECT_FALSE(made.is_zigzag_shard(S, cp, (r + 1) % cp)) << "another rank's shard";
        }
        EXPECT_FALSE(made.is_zigzag_shard(2 * S, cp, r)) << "another sequence length";
        EXPECT_FALSE(made.is_zigzag_shard(S, 2 * cp, r)) << "another group size";
        const Tensor& pos = made.tensor();
        EXPECT_FALSE(dense::CpPositions(pos).is_zigzag_shard(S, cp, r)) << "the same values, not made as a shard";
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
  const Tensor pos = dense::cp_positions(ctx, S, cp.size(), cp.rank()).tensor();
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
      const Tensor want_pos = dense::cp_positions(ctx, S, cp, r).tensor();
      const Tensor& got_pos = t.pos_S.tensor();
      const int64_t Sl = S / cp;
      EXPECT_TRUE(t.pos_S.is_zigzag_shard(S, cp, r));
      ASSERT_EQ(got_pos.numel(), Sl);
      ASSERT_EQ(t.ids_T.numel(), B * Sl);
      ASSERT_EQ(t.targets_T.numel(), B * Sl);
      for (int64_t i = 0; i < Sl; ++i) ASSERT_EQ(got_pos.i32()[i], want_pos.i32()[i]);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Sl; ++i) {
          const int32_t p = got_pos.i32()[i];
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

const char* method_name(dense::CpComm m) { return m == dense::CpComm::ring ? "ring" : "all_gather"; }

// One rank's outputs of a cp attention forward and backward, its weight
// gradients summed over the group.
struct CpRun {
  Tensor y, dx;
  dense::AttentionWeights g;
  dense::CpPositions pos;
};

// The sends, gathers and scatters each method makes (attention_cp.h), with
// kv_floats the packed K, V of one rank: all_gather one all_gather forward,
// one reduce_scatter backward; ring n − 1 sends forward, n − 1 K, V and n
// dK, dV sends backward, every one of kv_floats.
void expect_comm(comm::Communicator& cp, dense::CpComm method, int64_t kv_floats, bool backward) {
  using comm::CommOp;
  const int n = cp.size();
  const int64_t block = kv_floats * static_cast<int64_t>(sizeof(float));
  if (method == dense::CpComm::all_gather || n == 1) {
    EXPECT_EQ(cp.stats(CommOp::all_gather).calls, n > 1 ? 1 : 0);
    EXPECT_EQ(cp.stats(CommOp::all_gather).bytes, n > 1 ? comm::ring_bytes::all_gather(kv_floats, sizeof(float), n) : 0);
    EXPECT_EQ(cp.stats(CommOp::reduce_scatter).calls, n > 1 && backward ? 1 : 0);
    EXPECT_EQ(cp.stats(CommOp::reduce_scatter).bytes,
              n > 1 && backward ? comm::ring_bytes::reduce_scatter(kv_floats, sizeof(float), n) : 0);
  } else {
    const int64_t sends = (n - 1) + (backward ? (n - 1) + n : 0);
    EXPECT_EQ(cp.stats(CommOp::send).calls, sends);
    EXPECT_EQ(cp.stats(CommOp::send).bytes, sends * block);
    EXPECT_EQ(cp.stats(CommOp::recv).calls, sends) << "every send has its receive on this rank's other side";
  }
  EXPECT_EQ(cp.total_bytes(), cp.stats(CommOp::all_gather).bytes + cp.stats(CommOp::reduce_scatter).bytes +
                                  cp.stats(CommOp::send).bytes)
      << "no other communication";
}

CpRun check_against_single_rank(const Case& c, uint32_t seed, dense::CpComm method) {
  comm::Communicator& cp = cp_group();
  const int n = cp.size();
  const std::string at = std::string(method_name(method)) + " B " + std::to_string(c.B) + " S " +
                         std::to_string(c.S) + " cp " + std::to_string(n) + " [rank " + std::to_string(world_rank()) +
                         "]";
  SCOPED_TRACE(at);
  // Identical on every rank: the whole model input and output gradient.
  std::mt19937 rng(testing::test_seed(seed));
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  const dense::AttentionWeights w = random_weights(rng);
  const Tensor x = random_tensor({c.B * c.S, kD}, rng);
  const Tensor dy = random_tensor({c.B * c.S, kD}, rng);

  dense::AttentionSaved ref_saved;
  const Tensor pos_full = iota(c.S);
  const Tensor y_ref = dense::attention_module_forward(ctx, opt, w, x, c.B, pos_full, ref_saved);
  dense::AttentionWeights g_ref = zero_grads(w);
  const Tensor dx_ref = dense::attention_module_backward(ctx, opt, w, ref_saved, dy, g_ref);

  CpRun run;
  run.pos = dense::cp_positions(ctx, c.S, n, cp.rank());
  const Tensor& pos = run.pos.tensor();
  const Tensor x_local = take_rows(x, c.B, pos), dy_local = take_rows(dy, c.B, pos);
  cp.reset_stats();
  dense::CpAttentionSaved saved;
  run.y = dense::cp_attention_forward(ctx, opt, w, x_local, c.B, run.pos, &cp, method, saved);
  const int64_t kv_floats = 2 * c.B * (c.S / n) * kHkv * kHd;  // packed K, V of one rank
  expect_comm(cp, method, kv_floats, false);
  run.g = zero_grads(w);
  run.dx = dense::cp_attention_backward(ctx, opt, w, saved, dy_local, &cp, run.g);
  expect_comm(cp, method, kv_floats, true);

  // 1e-5 of the tensor's scale: fp32 reassociation only (measured worst is
  // printed by rank 0: <= 1.4e-6 for both methods at cp 2 and 4), far below the O(1) error of
  // a misplaced key, a block merged with the wrong weight or a missed share
  // of dK.
  constexpr double kRtol = 1e-5;
  double worst = 0;
  worst = std::max(worst, expect_close(run.y, take_rows(y_ref, c.B, pos), kRtol, "y", &pos));
  worst = std::max(worst, expect_close(run.dx, take_rows(dx_ref, c.B, pos), kRtol, "dx", &pos));
  Tensor* parts[4] = {&run.g.wq, &run.g.wk, &run.g.wv, &run.g.wo};
  const Tensor* refs[4] = {&g_ref.wq, &g_ref.wk, &g_ref.wv, &g_ref.wo};
  const char* names[4] = {"dWq (summed over cp)", "dWk (summed over cp)", "dWv (summed over cp)",
                          "dWo (summed over cp)"};
  for (int i = 0; i < 4; ++i) {
    all_sum(*parts[i]);
    worst = std::max(worst, expect_close(*parts[i], *refs[i], kRtol, names[i]));
  }
  worst = all_max(worst);
  if (world_rank() == 0) std::printf("[          ] %s: worst |cp - single| / scale = %.2e\n", at.c_str(), worst);
  return run;
}

// The brief's shape: S % (2·cp) == 0 for cp up to 4, keys in one tile.
TEST(ContextParallel, MatchesSingleRankAttentionGqa) { check_against_single_rank({2, 16}, 1234, dense::CpComm::all_gather); }

// Past one 128-key tile with a partial last tile (264 = 2·128 + 8), chunks of
// 33 that straddle tile boundaries: exercises the kernel's causal tile skipping
// with zigzag query positions.
TEST(ContextParallel, MatchesSingleRankAcrossKeyTiles) { check_against_single_rank({1, 264}, 99, dense::CpComm::all_gather); }

// Ring attention (attention_ring.h) on the same inputs: per block, rows that
// see none of its keys (lse −inf) and blocks whose later chunk is masked;
// across tiles, blocks of 66 keys (cp 4) or 132 (cp 2) that straddle tiles.
TEST(ContextParallel, RingMatchesSingleRankAttentionGqa) { check_against_single_rank({2, 16}, 1234, dense::CpComm::ring); }
TEST(ContextParallel, RingMatchesSingleRankAcrossKeyTiles) { check_against_single_rank({1, 264}, 99, dense::CpComm::ring); }

// Ring against all_gather on fresh inputs: the same attention, summed in
// another order (per-block partials merged by log-sum-exp, dK, dV summed rank
// by rank along the ring instead of by reduce_scatter). 5e-6 of each
// tensor's scale: both differ from the single-rank module by fp32
// reassociation alone, measured <= 1.4e-6 of the scale at cp 2 and 4
// (printed), far below a wrong merge weight or a lost dK share.
TEST(ContextParallel, RingMatchesAllGather) {
  for (const Case& c : {Case{3, 40}, Case{1, 264}}) {
    const CpRun a = check_against_single_rank(c, 777 + static_cast<uint32_t>(c.S), dense::CpComm::all_gather);
    const CpRun r = check_against_single_rank(c, 777 + static_cast<uint32_t>(c.S), dense::CpComm::ring);
    constexpr double kRtol = 5e-6;
    double worst = 0;
    worst = std::max(worst, expect_close(r.y, a.y, kRtol, "y: ring vs all_gather", &r.pos.tensor()));
    worst = std::max(worst, expect_close(r.dx, a.dx, kRtol, "dx: ring vs all_gather", &r.pos.tensor()));
    worst = std::max(worst, expect_close(r.g.wq, a.g.wq, kRtol, "dWq: ring vs all_gather"));
    worst = std::max(worst, expect_close(r.g.wk, a.g.wk, kRtol, "dWk: ring vs all_gather"));
    worst = std::max(worst, expect_close(r.g.wv, a.g.wv, kRtol, "dWv: ring vs all_gather"));
    worst = std::max(worst, expect_close(r.g.wo, a.g.wo, kRtol, "dWo: ring vs all_gather"));
    worst = all_max(worst);
    if (world_rank() == 0)
      std::printf("[          ] B %lld S %lld cp %d: worst |ring - all_gather| / scale = %.2e\n",
                  static_cast<long long>(c.B), static_cast<long long>(c.S), cp_group().size(), worst);
  }
}

// What each method keeps and moves, through the tracked allocator's ledger,
// against engine/plan.h's KvMemory (U = one rank's packed K, V): after
// forward the ring holds (cp − 1)·U + S·4 bytes less activation (the
// gathered K, V and their positions); the comm category peaks at
// (min(2, cp−1) + 3)·U for the ring (blocks in flight, three dK, dV blocks)
// and (cp + 1)·U for all_gather (its wire buffers); and the ring's peak of
// everything over forward and backward is the lower one.
TEST(ContextParallel, RingKeepsLessAndPeaksLower) {
  comm::Communicator& cp = cp_group();
  const int n = cp.size();
  if (n == 1) GTEST_SKIP() << "one rank: both methods are the dense module";
  const int64_t B = 2, S = 64 * n;
  std::mt19937 rng(testing::test_seed(31));
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  const dense::AttentionWeights w = random_weights(rng);
  const dense::CpPositions pos = dense::cp_positions(ctx, S, n, cp.rank());
  const Tensor x = random_tensor({B * S / n, kD}, rng), dy = random_tensor({B * S / n, kD}, rng);
  const int64_t U = 2 * B * (S / n) * kHkv * kHd * static_cast<int64_t>(sizeof(float));
  TrackedAllocator& mem = TrackedAllocator::host();
  const auto act = static_cast<size_t>(MemCategory::activation), wire = static_cast<size_t>(MemCategory::comm);
  struct Measured {
    int64_t saved = 0, comm_peak = 0, peak = 0;
  };
  auto measure = [&](dense::CpComm method) {
    Measured m;
    const LedgerSnapshot before = mem.snapshot();
    mem.reset_peaks();
    {
      dense::CpAttentionSaved saved;
      const Tensor y = dense::cp_attention_forward(ctx, opt, w, x, B, pos, &cp, method, saved);
      m.saved = mem.snapshot().current[act] - before.current[act] - y.nbytes();
      dense::AttentionWeights g = zero_grads(w);
      const Tensor dx = dense::cp_attention_backward(ctx, opt, w, saved, dy, &cp, g);
    }
    const LedgerSnapshot after = mem.snapshot();
    m.comm_peak = after.peak[wire] - before.current[wire];
    m.peak = after.peak_total - before.current_total;
    return m;
  };
  const Measured a = measure(dense::CpComm::all_gather), r = measure(dense::CpComm::ring);
  EXPECT_EQ(a.saved - r.saved, (n - 1) * U + S * 4) << "gathered K, V and their positions";
  EXPECT_EQ(r.comm_peak, (std::min(2, n - 1) + 3) * U);
  EXPECT_EQ(a.comm_peak, (n + 1) * U);
  EXPECT_LT(r.peak, a.peak);
  if (world_rank() == 0)
    std::printf("[          ] cp %d, U = %lld B: saved all_gather %lld ring %lld; comm peak all_gather %lld ring %lld; "
                "peak of everything all_gather %lld ring %lld\n",
                n, static_cast<long long>(U), static_cast<long long>(a.saved), static_cast<long long>(r.saved),
                static_cast<long long>(a.comm_peak), static_cast<long long>(r.comm_peak),
                static_cast<long long>(a.peak), static_cast<long long>(r.peak));
}

// ---------------------------------------------------------------------------
// Without a group: the dense module, bitwise (positions need not be zigzag).

TEST(ContextParallel, NullOrSizeOneGroupIsTheDenseModuleBitwise) {
  comm::Communicator& one = setups()->cp_one[GroupKind::cp];
  ASSERT_EQ(one.size(), 1);
  const int64_t B = 2, S = 13;
  std::mt19937 rng(testing::test_seed(55));
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  const dense::AttentionWeights w = random_weights(rng);
  const Tensor x = random_tensor({B * S, kD}, rng), dy = random_tensor({B * S, kD}, rng);
  const Tensor pos = iota(S, 37);  // offset positions: RoPE far from zero

  dense::AttentionSaved ref_saved;
  const Tensor y_ref = dense::attention_module_forward(ctx, opt, w, x, B, pos, ref_saved);
  dense::AttentionWeights g_ref = zero_grads(w);
  const Tensor dx_ref = dense::attention_module_backward(ctx, opt, w, ref_saved, dy, g_ref);

  for (comm::Communicator* cp : {static_cast<comm::Communicator*>(nullptr), &one})
    for (dense::CpComm method : {dense::CpComm::all_gather, dense::CpComm::ring}) {
      SCOPED_TRACE(std::string(cp ? "size-1 group, " : "null group, ") + method_name(method));
      one.reset_stats();
      dense::CpAttentionSaved saved;
      const Tensor y = dense::cp_attention_forward(ctx, opt, w, x, B, dense::CpPositions(pos), cp, method, saved);
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
