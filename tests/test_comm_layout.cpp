// comm::Layout without MPI: Megatron Core's documented rank maps reproduced
// from the RankGenerator semantics, the validation rules with their numbers,
// and property tests over every factorization of world sizes up to 64.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "comm/layout.h"
#include "kernels/check.h"

namespace origami::comm {
namespace {

LayoutOptions sizes(int64_t tp, int64_t cp, int64_t pp, int64_t ep, int64_t etp, std::string order = "tp-cp-ep-dp-pp") {
  LayoutOptions o;
  o.tp = tp;
  o.cp = cp;
  o.pp = pp;
  o.ep = ep;
  o.etp = etp;
  o.order = std::move(order);
  return o;
}

// The UserError's message, or "" when the layout is accepted.
std::string error_of(int64_t world, const LayoutOptions& o) {
  try {
    Layout l(world, o);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// ---- Megatron Core's documented examples ---------------------------------------------------------

// initialize_model_parallel docstring: "16 GPUs g0 ... g15, 2 GPUs to
// parallelize the model tensor, and 4 GPUs to parallelize the model pipeline".
TEST(CommLayout, MegatronInitializeModelParallelExample) {
  LayoutOptions o = sizes(2, 1, 4, 1, 2);  // Megatron's ETP defaults to TP
  Layout l(16, o);
  EXPECT_EQ(l.dp(), 2);
  EXPECT_EQ(l.groups(GroupKind::dp),
            (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(l.groups(GroupKind::tp),
            (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(l.groups(GroupKind::pp), (RankGroups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  // Embedding groups: first and last rank of each pipeline group.
  EXPECT_EQ(l.groups(GroupKind::embedding), (RankGroups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_EQ(l.group_of(GroupKind::embedding, 4), RankGroup{});  // a middle stage
}

// initialize_model_parallel docstring, context_parallel_size: "8 GPUs, tensor
// model parallel size is 4 and context parallel size is 2 ... [GPU0, GPU4],
// [GPU1, GPU5], [GPU2, GPU6], and [GPU3, GPU7]".
TEST(CommLayout, MegatronContextParallelExample) {
  Layout l(8, sizes(4, 2, 1, 1, 4));
  EXPECT_EQ(l.groups(GroupKind::cp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.groups(GroupKind::tp), (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
}

// generate_masked_orthogonal_rank_groups docstring: "parallel_size =
// [tp_size, dp_size, pp_size] = [2, 3, 4], and the mask = [False, True,
// False] ... dp_group[0] = [0, 2, 4], dp_group[1] = [1, 3, 5], ...,
// dp_group[7] = [19, 21, 23]".
TEST(CommLayout, MegatronMaskedOrthogonalDpExample) {
  Layout l(24, sizes(2, 1, 4, 1, 2));
  const RankGroups dp = l.groups(GroupKind::dp);
  ASSERT_EQ(dp.size(), 8u);
  EXPECT_EQ(dp[0], (RankGroup{0, 2, 4}));
  EXPECT_EQ(dp[1], (RankGroup{1, 3, 5}));
  EXPECT_EQ(dp[7], (RankGroup{19, 21, 23}));
  EXPECT_EQ(l.groups(View::dense, "dp"), dp);  // the generic token form
}

// Same docstring, Algorithm: "if the gpu size is 8 and order is 'tp-pp-dp',
// size is '2-2-2', and the dp_group here is [[0, 4], [1, 5], [2, 6], [3, 7]]".
// (cp and ep are omitted: size-1 axes may be.)
TEST(CommLayout, MegatronTpPpDpOrderExample) {
  Layout l(8, sizes(2, 1, 2, 1, 2, "tp-pp-dp"));
  EXPECT_EQ(l.groups(GroupKind::dp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.groups(GroupKind::pp), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
}

// Same docstring, mask: "parallel_size = [tp_size, pp_size, dp_size] ...
// mask = [True, False, True] ... is the `tp-dp` group, if the mask = [False,
// True, False], then the generated group is the `pp` group", with its sizes
// "tensor_parallel_size = 2, pipeline_model_parallel_group = 3,
// data_parallel_size = 4, and the parallel mapping order is tp-pp-dp".
TEST(CommLayout, MegatronMaskExample) {
  Layout l(24, sizes(2, 1, 3, 1, 2, "tp-pp-dp"));
  ASSERT_EQ(l.dp(), 4);
  // rank = tp + 2·pp + 6·dp; tp-dp groups fix pp.
  EXPECT_EQ(l.groups(View::dense, "tp-dp"),
            (RankGroups{{0, 1, 6, 7, 12, 13, 18, 19}, {2, 3, 8, 9, 14, 15, 20, 21}, {4, 5, 10, 11, 16, 17, 22, 23}}));
  const RankGroups pp = l.groups(GroupKind::pp);
  ASSERT_EQ(pp.size(), 8u);
  EXPECT_EQ(pp[0], (RankGroup{0, 2, 4}));
  EXPECT_EQ(pp[2], (RankGroup{6, 8, 10}));
}

// The folded layout of the multi-rank tests, worked by hand: dense rank =
// tp + 2·dp + 4·pp; expert rank = ep + 2·edp + 4·pp (ETP = 1).
TEST(CommLayout, FoldedEightRankLayout) {
  LayoutOptions o = sizes(2, 1, 2, 2, 1);
  o.num_experts = 4;
  Layout l(8, o);
  EXPECT_EQ(l.dp(), 2);
  EXPECT_EQ(l.edp(), 2);
  EXPECT_EQ(l.groups(GroupKind::tp), (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.groups(GroupKind::dp), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.groups(GroupKind::cp), (RankGroups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(l.groups(GroupKind::tp_dp_cp), (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(l.groups(GroupKind::tp_pp), (RankGroups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(l.groups(GroupKind::pp), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(l.groups(GroupKind::ep), (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(l.groups(GroupKind::etp), (RankGroups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(l.groups(GroupKind::edp), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(l.groups(GroupKind::tp_ep), l.groups(GroupKind::ep));
  EXPECT_EQ(l.groups(View::expert, "etp-ep"), l.groups(GroupKind::tp_ep));
  EXPECT_EQ(l.groups(GroupKind::tp_ep_pp), (RankGroups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  const RankCoords c = l.coords(6);  // 6 = 0 + 2·1 + 4·1
  EXPECT_EQ(c.tp, 0);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.ep, 0);
  EXPECT_EQ(c.edp, 1);
  EXPECT_EQ(l.group_of(GroupKind::edp, 6), (RankGroup{4, 6}));
}

// ---- validation -----------------------------------------------------------------------------------

TEST(CommLayout, RejectsIndivisibleWorldWithTheNumbers) {
  EXPECT_EQ(error_of(12, sizes(2, 1, 4, 1, 1)), "world size 12 is not divisible by TP·CP·PP = 2·1·4 = 8");
  EXPECT_EQ(error_of(12, sizes(2, 1, 2, 4, 2)), "world size 12 is not divisible by ETP·EP·PP = 2·4·2 = 16");
}

TEST(CommLayout, RejectsExpertsNotDivisibleByEp) {
  LayoutOptions o = sizes(1, 1, 1, 4, 1);
  o.num_experts = 6;
  EXPECT_EQ(error_of(8, o), "num_experts = 6 is not divisible by EP = 4");
  o.num_experts = 8;
  EXPECT_EQ(error_of(8, o), "");
}

TEST(CommLayout, RejectsBadOrderStrings) {
  EXPECT_NE(error_of(4, sizes(2, 1, 1, 1, 1, "tp-xp-dp-pp")).find("unknown axis 'xp'"), std::string::npos);
  EXPECT_NE(error_of(4, sizes(2, 1, 1, 1, 1, "tp-dp-tp")).find("axis 'tp' appears twice"), std::string::npos);
  EXPECT_NE(error_of(4, sizes(2, 1, 1, 1, 1, "")).find("unknown axis ''"), std::string::npos);
  // Omitting an axis is fine only at size 1, in both views.
  EXPECT_EQ(error_of(4, sizes(2, 1, 1, 1, 2, "tp-dp")), "");
  const std::string ep = error_of(8, sizes(1, 1, 1, 2, 1, "tp-dp-pp"));
  EXPECT_NE(ep.find("omits axis 'ep' but EP = 2"), std::string::npos) << ep;
  const std::string tp = error_of(8, sizes(1, 1, 1, 1, 2, "cp-ep-dp-pp"));
  EXPECT_NE(tp.find("omits axis 'tp' but TP = 1, ETP = 2"), std::string::npos) << tp;
}

TEST(CommLayout, PpNotLastNeedsEqualDataParallelSizes) {
  // dp = 8/(1·1·2) = 4, edp = 8/(1·2·2) = 2.
  const std::string e = error_of(8, sizes(1, 1, 2, 2, 1, "tp-cp-ep-pp-dp"));
  EXPECT_NE(e.find("EDP = W/(ETP·EP·PP) = 8/(1·2·2) = 2 and DP = W/(TP·CP·PP) = 8/(1·1·2) = 4"), std::string::npos)
      << e;
  EXPECT_EQ(error_of(8, sizes(1, 1, 2, 2, 1, "tp-cp-ep-dp-pp")), "");  // pp last: allowed
  EXPECT_EQ(error_of(8, sizes(2, 1, 2, 2, 1, "tp-cp-ep-pp-dp")), "");  // dp = edp = 2: allowed
}

TEST(CommLayout, RejectsDifferentPipelineGroupsInTheTwoViews) {
  // dp = edp = 2, but pp's stride is TP = 2 in the dense view and ETP = 1 in the expert one.
  const std::string e = error_of(8, sizes(2, 1, 2, 2, 1, "tp-pp-cp-ep-dp"));
  EXPECT_NE(e.find("dense pp group 0 is [0,2], expert pp group 0 is [0,1]"), std::string::npos) << e;
}

// ---- properties over every factorization of W <= 64 ------------------------------------------------

// An independent model of the semantics: decompose each rank over the order,
// then group ranks that agree on every axis not named.
struct Reference {
  std::vector<std::array<int64_t, kNumAxes>> coord;  // [rank][axis]
  Reference(const Layout& l, View v) : coord(static_cast<size_t>(l.world())) {
    for (int64_t r = 0; r < l.world(); ++r) {
      int64_t rest = r;
      for (Axis a : l.full_order()) {
        const int64_t s = l.sizes(v)[static_cast<size_t>(a)];
        coord[static_cast<size_t>(r)][static_cast<size_t>(a)] = rest % s;
        rest /= s;
      }
    }
  }
  RankGroups groups(std::initializer_list<Axis> named) const {
    // Key: the unnamed coordinates in base 64 (every size is <= 64); groups are
    // numbered by first encounter, which ascends with their first rank.
    std::map<int64_t, size_t> index;
    RankGroups out;
    for (size_t r = 0; r < coord.size(); ++r) {
      int64_t key = 0;
      for (int a = 0; a < kNumAxes; ++a)
        if (std::find(named.begin(), named.end(), static_cast<Axis>(a)) == named.end()) key = key * 64 + coord[r][a];
      auto [it, fresh] = index.emplace(key, out.size());
      if (fresh) out.emplace_back();
      out[it->second].push_back(static_cast<int>(r));
    }
    return out;
  }
};

void check_properties(const Layout& l, const std::string& what) {
  SCOPED_TRACE(what);
  const Reference dense(l, View::dense), expert(l, View::expert);
  using A = Axis;
  const std::map<GroupKind, RankGroups> expected = {
      {GroupKind::tp, dense.groups({A::tp})},
      {GroupKind::cp, dense.groups({A::cp})},
      {GroupKind::dp, dense.groups({A::dp})},
      {GroupKind::dp_cp, dense.groups({A::dp, A::cp})},
      {GroupKind::tp_cp, dense.groups({A::tp, A::cp})},
      {GroupKind::tp_dp_cp, dense.groups({A::tp, A::dp, A::cp})},
      {GroupKind::pp, dense.groups({A::pp})},
      {GroupKind::tp_pp, dense.groups({A::tp, A::pp})},
      {GroupKind::ep, expert.groups({A::ep})},
      {GroupKind::etp, expert.groups({A::tp})},
      {GroupKind::edp, expert.groups({A::dp})},
      {GroupKind::tp_ep, expert.groups({A::tp, A::ep})},
      {GroupKind::tp_ep_pp, expert.groups({A::tp, A::ep, A::pp})},
  };
  const RankGroups tdc = l.groups(GroupKind::tp_dp_cp);
  std::vector<int> stage_group(static_cast<size_t>(l.world()));  // which tp-dp-cp group holds each rank
  for (size_t g = 0; g < tdc.size(); ++g)
    for (int r : tdc[g]) stage_group[static_cast<size_t>(r)] = static_cast<int>(g);

  for (GroupKind k : kAllGroupKinds) {
    const RankGroups gs = l.groups(k);
    // Groups sorted by first rank, members ascending.
    for (size_t g = 0; g < gs.size(); ++g) {
      ASSERT_FALSE(gs[g].empty());
      ASSERT_TRUE(std::is_sorted(gs[g].begin(), gs[g].end())) << group_name(k);
      if (g) {
        ASSERT_LT(gs[g - 1].front(), gs[g].front()) << group_name(k);
      }
    }
    if (k == GroupKind::embedding) {
      const RankGroups pp = l.groups(GroupKind::pp);
      ASSERT_EQ(gs.size(), pp.size());
      for (size_t g = 0; g < gs.size(); ++g) {
        const RankGroup ends = pp[g].size() > 1 ? RankGroup{pp[g].front(), pp[g].back()} : pp[g];
        ASSERT_EQ(gs[g], ends);
      }
      continue;
    }
    ASSERT_EQ(gs, expected.at(k)) << group_name(k);  // "agree on every axis not named"
    // A partition of the world into equal groups.
    std::vector<int> seen(static_cast<size_t>(l.world()), 0);
    for (const RankGroup& g : gs) {
      ASSERT_EQ(g.size(), gs.front().size()) << group_name(k);
      for (int r : g) seen[static_cast<size_t>(r)]++;
    }
    ASSERT_TRUE(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; })) << group_name(k);
    // group_of agrees with the listing (every member for small worlds; the
    // ends of each group beyond, which keeps this linear in W).
    for (const RankGroup& g : gs)
      for (size_t i = 0; i < g.size(); ++i)
        if (l.world() <= 16 || i == 0 || i + 1 == g.size()) {
          ASSERT_EQ(l.group_of(k, g[i]), g) << group_name(k) << " rank " << g[i];
        }
  }
  // Both views cut the same pipeline stages, so every expert group below the
  // pipeline (ep, etp, edp, etp-ep) lies inside one dense tp-dp-cp group.
  ASSERT_EQ(l.groups(View::dense, "pp"), l.groups(View::expert, "pp"));
  for (GroupKind k : {GroupKind::ep, GroupKind::etp, GroupKind::edp, GroupKind::tp_ep})
    for (const RankGroup& g : l.groups(k)) {
      for (int r : g) ASSERT_EQ(stage_group[static_cast<size_t>(r)], stage_group[static_cast<size_t>(g.front())]);
    }
  // Coordinates round-trip.
  for (int r = 0; r < l.world(); ++r) {
    const RankCoords c = l.coords(r);
    const auto& d = dense.coord[static_cast<size_t>(r)];
    const auto& e = expert.coord[static_cast<size_t>(r)];
    ASSERT_EQ(c.tp, d[0]);
    ASSERT_EQ(c.cp, d[1]);
    ASSERT_EQ(c.dp, d[3]);
    ASSERT_EQ(c.pp, d[4]);
    ASSERT_EQ(c.etp, e[0]);
    ASSERT_EQ(c.ep, e[2]);
    ASSERT_EQ(c.edp, e[3]);
    ASSERT_EQ(d[4], e[4]);
  }
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

TEST(CommLayout, PropertiesOverEveryFactorizationUpTo64) {
  // The default order, pp-not-last orders (valid only where EDP = DP and the
  // pipeline strides agree) and one with dp fastest.
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-cp-ep-dp", "dp-ep-cp-tp-pp"};
  // Beyond W = 32 only the default order, to keep the test to seconds.
  int64_t accepted = 0, rejected = 0;
  for (int64_t w = 1; w <= 64; ++w)
    for (int64_t pp : divisors(w))
      for (int64_t tp : divisors(w / pp))
        for (int64_t cp : divisors(w / pp / tp))
          for (int64_t ep : divisors(w / pp))
            for (int64_t etp : divisors(w / pp / ep))
              for (const std::string& order : orders) {
                if (w > 32 && order != orders.front()) continue;
                const LayoutOptions o = sizes(tp, cp, pp, ep, etp, order);
                const std::string err = error_of(w, o);
                if (!err.empty()) {
                  // Only the order rules may reject a divisible layout.
                  ASSERT_NE(order, "tp-cp-ep-dp-pp") << err;
                  ++rejected;
                  continue;
                }
                ++accepted;
                check_properties(Layout(w, o),
                                 (::testing::Message() << "W=" << w << " tp=" << tp << " cp=" << cp << " pp=" << pp
                                                       << " ep=" << ep << " etp=" << etp << " order=" << order)
                                     .GetString());
                if (HasFatalFailure()) return;
              }
  EXPECT_GT(accepted, 10000);
  EXPECT_GT(rejected, 0);
}

TEST(CommLayout, DescribeListsEveryKind) {
  const std::string d = describe(Layout(8, sizes(2, 1, 2, 2, 1)));
  EXPECT_NE(d.find("dense tp (4 groups of 2): [0,1] [2,3] [4,5] [6,7]"), std::string::npos) << d;
  EXPECT_NE(d.find("expert tp-ep-pp (2 groups of 4): [0,1,4,5] [2,3,6,7]"), std::string::npos) << d;
  EXPECT_NE(d.find("dense embedding (4 groups of 2): [0,4] [1,5] [2,6] [3,7]"), std::string::npos) << d;
}

}  // namespace
}  // namespace origami::comm
