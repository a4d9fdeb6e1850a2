// Expert-parallel token dispatcher (see token_dispatcher.h). Row buffers are
// f32 [rows, D]; counts travel in rows and are scaled to elements only at the
// Communicator call. On one rank (EP = ETP = 1) every exchange is the
// identity and returns its input tensor itself, so the one-rank MoE layer
// pays nothing for going through the dispatcher; a contiguous placement
// takes the same path as before placements existed (no copy, no table).
// The slot-order copies are ExecContext::copy of row blocks, queued on the
// context's stream when the rows are on a GPU: no host loop over row data,
// no device-wide wait.
#include "moe/token_dispatcher.h"

#include <numeric>

namespace origami::moe {

namespace {

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t D) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * D;
  return out;
}

// On the exchanged rows' device, in their dtype.
Tensor rows_buffer(const Tensor& like, int64_t rows, int64_t D, MemCategory cat) {
  return Tensor::empty({rows, D}, like.dtype(), cat, like.device());
}

// Step 0's copies: slot s takes expert expert_at(s)'s rows, in slot order;
// consecutive experts that stay consecutive move as one block.
std::vector<RowBlock> slot_order_blocks(const ExpertPlacement& placement, const std::vector<int64_t>& rows_per_expert) {
  const auto E = static_cast<int64_t>(rows_per_expert.size());
  std::vector<int64_t> begin(static_cast<size_t>(E), 0);  // first row of each expert in the permuted layout
  for (int64_t e = 1; e < E; ++e) begin[e] = begin[e - 1] + rows_per_expert[e - 1];
  std::vector<RowBlock> blocks;
  int64_t to = 0;
  for (int64_t s = 0; s < E; ++s) {
    const int64_t e = placement.expert_at(s), n = rows_per_expert[e];
    if (n == 0) continue;
    if (!blocks.empty() && blocks.back().from + blocks.back().rows == begin[e])
      blocks.back().rows += n;  // `to` is contiguous by construction
    else
      blocks.push_back({begin[e], to, n});
    to += n;
  }
  if (blocks.size() == 1) blocks.clear();  // all rows as one block: from 0 to 0, nothing moves
  return blocks;
}

enum class Order { to_slots, to_experts };

// The rows of `src` [N, D] in the other order, as a fresh [N, D] buffer on
// src's device.
Tensor reorder(const ExecContext& ctx, const Tensor& src, const std::vector<RowBlock>& blocks, Order order,
               MemCategory cat) {
  Tensor dst = Tensor::empty(src.shape(), src.dtype(), cat, src.device());
  for (const RowBlock& b : blocks) {
    const bool to_slots = order == Order::to_slots;
    ctx.copy(dst.slice(to_slots ? b.to : b.from, b.rows), src.slice(to_slots ? b.from : b.to, b.rows));
  }
  return dst;
}


}  // namespace

AllToAllDispatcher::AllToAllDispatcher(const ExecContext& ctx, int64_t num_experts, comm::Communicator* ep,
                                       comm::Communicator* etp, ExpertPlacement placement)
    : num_experts_(num_experts), placement_(std::move(placement)), ctx_(&ctx), ep_(ep), etp_(etp) {
  if (ep_) ep_size_ = ep_->size(), ep_rank_ = ep_->rank();
  if (etp_) etp_size_ = etp_->size(), etp_rank_ = etp_->rank();
  ORIGAMI_CHECK(num_experts_ > 0 && num_experts_ % ep_size_ == 0, "dispatcher: ", num_experts_,
                " experts do not divide over ep of ", ep_size_);
  if (placement_.num_experts() == 0) placement_ = ExpertPlacement::contiguous(num_experts_, ep_size_);
  ORIGAMI_CHECK(placement_.num_experts() == num_experts_ && placement_.ep() == ep_size_, "dispatcher: a placement of ",
                placement_.num_experts(), " experts over ", placement_.ep(), " EP ranks for ", num_experts_,
                " experts over ep of ", ep_size_);
}

Dispatched AllToAllDispatcher::dispatch(const Tensor& x_ND, const std::vector<int64_t>& rows_per_expert) const {
  return dispatch_finish(dispatch_start(x_ND, rows_per_expert));
}

