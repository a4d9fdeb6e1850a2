// Expert-parallel token dispatcher (ARCHITECTURE.md §5). EP rank r owns the
// experts [r·E/EP, (r+1)·E/EP); with ETP > 1 each of those experts is split
// over the `etp` group by F. Starting from the local permuted rows (grouped by
// global expert, the moe::Permutation layout), dispatch
//   1. exchanges per-expert row counts over `ep` (all_to_all_v of int64),
//   2. sends each EP rank the rows of its experts (all_to_all_v of rows),
//   3. with ETP > 1, all-gathers the received rows over `etp` (all_gather_v),
//   4. describes the result as segments (local expert, rows) in arrival
//      order — [etp peer][source ep rank][local expert] — which the grouped
//      experts consume in place; no sort copy (a departure from the design's
//      "sort by local expert": same math, one pass over the rows fewer).
// combine is the exact reverse: reduce-scatter over `etp` (summing the
// F-partial outputs), all_to_all_v back, giving rows in the local permuted
// layout for un-permute. Only these exchange steps communicate; everything
// else is bookkeeping on counts.
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
#include "kernels/tensor.h"
#include "moe/experts.h"

namespace origami::moe {

// Everything combine and both backwards need; immutable after dispatch.
struct DispatchHandle {
  int64_t num_rows_in = 0;                 // N: rows of the local permuted buffer
  int64_t num_rows_out = 0;                // M: rows of the experts' input on this rank
  std::vector<int64_t> send_rows_per_ep;   // [EP] rows this rank sends to each ep rank
  std::vector<int64_t> recv_rows_per_ep;   // [EP] rows it receives from each ep rank
  std::vector<int64_t> recv_rows_per_etp;  // [ETP] rows each etp peer received over ep
  ExpertSegments segments;                 // layout of the M rows (local expert indices)
  std::vector<int64_t> rows_per_local_expert;  // [E/EP], Σ over segments
};

struct Dispatched {
  DispatchHandle handle;
  Tensor x_MD;  // [M, D] the experts' input
};

class AllToAllDispatcher {
 public:
  // ep / etp may be null (size 1). num_experts must divide by ep's size.
  AllToAllDispatcher(int64_t num_experts, comm::Communicator* ep, comm::Communicator* etp);

  int64_t num_experts() const { return num_experts_; }
  int64_t ep_size() const { return ep_size_; }
  int64_t etp_size() const { return etp_size_; }
  int64_t num_local_experts() const { return num_experts_ / ep_size_; }
  int64_t first_local_expert() const { return ep_rank_ * num_local_experts(); }
  int64_t etp_rank() const { return etp_rank_; }

  // x_ND [N, D]: rows grouped by global expert, rows_per_expert [E] (Σ = N).
  Dispatched dispatch(const Tensor& x_ND, const std::vector<int64_t>& rows_per_expert) const;
  // y_MD [M, D] (partial sums over F under ETP) → y_ND [N, D] in the input layout.
  Tensor combine(const DispatchHandle& h, const Tensor& y_MD) const;
  // Gradient of combine: dy_ND [N, D] → dy_MD [M, D] (the full gradient on every etp peer).
  Tensor combine_backward(const DispatchHandle& h, const Tensor& dy_ND) const;
  // Gradient of dispatch: dx_MD [M, D] (F-partial under ETP) → dx_ND [N, D].
  Tensor dispatch_backward(const DispatchHandle& h, const Tensor& dx_MD) const;

 private:
  Tensor forward_exchange(const DispatchHandle& h, const Tensor& rows_ND) const;  // steps 2–3
  Tensor reverse_exchange(const DispatchHandle& h, const Tensor& rows_MD) const;  // their reverse

  int64_t num_experts_;
  comm::Communicator* ep_;
  comm::Communicator* etp_;
  int64_t ep_size_ = 1, ep_rank_ = 0, etp_size_ = 1, etp_rank_ = 0;
};

}  // namespace origami::moe
