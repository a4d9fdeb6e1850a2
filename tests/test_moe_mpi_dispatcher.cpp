// Multi-rank property tests of moe::AllToAllDispatcher (moe/token_dispatcher.h),
// run whole by CTest under `mpirun -np N` for N = 1, 2, 4, 8. Every expert
// layout of this world size (EP × ETP × EDP, below) runs with one expert per
// EP rank and with several, over row counts that include empty experts, a rank
// that sends nothing and an EP rank whose experts receive nothing, under the
// contiguous placement and (EP > 1) a strided one (moe/placement.h):
//  - combine(dispatch(x)) == x bitwise (ETP partials: peer 0 only, or halves);
//  - rank-tagged rows reach their expert's placed owner, in the documented
//    order [etp peer][source ep rank][local expert], with segments and every
//    handle count recomputed from an MPI_Allgather of everyone's counts;
//  - combine_backward and dispatch_backward are the adjoints of combine and
//    dispatch (dot products summed over the world);
//  - the whole MoE layer through the dispatcher equals each rank computing it
//    alone with all experts: y, dx, router gradient, summed expert gradients,
//    routing and drop decisions (dropless, capacity 1.0 with both policies,
//    pad_to_capacity), also with a rank of T = 0 tokens and starved experts;
//  - under the strided placement the layer is bitwise the contiguous one: y,
//    dx, router gradient and each expert's gradient wherever it lives.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>

#include "comm/groups.h"
#include "grad_check.h"
#include "kernels/threads.h"
#include "moe/moe_layer.h"
#include "moe/token_dispatcher.h"
#include "moe_dispatcher_fixture.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

using namespace dispatcher_test;

// ---------------------------------------------------------------------------
// The exchange alone.

TEST(MoeMpiDispatcher, CombineOfDispatchIsIdentity) {
  for (const auto& s : setups())
    for (int64_t E : {s->ep, 3 * s->ep})
      for (const moe::ExpertPlacement& placement : placements(E, s->ep))
      for (Pattern p : kPatterns) {
        const std::string at = where(*s, E, pattern_name(p)) + " " + placement_name(placement);
        SCOPED_TRACE(at);
        const AllToAllDispatcher disp = s->dispatcher(E, placement);
        const std::vector<int64_t> counts = my_counts(placement, p, 11);
        std::mt19937 rng(testing::test_seed(77u + static_cast<uint32_t>(world_rank())));
        const Tensor x = random_tensor({sum(counts), kD}, rng);
        const moe::Dispatched d = disp.dispatch(x, counts);
        // The reverse sums the etp peers' partials: either peer 0 returns the
        // rows and the others zeros, or each returns half (x/2 + x/2 = x exactly).
        for (const bool halves : {false, true}) {
          if (halves && s->etp != 2) continue;
          Tensor y = Tensor::empty(d.x_MD.shape(), DType::f32, MemCategory::activation);
          for (int64_t i = 0; i < y.numel(); ++i)
            y.f32()[i] = halves ? 0.5f * d.x_MD.f32()[i] : disp.etp_rank() == 0 ? d.x_MD.f32()[i] : 0.0f;
          expect_bitwise(disp.combine(d.handle, y), x, halves ? "combine of halves" : "combine of peer 0's rows");
        }
      }
}

// Row tag of (source world rank, global expert, index within that expert's
// block, column): distinct per element, exact in fp32 (< 2^24).
float tag(int64_t src, int64_t e, int64_t j, int64_t c) {
  return static_cast<float>(((src * 64 + e) * 64 + j) * 8 + c);
}
std::string untag(float v) {
  const int64_t x = static_cast<int64_t>(v);
  return "(src " + std::to_string(x / 32768) + " expert " + std::to_string(x / 512 % 64) + " index " +
         std::to_string(x / 8 % 64) + " col " + std::to_string(x % 8) + ")";
}

