// Expert placement (see placement.h).
#include "moe/placement.h"

#include <algorithm>

#include "kernels/check.h"

namespace origami::moe {

ExpertPlacement ExpertPlacement::contiguous(int64_t num_experts, int64_t ep) {
  ORIGAMI_CHECK(ep >= 1 && num_experts >= 0 && num_experts % ep == 0, "contiguous placement of ", num_experts,
                " experts over ", ep, " EP ranks");
  ExpertPlacement p;
  p.num_experts_ = num_experts;
  p.ep_ = ep;
  return p;
}

ExpertPlacement ExpertPlacement::from_ranks(const std::vector<std::vector<int64_t>>& experts_per_rank) {
  const auto ep = static_cast<int64_t>(experts_per_rank.size());
  ORIGAMI_CHECK(ep >= 1, "placement over no EP ranks");
  const auto El = static_cast<int64_t>(experts_per_rank[0].size());
  ExpertPlacement p;
  p.ep_ = ep;
  p.num_experts_ = ep * El;
  p.expert_slot_.assign(static_cast<size_t>(p.num_experts_), -1);
  for (int64_t r = 0; r < ep; ++r) {
    std::vector<int64_t> mine = experts_per_rank[static_cast<size_t>(r)];
    ORIGAMI_CHECK(static_cast<int64_t>(mine.size()) == El, "placement: EP rank ", r, " holds ", mine.size(),
                  " experts, rank 0 ", El);
    std::sort(mine.begin(), mine.end());  // local index order
    for (const int64_t e : mine) {
      ORIGAMI_CHECK(e >= 0 && e < p.num_experts_, "placement: expert ", e, " outside [0, ", p.num_experts_, ")");
      ORIGAMI_CHECK(p.expert_slot_[static_cast<size_t>(e)] < 0, "placement: expert ", e, " placed twice");
      p.expert_slot_[static_cast<size_t>(e)] = static_cast<int64_t>(p.slot_expert_.size());
      p.slot_expert_.push_back(e);
    }
  }
  // Contiguous blocks need no tables: the one representation of that case,
  // so operator== and is_contiguous agree however the placement was written.
  bool identity = true;
  for (int64_t s = 0; s < p.num_experts_; ++s) identity = identity && p.slot_expert_[static_cast<size_t>(s)] == s;
  if (identity) p.slot_expert_.clear(), p.expert_slot_.clear();
  return p;
}

std::vector<int64_t> ExpertPlacement::local_experts(int64_t rank) const {
  ORIGAMI_CHECK(rank >= 0 && rank < ep_, "EP rank ", rank, " of ", ep_);
  const int64_t El = experts_per_rank();
  std::vector<int64_t> out(static_cast<size_t>(El));
  for (int64_t l = 0; l < El; ++l) out[static_cast<size_t>(l)] = expert_at(rank * El + l);
  return out;
}

}  // namespace origami::moe
