// comm::Layout: the pure arithmetic of parallel folding (ARCHITECTURE.md §3).
// No MPI here: given a world size, the parallel sizes and an order string, it
// names every rank group of the dense view (TP × CP × DP × PP) and of the
// expert view (ETP × EP × EDP × PP) over the same ranks.
//
// Semantics are Megatron Core's RankGenerator, exactly:
//  - the order string lists axes fastest-varying first; a rank's coordinates
//    c_i satisfy rank = Σ c_i · stride_i with stride_i = Π_{j<i} size_j;
//  - the dense generator has sizes tp = TP, cp = CP, dp = DP, pp = PP, ep = 1;
//    the expert generator, with the same order string, has tp = ETP, ep = EP,
//    dp = EDP, pp = PP, cp = 1;
//  - groups("a-b") are the sets of ranks that agree on every axis not named;
//    members ascend and groups are sorted by their first rank (Megatron's
//    generate_masked_orthogonal_rank_groups yields exactly this order).
// Axes of size 1 may be left out of the order string (Megatron appends them).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace origami::comm {

// The five axes of an order string.
enum class Axis : int { tp, cp, ep, dp, pp };
inline constexpr int kNumAxes = 5;
std::string_view axis_name(Axis a);

// Which generator a group comes from.
enum class View : int { dense, expert };

// Every group a module may receive. Dense kinds first, then expert kinds, in
// the order `origami groups` prints them.
// clang-format off
enum class GroupKind : int {
  tp, cp, dp, dp_cp, tp_cp, tp_dp_cp, pp, tp_pp, embedding,  // dense view
  ep, etp, edp, tp_ep, tp_ep_pp,                               // expert view
};
// clang-format on
inline constexpr int kNumGroupKinds = 14;
inline constexpr std::array<GroupKind, kNumGroupKinds> kAllGroupKinds = {
    GroupKind::tp,       GroupKind::cp,  GroupKind::dp,    GroupKind::dp_cp,     GroupKind::tp_cp,
    GroupKind::tp_dp_cp, GroupKind::pp,  GroupKind::tp_pp, GroupKind::embedding, GroupKind::ep,
    GroupKind::etp,      GroupKind::edp, GroupKind::tp_ep, GroupKind::tp_ep_pp};
// "tp", "dp-cp", "embedding", "etp", "tp-ep-pp", ... (ARCHITECTURE.md §3 names).
std::string_view group_name(GroupKind k);
View group_view(GroupKind k);

// Sizes as the user gives them; DP and EDP are derived from the world size.
struct LayoutOptions {
  int64_t tp = 1, cp = 1, pp = 1, ep = 1, etp = 1;
  std::string order = "tp-cp-ep-dp-pp";
  int64_t num_experts = 0;  // 0: no MoE layers (EP divisibility is not checked)
};

using RankGroup = std::vector<int>;         // world ranks, ascending
using RankGroups = std::vector<RankGroup>;  // sorted by first rank

// A rank's coordinates in both views.
struct RankCoords {
  int64_t tp = 0, cp = 0, dp = 0, pp = 0;  // dense view
  int64_t etp = 0, ep = 0, edp = 0;        // expert view (pp is shared)
};

class Layout {
 public:
  // Validates and throws UserError naming the sizes when the layout is
  // impossible: W not divisible by TP·CP·PP or ETP·EP·PP, num_experts not
  // divisible by EP, a bad order string, dense and expert PP groups that
  // differ, or pp not last in the order while EDP != DP.
  Layout(int64_t world, const LayoutOptions& options);

  int64_t world() const { return world_; }
  int64_t tp() const { return opt_.tp; }
  int64_t cp() const { return opt_.cp; }
  int64_t pp() const { return opt_.pp; }
  int64_t ep() const { return opt_.ep; }
  int64_t etp() const { return opt_.etp; }
  int64_t dp() const { return dp_; }
  int64_t edp() const { return edp_; }
  int64_t num_experts() const { return opt_.num_experts; }
  const std::string& order() const { return opt_.order; }  // as given
  // All five axes, fastest first: the given ones, then omitted size-1 axes.
  const std::array<Axis, kNumAxes>& full_order() const { return axes_; }

  // Megatron's get_ranks(token) on one generator. Tokens are Megatron's axis
  // names (tp, cp, ep, dp, pp); in the expert view etp and edp name the tp and
  // dp slots too. Throws UserError on an unknown or repeated axis.
  RankGroups groups(View view, std::string_view axes) const;
  // The groups of one kind. Embedding groups are the first and last rank of
  // each pp group (one rank when PP = 1), so they cover only the end stages.
  RankGroups groups(GroupKind kind) const;
  // The group of `kind` that holds `rank`; empty when none does (embedding
  // groups skip middle pipeline stages).
  RankGroup group_of(GroupKind kind, int rank) const;

  RankCoords coords(int rank) const;

  // Sizes per Axis for a view (ep = 1 in the dense view, cp = 1 in the expert).
  const std::array<int64_t, kNumAxes>& sizes(View view) const {
    return view == View::dense ? dense_size_ : expert_size_;
  }

 private:
  std::array<bool, kNumAxes> mask_of(View view, std::string_view axes) const;
  RankGroups generate(View view, const std::array<bool, kNumAxes>& mask) const;
  int64_t coord(View view, Axis a, int rank) const;

  int64_t world_;
  LayoutOptions opt_;
  int64_t dp_ = 1, edp_ = 1;
  std::array<Axis, kNumAxes> axes_{};
  std::array<int64_t, kNumAxes> dense_size_{}, expert_size_{};      // by Axis
  std::array<int64_t, kNumAxes> dense_stride_{}, expert_stride_{};  // by Axis
};

// "[0,2,4]".
std::string format_group(const RankGroup& g);
// For messages: "0", "0, 2", "1-3, 5" (ascending ranks, runs of three or
// more collapsed).
std::string rank_list(const std::vector<int>& ascending);

// One line per group kind, e.g. "dense tp (4 groups of 2): [0,1] [2,3] ...".
std::string describe(const Layout& layout);

}  // namespace origami::comm