TEST(MoeMpiDispatcher, RowsReachTheirExpertsInDocumentedOrder) {
  const int me = world_rank();
  for (const auto& s : setups())
    for (int64_t E : {s->ep, 3 * s->ep})
      for (const moe::ExpertPlacement& placement : placements(E, s->ep))
      for (Pattern p : kPatterns) {
        const std::string at = where(*s, E, pattern_name(p)) + " " + placement_name(placement);
        SCOPED_TRACE(at);
        const AllToAllDispatcher disp = s->dispatcher(E, placement);
        const int64_t El = disp.num_local_experts();
        const comm::RankCoords rc = s->layout.coords(me);
        const std::vector<int64_t> mine = disp.local_experts();  // ascending: the local index order
        std::vector<int64_t> want_mine;
        for (int64_t e = 0; e < E; ++e)
          if ((placement.is_contiguous() ? e / El : s->ep - 1 - e % s->ep) == rc.ep) want_mine.push_back(e);
        EXPECT_EQ(mine, want_mine);
        EXPECT_EQ(disp.etp_rank(), rc.etp);
        const std::vector<int64_t> counts = my_counts(placement, p, 23);
        const auto all = all_counts(counts);
        Tensor x = Tensor::empty({sum(counts), kD}, DType::f32, MemCategory::activation);
        for (int64_t e = 0, row = 0; e < E; ++e)
          for (int64_t j = 0; j < counts[e]; ++j, ++row)
            for (int64_t c = 0; c < kD; ++c) x.f32()[row * kD + c] = tag(me, e, j, c);
        const moe::Dispatched d = disp.dispatch(x, counts);
        const moe::DispatchHandle& h = d.handle;

        // What must arrive, in order: for each etp peer q (ascending world
        // rank = etp rank), for each member of q's ep group, its rows of each
        // of our local experts.
        struct Row {
          int64_t src, e, j;
          auto operator<=>(const Row&) const = default;
        };
        std::vector<Row> want;
        const comm::RankGroup etp_members = s->layout.group_of(GroupKind::etp, me);
        const comm::RankGroup my_ep = s->layout.group_of(GroupKind::ep, me);
        std::vector<int64_t> recv_etp, recv_ep(my_ep.size(), 0), per_local(El, 0);
        // Segments: one per (peer, source, local expert) with rows, in that
        // order; merged only when El = 1 (the same under every placement).
        moe::ExpertSegments want_segments;
        for (int q : etp_members) {
          int64_t n = 0;
          const comm::RankGroup ep_of_q = s->layout.group_of(GroupKind::ep, q);
          for (size_t pi = 0; pi < ep_of_q.size(); ++pi)
            for (int64_t el = 0; el < El; ++el) {
              const int src = ep_of_q[pi];
              const int64_t rows = all[src][mine[el]];
              for (int64_t j = 0; j < rows; ++j) want.push_back({src, mine[el], j});
              n += rows;
              per_local[el] += rows;
              if (q == me) recv_ep[pi] += rows;
              if (rows == 0) continue;
              if (El == 1 && !want_segments.empty()) want_segments.back().rows += rows;
              else want_segments.push_back({el, rows});
            }
          recv_etp.push_back(n);
        }
        std::vector<int64_t> send_ep(my_ep.size(), 0);
        for (int64_t e = 0; e < E; ++e) send_ep[placement.owner(e)] += counts[e];

        EXPECT_EQ(h.num_rows_in, x.size(0));
        EXPECT_EQ(h.send_rows_per_ep, send_ep);
        EXPECT_EQ(h.recv_rows_per_ep, recv_ep);
        EXPECT_EQ(h.recv_rows_per_etp, recv_etp);
        EXPECT_EQ(h.rows_per_local_expert, per_local);
        EXPECT_EQ(h.num_rows_out, static_cast<int64_t>(want.size()));
        ASSERT_EQ(d.x_MD.shape(), (Shape{static_cast<int64_t>(want.size()), kD}));
        if (p == Pattern::starved && s->ep > 1 && rc.ep == s->ep - 1) {
          EXPECT_EQ(h.num_rows_out, 0);
        }

        // Every row whole (all columns of one tag) and owned here; then the
        // multiset (a misroute), then the order (a misorder).
        std::vector<Row> got;
        for (int64_t m = 0; m < d.x_MD.size(0); ++m) {
          const float* r = d.x_MD.f32() + m * kD;
          const int64_t v = static_cast<int64_t>(r[0]);
          const Row row{v / 32768, v / 512 % 64, v / 8 % 64};
          for (int64_t c = 0; c < kD; ++c)
            ASSERT_EQ(r[c], tag(row.src, row.e, row.j, c)) << "row " << m << " col " << c << " holds " << untag(r[c]);
          ASSERT_TRUE(std::count(mine.begin(), mine.end(), row.e) == 1) << "row " << m << " " << untag(r[0])
                                                                        << " is not ours";
          got.push_back(row);
        }
        std::vector<Row> got_sorted = got, want_sorted = want;
        std::sort(got_sorted.begin(), got_sorted.end());
        std::sort(want_sorted.begin(), want_sorted.end());
        EXPECT_TRUE(got_sorted == want_sorted) << "received rows differ from what was routed here";
        for (size_t m = 0; m < std::min(got.size(), want.size()); ++m)
          if (!(got[m] == want[m])) {
            ADD_FAILURE() << "row " << m << " holds " << untag(d.x_MD.f32()[m * kD])
                          << ", want src " << want[m].src << " expert " << want[m].e << " index " << want[m].j;
            break;
          }

        // Segments: exactly those above, naming the local expert of every
        // row they cover.
        EXPECT_EQ(h.segments, want_segments);
        int64_t row = 0;
        for (size_t i = 0; i < h.segments.size(); ++i) {
          const moe::ExpertSegment& sg = h.segments[i];
          for (int64_t n = 0; n < sg.rows && row < static_cast<int64_t>(got.size()); ++n, ++row)
            ASSERT_EQ(mine[sg.expert], got[row].e) << "segment " << i << " (local expert " << sg.expert
                                                   << ") covers row " << row;
        }
        EXPECT_EQ(row, h.num_rows_out) << "segments do not tile the rows";
      }
}

