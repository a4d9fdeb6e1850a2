// Expert-parallel token dispatcher (ARCHITECTURE.md §5). The layer's
// placement (moe/placement.h) says which experts each EP rank owns — by
// default the contiguous block [r·E/EP, (r+1)·E/EP) — and a rank's local
// experts are its own in ascending id; with ETP > 1 each of those experts is
// split over the `etp` group by F. Starting from the local permuted rows
// (grouped by global expert, the moe::Permutation layout), dispatch
//   0. under a non-contiguous placement (EP > 1), copies the rows into slot
//      order — each EP rank's experts back to back, in its local order —
//      one block copy per run of experts (each expert's rows are contiguous);
//      contiguous placements are in slot order already and copy nothing,
//   1. exchanges per-slot row counts over `ep` (all_to_all_v of int64),
//   2. sends each EP rank the rows of its experts (all_to_all_v of rows),
//   3. with ETP > 1, all-gathers the received rows over `etp` (all_gather_v),
//   4. describes the result as segments (local expert, rows) in arrival
//      order — [etp peer][source ep rank][local expert] — which the grouped
//      experts consume in place; no sort copy (a departure from the design's
//      "sort by local expert": same math, one pass over the rows fewer).
// combine is the exact reverse: reduce-scatter over `etp` (summing the
// F-partial outputs), all_to_all_v back, and the copies of step 0 undone,
// giving rows in the local permuted layout for un-permute. Only these
// exchange steps communicate; everything else is bookkeeping on counts.
//
// Placement-independence: expert e's rows arrive at its owner in the same
// order and as the same segments under every placement of one EP size
// (segments merge across sources only when El = 1), so its GEMMs get the
// same operands wherever it lives; its outputs and weight gradient are then
// bitwise the same where the grouped GEMM runs a segment alike whatever the
// other segments (on CPU: at one thread, kernels/cpu/grouped_gemm.cpp; at
// more, its schedule follows all of a call's segments).
//
// The backward of combine moves gradients the way dispatch moves rows, and
// the backward of dispatch the way combine does; the handle from dispatch
// carries every count, so backward exchanges no counts.
//
// Invariant: every rank of an ep (and etp) group calls dispatch/combine and
// their backwards in the same order (they are collectives).
#pragma once
#include <vector>

#include "comm/communicator.h"
#include "kernels/context.h"
#include "kernels/tensor.h"
#include "moe/experts.h"
#include "moe/placement.h"

namespace origami::moe {

// `rows` rows moving from row `from` of the expert-ordered (permuted) layout
// to row `to` of the slot-ordered one (step 0), and back in the reverse.
struct RowBlock {
  int64_t from = 0, to = 0, rows = 0;
  bool operator==(const RowBlock&) const = default;
};

// Everything combine and both backwards need; immutable after dispatch.
struct DispatchHandle {
  int64_t num_rows_in = 0;                 // N: rows of the local permuted buffer
  int64_t num_rows_out = 0;                // M: rows of the experts' input on this rank
  std::vector<int64_t> send_rows_per_ep;   // [EP] rows this rank sends to each ep rank
  std::vector<int64_t> recv_rows_per_ep;   // [EP] rows it receives from each ep rank
  std::vector<int64_t> recv_rows_per_etp;  // [ETP] rows each etp peer received over ep
  ExpertSegments segments;                 // layout of the M rows (local expert indices)
  std::vector<int64_t> rows_per_local_expert;  // [E/EP], Σ over segments
  std::vector<RowBlock> to_slot_order;  // step 0's copies; empty: the rows go as they are
};

struct Dispatched {
  DispatchHandle handle;
  Tensor x_MD;  // [M, D] the experts' input
};

// An exchange whose expert all-to-all may still be on the wire: the *_start
// forms move what comes before it and start it, finish() waits and moves what
// follows. Work queued in between — the shared expert (moe_layer.cpp) —
// overlaps the all-to-all: on NCCL its kernels run while the rows move on
// the communication stream. Move-only; one finish() per start.
struct PendingExchange {
  bool forward = true;  // dispatch's direction (dispatch, combine_backward) or its reverse
  Tensor sent;          // kept alive until the rows have left
  Tensor rows;          // where the all-to-all lands (the input itself when ep = 1)
  comm::Request request;
};
struct PendingDispatch {
  DispatchHandle handle;
  PendingExchange rows;
};

class AllToAllDispatcher {
 public:
  // ctx: where the rows live and the slot-order copies run (in its stream's
  // order); it must outlive the dispatcher. ep / etp may be null (size 1).
  // num_experts must divide by ep's size. placement: over ep's size and
  // num_experts; default (num_experts() = 0): contiguous.
  AllToAllDispatcher(const ExecContext& ctx, int64_t num_experts, comm::Communicator* ep, comm::Communicator* etp,
                     ExpertPlacement placement = {});

  int64_t num_experts() const { return num_experts_; }
  int64_t ep_size() const { return ep_size_; }
  int64_t etp_size() const { return etp_size_; }
  int64_t num_local_experts() const { return num_experts_ / ep_size_; }
  const ExpertPlacement& placement() const { return placement_; }
  // This rank's experts, ascending (local index order).
  std::vector<int64_t> local_experts() const { return placement_.local_experts(ep_rank_); }
  int64_t etp_rank() const { return etp_rank_; }

  // x_ND [N, D]: rows grouped by global expert, rows_per_expert [E] (Σ = N).
  Dispatched dispatch(const Tensor& x_ND, const std::vector<int64_t>& rows_per_expert) const;
  // dispatch in two halves: the counts exchange (blocking: every size
  // depends on it) and the start of the rows' all-to-all, then the rest.
  PendingDispatch dispatch_start(const Tensor& x_ND, const std::vector<int64_t>& rows_per_expert) const;
  Dispatched dispatch_finish(PendingDispatch&& pending) const;
  // y_MD [M, D] (partial sums over F under ETP) → y_ND [N, D] in the input layout.
  Tensor combine(const DispatchHandle& h, const Tensor& y_MD) const;
  // Gradient of combine: dy_ND [N, D] → dy_MD [M, D] (the full gradient on every etp peer).
  Tensor combine_backward(const DispatchHandle& h, const Tensor& dy_ND) const;
  PendingExchange combine_backward_start(const DispatchHandle& h, const Tensor& dy_ND) const;
  // The second half of any *_start: the exchange's result.
  Tensor finish(const DispatchHandle& h, PendingExchange&& pending) const;
  // Gradient of dispatch: dx_MD [M, D] (F-partial under ETP) → dx_ND [N, D].
  Tensor dispatch_backward(const DispatchHandle& h, const Tensor& dx_MD) const;

 private:
  PendingExchange start_forward(const DispatchHandle& h, const Tensor& rows_ND) const;  // steps 0, 2 (started)
  PendingExchange start_reverse(const DispatchHandle& h, const Tensor& rows_MD) const;  // reverse of 3, 2 (started)

  int64_t num_experts_;
  ExpertPlacement placement_;
  const ExecContext* ctx_;
  comm::Communicator* ep_;
  comm::Communicator* etp_;
  int64_t ep_size_ = 1, ep_rank_ = 0, etp_size_ = 1, etp_rank_ = 0;
};

}  // namespace origami::moe
