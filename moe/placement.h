// Expert placement (moe.expert_placement): which EP rank holds which of a MoE
// layer's E experts. Placement moves experts between ranks; it never changes
// the math (moe/token_dispatcher.h keeps every expert's rows and segments the
// same under any placement of one EP size).
//
// Each of the EP ranks holds El = E/EP experts. A rank's local experts are
// its set sorted by global id — the order of the unit table's flat buffer
// (engine/units.h), so they form one [El, ...] block of each weight — and a
// local index is a position in that list. The slot order lists every rank's
// local experts in rank order: slot s = rank·El + local index; the dispatcher
// exchanges rows in slot order. The default, contiguous placement gives rank
// r the experts [r·El, (r+1)·El): slot = expert, and nothing is stored.
//
// Invariants: slot_expert is a permutation of 0..E-1 whose run of each rank
// ascends; expert_slot is its inverse. Users' placements are checked by the
// config (engine/config_placement.cpp, with the key and rule) before they get
// here; from_ranks only ORIGAMI_CHECKs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace origami::moe {

class ExpertPlacement {
 public:
  ExpertPlacement() = default;  // contiguous, no experts yet (num_experts() = 0)
  static ExpertPlacement contiguous(int64_t num_experts, int64_t ep);
  // experts_per_rank[r]: the global ids rank r holds, in any order.
  static ExpertPlacement from_ranks(const std::vector<std::vector<int64_t>>& experts_per_rank);

  int64_t num_experts() const { return num_experts_; }
  int64_t ep() const { return ep_; }
  int64_t experts_per_rank() const { return num_experts_ / ep_; }
  bool is_contiguous() const { return slot_expert_.empty(); }

  int64_t slot(int64_t expert) const { return is_contiguous() ? expert : expert_slot_[static_cast<size_t>(expert)]; }
  int64_t expert_at(int64_t slot) const { return is_contiguous() ? slot : slot_expert_[static_cast<size_t>(slot)]; }
  int64_t owner(int64_t expert) const { return slot(expert) / experts_per_rank(); }
  int64_t local_index(int64_t expert) const { return slot(expert) % experts_per_rank(); }
  // Rank r's experts, ascending: its local index order.
  std::vector<int64_t> local_experts(int64_t rank) const;

  bool operator==(const ExpertPlacement&) const = default;

 private:
  int64_t num_experts_ = 0, ep_ = 1;
  std::vector<int64_t> slot_expert_;  // [E] expert of each slot; empty when contiguous
  std::vector<int64_t> expert_slot_;  // [E] its inverse; empty when contiguous
};

// moe.expert_placement: placements of some MoE layers for the EP size `ep`;
// every other layer, and every layer under another EP size (the planner's
// candidate layouts), keeps the contiguous placement.
struct ExpertPlacements {
  int64_t ep = 0;                             // 0: none configured
  std::map<int64_t, ExpertPlacement> layers;  // MoE layer -> its placement (ep ranks)

  bool empty() const { return layers.empty(); }
  // The configured placement of `layer` for an EP size of `ep_size`, or
  // null where the contiguous one applies.
  const ExpertPlacement* find(int64_t layer, int64_t ep_size) const {
    if (ep_size != ep) return nullptr;
    const auto it = layers.find(layer);
    return it == layers.end() ? nullptr : &it->second;
  }
  // That placement as a value: the configured one or the contiguous one.
  ExpertPlacement of_layer(int64_t layer, int64_t num_experts, int64_t ep_size) const {
    const ExpertPlacement* p = find(layer, ep_size);
    return p ? *p : ExpertPlacement::contiguous(num_experts, ep_size);
  }
  bool operator==(const ExpertPlacements&) const = default;
};

}  // namespace origami::moe