// combine_backward and dispatch_backward are the adjoints of combine and
// dispatch: Σ_ranks <dispatch(u), v> = Σ_ranks <u, dispatch_backward(v)>, and
// likewise for combine. Tolerance 1e-5 relative to Σ|terms|: every product of
// two fp32 values is exact in fp64 and the fp64 sums add ~1e-16; the only
// fp32 rounding is reduce_scatter_v summing ETP partials (one rounding of
// 2^-24 per element), so a correct adjoint is off by < 1e-7·Σ|terms|, a wrong
// one (a misplaced or missed row) by O(1) of it.
TEST(MoeMpiDispatcher, BackwardsAreTheAdjoints) {
  auto dot = [](const Tensor& a, const Tensor& b, double& abs) {
    double s = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double t = double(a.f32()[i]) * b.f32()[i];
      s += t;
      abs += std::abs(t);
    }
    return s;
  };
  for (const auto& s : setups())
    for (int64_t E : {s->ep, 3 * s->ep})
      for (const moe::ExpertPlacement& placement : placements(E, s->ep))
      for (Pattern p : {Pattern::random, Pattern::starved}) {
        const std::string at = where(*s, E, pattern_name(p)) + " " + placement_name(placement);
        SCOPED_TRACE(at);
        const AllToAllDispatcher disp = s->dispatcher(E, placement);
        const std::vector<int64_t> counts = my_counts(placement, p, 37);
        std::mt19937 rng(testing::test_seed(500u + static_cast<uint32_t>(world_rank())));
        const Tensor u = random_tensor({sum(counts), kD}, rng);  // input layout [N, D]
        const moe::Dispatched d = disp.dispatch(u, counts);
        const Tensor v = random_tensor(d.x_MD.shape(), rng);  // expert layout [M, D]
        double abs_l = 0, abs_r = 0;
        const double l1 = all_sum(dot(d.x_MD, v, abs_l));
        const double r1 = all_sum(dot(u, disp.dispatch_backward(d.handle, v), abs_r));
        const double scale1 = std::max(all_sum(abs_l), all_sum(abs_r));
        EXPECT_GT(scale1, 1.0) << "vacuous: nothing moved";
        EXPECT_NEAR(l1, r1, 1e-5 * scale1) << "<dispatch(u), v> vs <u, dispatch_backward(v)>";
        abs_l = abs_r = 0;
        const double l2 = all_sum(dot(disp.combine(d.handle, v), u, abs_l));
        const double r2 = all_sum(dot(v, disp.combine_backward(d.handle, u), abs_r));
        const double scale2 = std::max(all_sum(abs_l), all_sum(abs_r));
        EXPECT_NEAR(l2, r2, 1e-5 * scale2) << "<combine(v), u> vs <v, combine_backward(u)>";
      }
}