PendingDispatch AllToAllDispatcher::dispatch_start(const Tensor& x_ND,
                                                   const std::vector<int64_t>& rows_per_expert) const {
  const int64_t E = num_experts_, El = num_local_experts(), EP = ep_size_, ETP = etp_size_;
  ORIGAMI_CHECK(x_ND.dim() == 2, "dispatch: x_ND should be [N, D], got ", shape_string(x_ND.shape()));
  ORIGAMI_CHECK(static_cast<int64_t>(rows_per_expert.size()) == E, "dispatch: ", rows_per_expert.size(),
                " row counts for ", E, " experts");
  DispatchHandle h;
  h.num_rows_in = x_ND.size(0);
  ORIGAMI_CHECK(sum(rows_per_expert) == h.num_rows_in, "dispatch: row counts sum to ", sum(rows_per_expert),
                ", x_ND has ", h.num_rows_in, " rows");

  // 0. Rows leave in slot order, where EP rank p's experts form one block.
  // Rows are grouped by global expert, so under a contiguous placement they
  // already are in slot order (slot = expert).
  const bool placed = EP > 1 && !placement_.is_contiguous();
  std::vector<int64_t> rows_per_slot;  // [E], placed only
  if (placed) {
    rows_per_slot.resize(E);
    for (int64_t s = 0; s < E; ++s) rows_per_slot[s] = rows_per_expert[placement_.expert_at(s)];
    h.to_slot_order = slot_order_blocks(placement_, rows_per_expert);
  }
  const std::vector<int64_t>& send_counts = placed ? rows_per_slot : rows_per_expert;  // [E] in slot order
  h.send_rows_per_ep.assign(EP, 0);
  for (int64_t s = 0; s < E; ++s) h.send_rows_per_ep[s / El] += send_counts[s];

  // 1. Counts: rank p receives our counts of its slots (its local experts).
  std::vector<int64_t> recv_EpEl(send_counts);  // [EP, El]: rows from source p for local expert e
  if (EP > 1) {
    const std::vector<int64_t> per_peer(EP, El);
    ep_->all_to_all_v(std::span<const int64_t>(send_counts), per_peer, std::span(recv_EpEl), per_peer);
  }
  h.recv_rows_per_ep.assign(EP, 0);
  for (int64_t i = 0; i < EP * El; ++i) h.recv_rows_per_ep[i / El] += recv_EpEl[i];

  // ETP peers share these experts: each needs every peer's counts.
  std::vector<int64_t> counts_QEpEl(recv_EpEl);  // [ETP, EP, El]
  if (ETP > 1) {
    counts_QEpEl.resize(ETP * EP * El);
    etp_->all_gather(std::span<const int64_t>(recv_EpEl), std::span(counts_QEpEl));
  }
  h.recv_rows_per_etp.assign(ETP, 0);
  h.rows_per_local_expert.assign(El, 0);
  for (int64_t i = 0; i < ETP * EP * El; ++i) {
    const int64_t n = counts_QEpEl[i], e = i % El;
    h.recv_rows_per_etp[i / (EP * El)] += n;
    h.rows_per_local_expert[e] += n;
    if (n == 0) continue;
    // One segment per (etp peer, source, local expert) with rows; merged
    // across sources only when El = 1 (one GEMM instead of many). A merge
    // over empty experts between would depend on which experts are
    // neighbours in local order, i.e. on the placement, and would change the
    // expert's GEMM blocks and so its weight gradient's summation order.
    if (El == 1 && !h.segments.empty())
      h.segments.back().rows += n;
    else
      h.segments.push_back({e, n});
  }
  h.num_rows_out = sum(h.recv_rows_per_etp);

  PendingDispatch d;
  d.rows = start_forward(h, x_ND);
  d.handle = std::move(h);
  return d;
}

Dispatched AllToAllDispatcher::dispatch_finish(PendingDispatch&& pending) const {
  Dispatched d;
  d.x_MD = finish(pending.handle, std::move(pending.rows));
  d.handle = std::move(pending.handle);
  return d;
}

