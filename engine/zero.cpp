// ZeRO over the parameter store (see zero.h). Every collective here is on the
// unit's shard group, issued in the model's execution order, which is the
// same on every rank of the group.
#include "engine/zero.h"

#include <algorithm>

#include "kernels/elementwise.h"

namespace origami {

namespace {

// Elements [begin, begin + n) of a flat buffer, as a tensor the collectives take.
Tensor part(const Tensor& t, int64_t begin, int64_t n) { return t.flat_view(begin, n, {n}); }

}  // namespace

std::function<UnitShard(const ParamUnit&)> zero_shard_plan(int stage, const comm::Groups* groups) {
  ORIGAMI_CHECK(stage >= 0 && stage <= 3, "ZeRO stage ", stage, " outside 0-3");
  return [stage, groups](const ParamUnit& u) {
    UnitShard s;
    if (!groups) return s;
    const comm::Communicator& c = groups->get(u.expert ? comm::GroupKind::edp : comm::GroupKind::dp_cp);
    s.group_size = c.size();
    s.group_rank = c.rank();
    if (c.size() == 1) return s;
    s.optim = stage >= 1;
    s.grads = stage >= 2;
    s.params = stage >= 3;
    return s;
  };
}

ZeroStore::ZeroStore(const ExecContext& ctx, ParamStore& params, const comm::Groups& groups,
                     const ZeroOptions& options)
    : ctx_(&ctx),
      params_(params),
      reshard_after_forward_(options.reshard_after_forward),
      overlap_grad_reduce_(options.overlap_grad_reduce),
      gathers_(params.units().size()),
      pending_weights_(params.units().size(), 0) {
  dense_ = comm::multi_rank(groups, comm::GroupKind::dp_cp);
  expert_ = comm::multi_rank(groups, comm::GroupKind::edp);
  tp_ = comm::multi_rank(groups, comm::GroupKind::tp);
}

void ZeroStore::reduce_replicated(ParamUnit& u) {
  if (!tp_) return;
  for (const ParamInfo& p : u.params)
    if (p.tp_replicated) tp_->all_reduce(part(u.grad, p.offset, p.numel()));
}

ZeroStore::~ZeroStore() {
  for (Gather& g : gathers_)
    if (g.request) g.request->wait();
  if (in_flight_) in_flight_->request.wait();
}

comm::Communicator* ZeroStore::group_of(const ParamUnit& u) const {
  if (u.shard.group_size == 1) return nullptr;
  comm::Communicator* c = u.expert ? expert_ : dense_;
  ORIGAMI_CHECK(c && c->size() == u.shard.group_size, "unit ", u.name, ": shard group of ", u.shard.group_size,
                " ranks, but the layout's group differs");
  return c;
}

void ZeroStore::begin_step() { params_.zero_grads(*ctx_); }

void ZeroStore::finish_gradients() {
  for (size_t i = 0; i < pending_weights_.size(); ++i)
    ORIGAMI_CHECK(pending_weights_[i] == 0, "unit ", params_.units()[i].name, ": ", pending_weights_[i],
                  " deferred weight pass(es) not run before finish_gradients (Model::weight_backward)");
  settle_reduce();
  if (!reshard_after_forward_) release_all();  // the optimizer updates the shards next
  for (ParamUnit& u : params_.units()) {
    if (u.shard.grads) continue;  // reduced per unit in backward
    reduce_replicated(u);
    comm::Communicator* c = group_of(u);
    if (!c) continue;
    const UnitShard& s = u.shard;
    if (!s.optim) {  // stage 0: every rank keeps the whole sum
      c->all_reduce(part(u.grad, 0, u.numel));
      continue;
    }
    // Stage 1: each rank needs only its slice of the sum.
    Tensor mine = ctx_->empty({s.size}, params_.param_dtype(), MemCategory::comm);
    c->reduce_scatter(part(u.grad, 0, s.padded), part(mine, 0, s.size));
    ctx_->copy(part(u.grad, s.begin, s.size), mine);
  }
}

void ZeroStore::finish_step() {
  for (ParamUnit& u : params_.units()) {
    comm::Communicator* c = group_of(u);
    if (!c || !u.shard.optim || u.shard.params) continue;
    // In place: this rank's slice already sits at its block of the whole.
    c->all_gather(part(u.param, u.shard.begin, u.shard.size),
                  part(u.param, 0, u.shard.padded));
  }
}

void ZeroStore::gather_all() {
  for (size_t i = 0; i < params_.units().size(); ++i)
    if (params_.units()[i].shard.params) ensure_gathered(i);
}

void ZeroStore::release_all() {
  for (size_t i = 0; i < params_.units().size(); ++i)
    if (gathers_[i].live) release(i);
}

// ---- stage 3 gathers ------------------------------------------------------------------------------

int ZeroStore::live_units() const {
  return static_cast<int>(std::count_if(gathers_.begin(), gathers_.end(), [](const Gather& g) { return g.live; }));
}

void ZeroStore::start_gather(size_t i) {
  ParamUnit& u = params_.units()[i];
  Gather& g = gathers_[i];
  u.param = ctx_->empty({u.shard.padded}, params_.param_dtype(), MemCategory::param);
  g.request.emplace(group_of(u)->all_gather_async(part(u.param_shard, 0, u.shard.size),
                                                  part(u.param, 0, u.shard.padded)));
  g.live = true;
  gathered_bytes_ += u.shard.padded * static_cast<int64_t>(dtype_size(params_.param_dtype()));
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
}

void ZeroStore::ensure_gathered(size_t i) {
  Gather& g = gathers_[i];
  if (!g.live) start_gather(i);
  if (g.request) {  // the compute stream waits for the prefetch (CUDA); the host waits (MPI)
    group_of(params_.units()[i])->complete(*g.request);
    g.request.reset();
  }
}

void ZeroStore::release(size_t i) {
  ParamUnit& u = params_.units()[i];
  Gather& g = gathers_[i];
  if (g.request) {
    group_of(u)->complete(*g.request);
    g.request.reset();
  }
  u.param = Tensor();
  g.live = false;
  gathered_bytes_ -= u.shard.padded * static_cast<int64_t>(dtype_size(params_.param_dtype()));
}

// The next sharded unit in execution order after `i` that is not whole yet,
// if fewer than two units are whole (when units are kept whole, if none is
// in flight).
void ZeroStore::prefetch_after(size_t i, bool forward) {
  if (reshard_after_forward_ ? live_units() >= 2
                             : std::any_of(gathers_.begin(), gathers_.end(), [](const Gather& g) { return g.request.has_value(); }))
    return;
  const auto& units = params_.units();
  for (size_t k = 1; k < units.size(); ++k) {
    if (!forward && k > i) return;
    const size_t j = forward ? i + k : i - k;
    if (j >= units.size()) return;
    if (!units[j].shard.params || gathers_[j].live) continue;
    start_gather(j);
    return;
  }
}

// ---- hooks ------------------------------------------------------------------------------------------

void ZeroStore::before_forward(size_t i) {
  if (!params_.units()[i].shard.params) return;
  ensure_gathered(i);
  prefetch_after(i, /*forward=*/true);
}

void ZeroStore::after_forward(size_t i) {
  if (!params_.units()[i].shard.params) return;
  if (reshard_after_forward_) release(i);
  prefetch_after(i, /*forward=*/true);
}

void ZeroStore::before_backward(size_t i, WeightGrads grads) {
  ParamUnit& u = params_.units()[i];
  if (u.shard.grads && grads == WeightGrads::fused)  // deferred: before_weight allocates it
    u.grad = ctx_->zeros({u.shard.padded}, params_.param_dtype(), MemCategory::grad);
  if (!u.shard.params) return;
  ensure_gathered(i);
  prefetch_after(i, /*forward=*/false);
}

void ZeroStore::after_backward(size_t i, WeightGrads grads) {
  ParamUnit& u = params_.units()[i];
  if (grads == WeightGrads::deferred) ++pending_weights_[i];
  if (u.shard.grads && grads == WeightGrads::fused) reduce_scatter_grad(u);  // deferred: after_weight does
  if (!u.shard.params) return;
  if (reshard_after_forward_) release(i);
  prefetch_after(i, /*forward=*/false);
}

// This micro-batch's whole gradient → the owners' slices, accumulated.
// With overlap_grad_reduce the sum waits in flight until the next unit's
// reduce-scatter (or finish_gradients): the same additions in the same order.
void ZeroStore::reduce_scatter_grad(ParamUnit& u) {
  reduce_replicated(u);
  settle_reduce();  // at most one in flight: per-unit accumulation order is kept
  Tensor mine = ctx_->empty({u.shard.size}, params_.param_dtype(), MemCategory::comm);
  comm::Request r = group_of(u)->reduce_scatter_async(part(u.grad, 0, u.shard.padded), part(mine, 0, u.shard.size));
  if (overlap_grad_reduce_) {
    in_flight_.emplace(InFlightReduce{&u, std::move(u.grad), std::move(mine), std::move(r)});
    u.grad = Tensor();
    return;
  }
  group_of(u)->complete(r);
  add_inplace(*ctx_, u.grad_shard, mine);
  u.grad = Tensor();
}

void ZeroStore::settle_reduce() {
  if (!in_flight_) return;
  // The compute stream waits (CUDA); the host waits (MPI: host memory).
  group_of(*in_flight_->unit)->complete(in_flight_->request);
  add_inplace(*ctx_, in_flight_->unit->grad_shard, in_flight_->mine);
  in_flight_.reset();  // the whole gradient goes; on CUDA later work on the compute stream is ordered after the wait
}

// A deferred W pass needs the gradient and no parameter: nothing gathered.
void ZeroStore::before_weight(size_t i) {
  ParamUnit& u = params_.units()[i];
  ORIGAMI_CHECK(pending_weights_[i] > 0, "unit ", u.name, ": a weight pass without a deferred backward before it");
  if (u.shard.grads) u.grad = ctx_->zeros({u.shard.padded}, params_.param_dtype(), MemCategory::grad);
}

void ZeroStore::after_weight(size_t i) {
  ParamUnit& u = params_.units()[i];
  --pending_weights_[i];
  if (u.shard.grads) reduce_scatter_grad(u);
}

}  // namespace origami