// ---------------------------------------------------------------------------
// The whole MoE layer through the dispatcher vs each rank alone.

// Full weights from the job's test seed: identical on every rank.
MoeLayerWeights full_weights(int64_t E) {
  std::mt19937 rng(testing::test_seed(2024));
  MoeLayerWeights w;
  w.gate_ED = random_tensor({E, kD}, rng, 0.5f, MemCategory::param);
  w.experts = {random_tensor({E, kF, kD}, rng, 0.3f, MemCategory::param),
               random_tensor({E, kF, kD}, rng, 0.3f, MemCategory::param),
               random_tensor({E, kD, kF}, rng, 0.3f, MemCategory::param)};
  return w;
}

// Experts `experts` (local expert j is experts[j]) and F-rows [f0, f0 + Fl)
// of full [E, F, D] / [E, D, F] weights, or (add = true) the reverse: local
// added into its place in full.
void slice_experts(ExpertWeights& local, ExpertWeights& full, const std::vector<int64_t>& experts, int64_t f0,
                   bool add) {
  const int64_t El = local.w1_EFD.size(0), Fl = local.w1_EFD.size(1), F = full.w1_EFD.size(1);
  ASSERT_EQ(static_cast<int64_t>(experts.size()), El);
  auto move = [&](float& l, float& f) {
    if (add) f += l;
    else l = f;
  };
  for (int64_t e = 0; e < El; ++e)
    for (int64_t f = 0; f < Fl; ++f)
      for (int64_t c = 0; c < kD; ++c) {
        const int64_t g = experts[static_cast<size_t>(e)];
        const int64_t li = (e * Fl + f) * kD + c, fi = (g * F + f0 + f) * kD + c;
        move(local.w1_EFD.f32()[li], full.w1_EFD.f32()[fi]);
        move(local.w3_EFD.f32()[li], full.w3_EFD.f32()[fi]);
        move(local.w2_EDF.f32()[(e * kD + c) * Fl + f], full.w2_EDF.f32()[(g * kD + c) * F + f0 + f]);
      }
}

ExpertWeights zero_experts(int64_t E, int64_t F) {
  return {Tensor::zeros({E, F, kD}, DType::f32, MemCategory::grad),
          Tensor::zeros({E, F, kD}, DType::f32, MemCategory::grad),
          Tensor::zeros({E, kD, F}, DType::f32, MemCategory::grad)};
}

struct LayerRun {
  Tensor y, dx;
  MoeLayerWeights grad;
  moe::MoeLayerSaved saved;
  moe::MoeLayerStats stats;
};

LayerRun run_layer(const MoeLayerOptions& opt, const MoeLayerWeights& w, const Tensor& x, const Tensor& dy,
                   const AllToAllDispatcher* disp, const moe::StatsReducer& reduce = nullptr,
                   const ExecContext& on = ctx) {
  LayerRun r;
  r.grad.gate_ED = Tensor::zeros(w.gate_ED.shape(), DType::f32, MemCategory::grad);
  r.grad.experts = zero_experts(w.experts.num_experts(), w.experts.w1_EFD.size(1));
  r.y = moe::moe_layer_forward(on, opt, w, x, kSeq, r.saved, r.stats, reduce, disp);
  r.dx = moe::moe_layer_backward(on, opt, w, r.saved, dy, 1.0f, r.grad, disp);
  return r;
}

struct LayerCase {
  const char* name;
  MoeLayerOptions opt;
  bool empty_rank = false;  // the last world rank has T = 0 tokens
  bool starve = false;      // expert bias keeps every token off the last EP rank's experts
};