Tensor AllToAllDispatcher::combine(const DispatchHandle& h, const Tensor& y_MD) const {
  return finish(h, start_reverse(h, y_MD));
}

Tensor AllToAllDispatcher::combine_backward(const DispatchHandle& h, const Tensor& dy_ND) const {
  return finish(h, combine_backward_start(h, dy_ND));
}

PendingExchange AllToAllDispatcher::combine_backward_start(const DispatchHandle& h, const Tensor& dy_ND) const {
  return start_forward(h, dy_ND);
}

Tensor AllToAllDispatcher::dispatch_backward(const DispatchHandle& h, const Tensor& dx_MD) const {
  return finish(h, start_reverse(h, dx_MD));
}

PendingExchange AllToAllDispatcher::start_forward(const DispatchHandle& h, const Tensor& rows_ND) const {
  ORIGAMI_CHECK(rows_ND.dim() == 2 && rows_ND.size(0) == h.num_rows_in, "dispatcher: expected [", h.num_rows_in,
                ", D] rows, got ", shape_string(rows_ND.shape()));
  const int64_t D = rows_ND.size(1);
  PendingExchange p;
  p.forward = true;
  p.rows = rows_ND;  // 2. over ep
  if (ep_size_ > 1) {
    const int64_t n = sum(h.recv_rows_per_ep);
    p.rows = rows_buffer(rows_ND, n, D, etp_size_ > 1 ? MemCategory::comm : MemCategory::activation);
    p.sent = h.to_slot_order.empty()
                 ? rows_ND
                 : reorder(*ctx_, rows_ND, h.to_slot_order, Order::to_slots, MemCategory::comm);  // step 0
    p.request = ep_->all_to_all_v_async(p.sent, times(h.send_rows_per_ep, D), p.rows, times(h.recv_rows_per_ep, D));
  }
  return p;
}

PendingExchange AllToAllDispatcher::start_reverse(const DispatchHandle& h, const Tensor& rows_MD) const {
  ORIGAMI_CHECK(rows_MD.dim() == 2 && rows_MD.size(0) == h.num_rows_out, "dispatcher: expected [", h.num_rows_out,
                ", D] rows, got ", shape_string(rows_MD.shape()));
  const int64_t D = rows_MD.size(1);
  PendingExchange p;
  p.forward = false;
  Tensor mine = rows_MD;  // reverse of 3: sum the F-partials, keep this peer's block
  if (etp_size_ > 1) {
    mine = rows_buffer(rows_MD, h.recv_rows_per_etp[etp_rank_], D, ep_size_ > 1 ? MemCategory::comm : MemCategory::activation);
    etp_->reduce_scatter_v(rows_MD, mine, times(h.recv_rows_per_etp, D));
  }
  p.rows = mine;
  if (ep_size_ > 1) {  // reverse of 2
    const bool placed = !h.to_slot_order.empty();
    p.sent = mine;
    p.rows = rows_buffer(rows_MD, h.num_rows_in, D, placed ? MemCategory::comm : MemCategory::activation);
    p.request = ep_->all_to_all_v_async(p.sent, times(h.recv_rows_per_ep, D), p.rows, times(h.send_rows_per_ep, D));
  }
  return p;
}

Tensor AllToAllDispatcher::finish(const DispatchHandle& h, PendingExchange&& pending) const {
  if (ep_size_ > 1) ep_->complete(pending.request);  // CUDA: the compute stream waits, not the host
  pending.sent = Tensor();
  const Tensor rows = std::move(pending.rows);
  const int64_t D = rows.size(1);
  if (pending.forward) {
    if (etp_size_ == 1) return rows;
    Tensor gathered = rows_buffer(rows, h.num_rows_out, D, MemCategory::activation);  // 3. over etp
    etp_->all_gather_v(rows, gathered, times(h.recv_rows_per_etp, D));
    return gathered;
  }
  if (ep_size_ == 1 || h.to_slot_order.empty()) return rows;
  return reorder(*ctx_, rows, h.to_slot_order, Order::to_experts, MemCategory::activation);  // reverse of 0
}

}  // namespace origami::moe
