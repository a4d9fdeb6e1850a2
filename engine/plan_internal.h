// Helpers the planner's files share (plan.cpp, plan_comm.cpp); internal to
// engine/.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "comm/layout.h"
#include "engine/plan.h"

namespace origami::plan::internal {

using comm::GroupKind;

inline constexpr size_t kF32 = 4, kI64 = 8, kF64 = 8;
inline constexpr int64_t kI32 = 4;

// Bytes of one data element (activations, their gradients, the wire's rows):
// the recipe's parameter dtype (ExecContext::data_dtype).
inline int64_t data_bytes(Recipe r) { return recipe_bytes(r).param; }

// The axes (in the kind's view) that a group kind spans.
inline std::vector<comm::Axis> axes_of(GroupKind k) {
  using comm::Axis;
  switch (k) {
    case GroupKind::tp: return {Axis::tp};
    case GroupKind::cp: return {Axis::cp};
    case GroupKind::dp: return {Axis::dp};
    case GroupKind::dp_cp: return {Axis::dp, Axis::cp};
    case GroupKind::tp_cp: return {Axis::tp, Axis::cp};
    case GroupKind::tp_dp_cp: return {Axis::tp, Axis::dp, Axis::cp};
    case GroupKind::pp: return {Axis::pp};
    case GroupKind::tp_pp: return {Axis::tp, Axis::pp};
    case GroupKind::embedding: return {Axis::pp};  // first and last stage only; carries nothing here
    case GroupKind::ep: return {Axis::ep};
    case GroupKind::etp: return {Axis::tp};
    case GroupKind::edp: return {Axis::dp};
    case GroupKind::tp_ep: return {Axis::tp, Axis::ep};
    case GroupKind::tp_ep_pp: return {Axis::tp, Axis::ep, Axis::pp};
  }
  return {};
}

// Size of a group kind, and the lowest and highest world rank of the group
// holding `rank` (rank = Σ coord·stride over the order string, Megatron's
// RankGenerator), so a group lies in one node iff both ends do.
struct GroupSpan {
  int64_t size = 1, lo = 0, hi = 0;
};
inline GroupSpan span_of(const comm::Layout& layout, GroupKind k, int64_t rank) {
  const comm::View view = comm::group_view(k);
  const auto& sizes = layout.sizes(view);
  std::array<int64_t, comm::kNumAxes> stride{};
  int64_t s = 1;
  for (comm::Axis a : layout.full_order()) {
    stride[static_cast<size_t>(a)] = s;
    s *= sizes[static_cast<size_t>(a)];
  }
  GroupSpan g{1, rank, rank};
  for (comm::Axis a : axes_of(k)) {
    const auto i = static_cast<size_t>(a);
    const int64_t coord = (rank / stride[i]) % sizes[i];
    g.size *= sizes[i];
    g.lo -= coord * stride[i];
    g.hi += (sizes[i] - 1 - coord) * stride[i];
  }
  return g;
}

// Replays one step of stage `st` (plan_timeline.cpp) and fills its zero,
// activations, in_flight, pending_w and live; st.stage, st.chunk_layers
// and st.chunk_first must be set. `boundary`: per op of the stage's schedule,
// the pipeline's boundary tensors [t, D] alive beside it
// (PipelineSimulation::boundary_buffers); null with one stage.
void replay_stage(const PlanInput& in, const std::vector<UnitPlan>& units, const ActivationBytes& act, int64_t pp,
                  const PipeScheduleSpec& schedule, const std::vector<int64_t>* boundary, StageMemory& st);

// One step's communication for the first rank of stage `st` (plan_comm.cpp).
StageComm stage_comm(const PlanInput& in, const comm::Layout& layout, const std::vector<UnitPlan>& units,
                     const StageMemory& st, const ActivationBytes& act, int64_t micro_batches);

}  // namespace origami::plan::internal