MoeLayerOptions layer_options(int64_t E, std::optional<double> cf = {}, moe::DropPolicy policy = moe::DropPolicy::probs,
                              bool pad = false, float aux = 0.5f) {
  MoeLayerOptions o;
  o.router.num_experts = E, o.router.top_k = kK;
  o.router.load_balancing = moe::LoadBalancing::aux_loss, o.router.aux_loss_coeff = aux;
  o.capacity = {.capacity_factor = cf, .drop_policy = policy, .pad_to_capacity = pad};
  return o;
}

// Forward + backward through the dispatcher against the same layer computed
// by this rank alone with all E experts and full weights, on the same tokens.
void check_layer_parity(const Setup& s, int64_t E, const LayerCase& c) {
  const std::string at = where(s, E, c.name);
  SCOPED_TRACE(at);
  const int me = world_rank();
  const AllToAllDispatcher disp = s.dispatcher(E);
  const int64_t El = disp.num_local_experts(), Fl = kF / s.etp;
  const std::vector<int64_t> mine = disp.local_experts();
  const int64_t f0 = disp.etp_rank() * Fl;
  const bool starve = c.starve && E - El >= kK;  // k experts must stay selectable

  MoeLayerWeights full = full_weights(E);
  if (starve) {  // selection by s + b: s ∈ (0, 1), so b = −10 is never in the top k
    full.bias_E = Tensor::zeros({E}, DType::f32, MemCategory::param);
    for (int64_t e = E - El; e < E; ++e) full.bias_E.f32()[e] = -10.0f;
  }
  MoeLayerWeights local;
  local.gate_ED = full.gate_ED;
  local.bias_E = full.bias_E;
  local.experts = zero_experts(El, Fl);
  slice_experts(local.experts, full.experts, mine, f0, /*add=*/false);

  const int64_t T = c.empty_rank && world_size() > 1 && me == world_size() - 1 ? 0 : kT;
  std::mt19937 rng(testing::test_seed(9000u + static_cast<uint32_t>(me)));
  const Tensor x = random_tensor({T, kD}, rng), dy = random_tensor({T, kD}, rng);
  LayerRun ep = run_layer(c.opt, local, x, dy, &disp);
  LayerRun one = run_layer(c.opt, full, x, dy, nullptr);

  // Routing, capacity and the permutation are local: identical decisions.
  EXPECT_EQ(ep.stats.routed_per_expert, one.stats.routed_per_expert);
  EXPECT_EQ(ep.stats.kept_per_expert, one.stats.kept_per_expert);
  EXPECT_EQ(ep.saved.perm.rows_per_expert, one.saved.perm.rows_per_expert);
  ASSERT_EQ(ep.saved.perm.row_of_TK.shape(), one.saved.perm.row_of_TK.shape());
  EXPECT_TRUE(std::equal(ep.saved.perm.row_of_TK.i32(), ep.saved.perm.row_of_TK.i32() + T * kK,
                         one.saved.perm.row_of_TK.i32()))
      << "drop decisions / rows differ";
  EXPECT_EQ(ep.stats.losses.aux_loss, one.stats.losses.aux_loss);
  if (c.opt.capacity.pad_to_capacity) {
    const int64_t C = moe::expert_capacity(c.opt.capacity, T, kK, E);
    EXPECT_EQ(ep.saved.perm.rows_per_expert, std::vector<int64_t>(E, C));
    // Each etp peer's ep group has EP sources, each sending C rows per expert
    // (T and so C differ only on the empty rank).
    if (!c.empty_rank) {
      for (int64_t r : ep.saved.dispatch.rows_per_local_expert) EXPECT_EQ(r, C * s.ep * s.etp);
    }
  }

  // Same math, fp32 reassociation only (expect_close).
  expect_close(ep.y, one.y, 1e-5, "y_TD");
  expect_close(ep.dx, one.dx, 1e-5, "dx_TD");
  expect_close(ep.grad.gate_ED, one.grad.gate_ED, 1e-5, "router gate gradient");
  EXPECT_TRUE(all_finite(ep.y) && all_finite(ep.dx) && all_finite(ep.grad.gate_ED));
  if (T > 0) {
    EXPECT_GT(max_abs(ep.y.f32(), ep.y.numel()), 1e-3) << "vacuous: y is ~0";
  }

  // Expert e's F-slice gradient summed over the ranks that hold it (one per
  // EDP replica) equals the single-rank gradients summed over all ranks:
  // both are the gradient over every token in the world. Scattered into full
  // [E, F, D] buffers, summed in fp64.
  ExpertWeights placed = zero_experts(E, kF);
  slice_experts(ep.grad.experts, placed, mine, f0, /*add=*/true);
  const std::array<std::pair<const Tensor*, const Tensor*>, 3> pairs = {
      {{&placed.w1_EFD, &one.grad.experts.w1_EFD}, {&placed.w3_EFD, &one.grad.experts.w3_EFD},
       {&placed.w2_EDF, &one.grad.experts.w2_EDF}}};
  const char* names[] = {"expert w1 gradient", "expert w3 gradient", "expert w2 gradient"};
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int64_t n = pairs[i].first->numel();
    std::vector<double> a(pairs[i].first->f32(), pairs[i].first->f32() + n);
    std::vector<double> b(pairs[i].second->f32(), pairs[i].second->f32() + n);
    MPI_Allreduce(MPI_IN_PLACE, a.data(), static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, b.data(), static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    expect_close(a.data(), b.data(), n, 1e-5, names[i]);
    double m = 0;
    for (double v : b) m = std::max(m, std::abs(v));
    EXPECT_GT(m, 1e-3) << names[i] << " is ~0: the comparison would be vacuous";
  }

  if (starve) {
    EXPECT_EQ(ep.stats.tokens_per_ep_rank.back(), 0);
    if (s.layout.coords(me).ep == s.ep - 1) {  // this rank's experts received nothing
      // Padding rows still arrive (zero rows, zero outputs, zero gradients).
      if (!c.opt.capacity.pad_to_capacity) {
        EXPECT_EQ(ep.saved.dispatch.num_rows_out, 0);
      }
      EXPECT_EQ(max_abs(ep.grad.experts.w1_EFD.f32(), ep.grad.experts.w1_EFD.numel()), 0.0);
      EXPECT_EQ(max_abs(ep.grad.experts.w2_EDF.f32(), ep.grad.experts.w2_EDF.numel()), 0.0);
    }
  }
}

// E per layout for the layer: two experts per EP rank, and one per rank where
// top-2 still has two experts to pick.
std::vector<int64_t> layer_experts(const Setup& s) {
  if (s.ep >= 2) return {2 * s.ep, s.ep};
  return {2 * s.ep};
}

TEST(MoeMpiDispatcher, LayerMatchesSingleRankDropless) {
  for (const auto& s : setups())
    for (int64_t E : layer_experts(*s)) check_layer_parity(*s, E, {"dropless", layer_options(E)});
}

// Issue criterion: with a capacity factor, the drop decisions under EP equal
// the single-rank decisions for the same local tokens (row_of_TK and
// kept_per_expert are compared exactly in check_layer_parity).
TEST(MoeMpiDispatcher, LayerMatchesSingleRankWithCapacity) {
  for (const auto& s : setups())
    for (int64_t E : layer_experts(*s)) {
      check_layer_parity(*s, E, {"cf 1.0 probs", layer_options(E, 1.0, moe::DropPolicy::probs)});
      check_layer_parity(*s, E, {"cf 1.0 position", layer_options(E, 1.0, moe::DropPolicy::position)});
      check_layer_parity(*s, E, {"cf 1.0 probs padded", layer_options(E, 1.0, moe::DropPolicy::probs, true)});
    }
}

// Experts that receive nothing (T > 0 everywhere), then a rank with T = 0
// tokens beside them. No aux or z loss in the latter: without a reducer a
// rank's router statistics over zero tokens are undefined (router_forward
// rejects them), and a reducer would make the two runs' losses differ.
TEST(MoeMpiDispatcher, LayerWithStarvedExpertsAndAnEmptyRank) {
  for (const auto& s : setups())
    for (int64_t E : layer_experts(*s)) {
      check_layer_parity(*s, E, {"starved experts", layer_options(E), false, true});
      check_layer_parity(*s, E, {"starved, cf 1.0 padded", layer_options(E, 1.0, moe::DropPolicy::position, true),
                                 false, true});
      check_layer_parity(*s, E, {"empty rank", layer_options(E, {}, moe::DropPolicy::probs, false, 0.0f), true, true});
    }
}

// The layer under the strided placement against the contiguous one, with the
// same EP size, weights and tokens: bitwise equal y, dx and router gradient,
// and every expert's gradient wherever it lives (scattered into full buffers
// by global id and summed over the world in fp64, where adding zeros and an
// expert's EDP replicas, at most two here, is exact); tokens_per_ep_rank
// counts each rank's placed experts. On one thread: the CPU grouped GEMM
// picks its schedule from all of a call's segments
// (kernels/cpu/grouped_gemm.cpp), and at 2+ threads its two schedules round
// 1-row products differently, while which segments a rank runs depends on
// its experts; at one thread both schedules are the per-segment loop.
void check_placement_is_bitwise(const Setup& s, int64_t E, const LayerCase& c) {
  SCOPED_TRACE(where(s, E, c.name));
  static const ExecContext one_thread = ExecContext::cpu(1);
  const AllToAllDispatcher contiguous = s.dispatcher(E), placed = s.dispatcher(E, strided(E, s.ep));
  const int64_t El = contiguous.num_local_experts(), Fl = kF / s.etp, f0 = contiguous.etp_rank() * Fl;
  MoeLayerWeights full = full_weights(E);
  auto local_weights = [&](const AllToAllDispatcher& d) {
    MoeLayerWeights w;
    w.gate_ED = full.gate_ED;
    w.experts = zero_experts(El, Fl);
    slice_experts(w.experts, full.experts, d.local_experts(), f0, /*add=*/false);
    return w;
  };
  const int64_t T = c.empty_rank && world_size() > 1 && world_rank() == world_size() - 1 ? 0 : kT;
  std::mt19937 rng(testing::test_seed(4242u + static_cast<uint32_t>(world_rank())));
  const Tensor x = random_tensor({T, kD}, rng), dy = random_tensor({T, kD}, rng);
  const MoeLayerWeights wa = local_weights(contiguous), wb = local_weights(placed);
  LayerRun a = run_layer(c.opt, wa, x, dy, &contiguous, nullptr, one_thread);
  LayerRun b = run_layer(c.opt, wb, x, dy, &placed, nullptr, one_thread);
  expect_bitwise(b.y, a.y, "y_TD");
  expect_bitwise(b.dx, a.dx, "dx_TD");
  expect_bitwise(b.grad.gate_ED, a.grad.gate_ED, "router gate gradient");
  EXPECT_EQ(b.stats.kept_per_expert, a.stats.kept_per_expert);
  for (int64_t r = 0; r < s.ep; ++r) {
    int64_t want = 0;
    for (int64_t e : placed.placement().local_experts(r)) want += b.stats.kept_per_expert[e];
    EXPECT_EQ(b.stats.tokens_per_ep_rank[r], want) << "EP rank " << r;
  }
  auto whole = [&](const LayerRun& run, const AllToAllDispatcher& d) {
    ExpertWeights g = zero_experts(E, kF), local = run.grad.experts;  // handles: local is only read
    slice_experts(local, g, d.local_experts(), f0, /*add=*/true);
    std::vector<double> all;
    for (const Tensor* t : {&g.w1_EFD, &g.w3_EFD, &g.w2_EDF}) all.insert(all.end(), t->f32(), t->f32() + t->numel());
    MPI_Allreduce(MPI_IN_PLACE, all.data(), static_cast<int>(all.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return all;
  };
  const std::vector<double> ga = whole(a, contiguous), gb = whole(b, placed);
  EXPECT_TRUE(ga == gb) << "an expert's gradient depends on where it lives";
  double m = 0;
  for (double v : ga) m = std::max(m, std::abs(v));
  EXPECT_GT(m, 1e-3) << "expert gradients are ~0: the comparison would be vacuous";
}

TEST(MoeMpiDispatcher, LayerUnderAPlacementIsBitwiseTheContiguousLayer) {
  for (const auto& s : setups()) {
    if (s->ep == 1) continue;  // one EP rank: one placement
    for (int64_t E : layer_experts(*s)) {
      check_placement_is_bitwise(*s, E, {"dropless", layer_options(E)});
      check_placement_is_bitwise(*s, E, {"cf 1.0 probs padded", layer_options(E, 1.0, moe::DropPolicy::probs, true)});
      check_placement_is_bitwise(*s, E, {"empty rank", layer_options(E, {}, moe::DropPolicy::probs, false, 0.0f), true});
    }
  }
}

// A rank with T = 0 beside ranks with tokens, router statistics summed over
// tp-dp-cp (the whole world here): forward and backward run, every output is
// finite, the rank with no tokens gets no router gradient, and every rank sees
// the same reduced loss.
void check_empty_rank_with_reduced_losses(moe::LoadBalancing balancing, float aux_coeff, float z_coeff) {
  for (const auto& s : setups()) {
    const int64_t E = 2 * s->ep;
    const std::string at = where(*s, E, "empty rank, reduced losses");
    SCOPED_TRACE(at);
    const AllToAllDispatcher disp = s->dispatcher(E);
    MoeLayerOptions opt = layer_options(E, {}, moe::DropPolicy::probs, false, aux_coeff);
    opt.router.load_balancing = balancing;
    opt.router.z_loss_coeff = z_coeff;
    comm::Communicator& group = s->groups[GroupKind::tp_dp_cp];
    const moe::StatsReducer reduce = [&group](const Tensor& stats_N) { group.all_reduce(stats_N); };
    MoeLayerWeights full = full_weights(E);
    MoeLayerWeights local;
    local.gate_ED = full.gate_ED;
    const int64_t Fl = kF / s->etp;
    local.experts = zero_experts(disp.num_local_experts(), Fl);
    slice_experts(local.experts, full.experts, disp.local_experts(), disp.etp_rank() * Fl, false);
    // One rank alone cannot have T = 0 here: the reduced statistics would
    // cover no tokens (router_forward rejects that).
    const bool empty = world_size() > 1 && world_rank() == world_size() - 1;
    const int64_t T = empty ? 0 : kT;
    std::mt19937 rng(testing::test_seed(31u + static_cast<uint32_t>(world_rank())));
    const Tensor x = random_tensor({T, kD}, rng), dy = random_tensor({T, kD}, rng);
    LayerRun r = run_layer(opt, local, x, dy, &disp, reduce);
    EXPECT_EQ(r.y.shape(), (Shape{T, kD}));
    EXPECT_EQ(r.dx.shape(), (Shape{T, kD}));
    EXPECT_TRUE(all_finite(r.y) && all_finite(r.dx) && all_finite(r.grad.gate_ED) &&
                all_finite(r.grad.experts.w1_EFD) && all_finite(r.grad.experts.w3_EFD) &&
                all_finite(r.grad.experts.w2_EDF));
    const double loss = r.stats.losses.aux_loss + r.stats.losses.z_loss;
    double lo = loss, hi = loss;
    MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_EQ(lo, hi) << "reduced router loss differs across ranks";
    EXPECT_GT(lo, 0.0);
    if (empty) {
      EXPECT_EQ(max_abs(r.grad.gate_ED.f32(), r.grad.gate_ED.numel()), 0.0) << "no tokens, yet a router gradient";
    }
  }
}

TEST(MoeMpiDispatcher, LayerWithAnEmptyRankAndAReducedZLoss) {
  check_empty_rank_with_reduced_losses(moe::LoadBalancing::none, 0.0f, 0.01f);
}

// The aux loss over a group where one rank has no tokens: that rank adds
// zero statistics and still takes part in the reduction. (seq_aux_loss
// cannot: a rank without tokens has no sequences, so it is refused.)
TEST(MoeMpiDispatcher, LayerWithAnEmptyRankAndAReducedAuxLoss) {
  check_empty_rank_with_reduced_losses(moe::LoadBalancing::global_aux_loss, 0.5f, 0.01f);
}


}  // namespace
}  // namespace origami

int main(int argc, char** argv) {
  return origami::testing::run_mpi_tests(argc, argv, 0, [] { origami::dispatcher_test::setups().clear(); });
}
