// ZeRO over the parameter store (ARCHITECTURE.md §6). Units shard over their
// group — dense units over dp-cp, expert units over edp — by stage:
//   0  everything whole; gradients all-reduced once per step.
//   1  moments sharded; gradients reduce-scattered once per step, each rank
//      updates its slice, then parameters all-gathered.
//   2  + gradients sharded: each unit's whole gradient exists only during its
//      backward and is reduce-scattered into the owned slice right after it
//      (once per micro-batch when accumulating), then the step as in 1.
//   3  + parameters sharded: a unit is all-gathered just before its forward
//      and again before its backward and freed after each; the next unit in
//      execution order is gathered asynchronously meanwhile, never keeping
//      more than two units whole at once (the one computing and the one in
//      flight).
// With reshard_after_forward = false (parallel.reshard_after_forward), a
// stage-3 unit once gathered stays whole until finish_gradients: one gather
// per unit and step instead of two per micro-batch, at the memory of every
// unit of the rank (pipeline stage) whole.
// Per step and unit, stages 0-2 move 2·(N−1)/N of the unit's bytes per rank
// and stage 3 (one micro-batch) 3·(N−1)/N: the 1.5× of the ZeRO paper.
//
// Precision of gradients: in the bf16 recipe they are bf16, the 2 bytes per
// parameter of §6's budget (2 + 2 + 4 + 8). A micro-batch's weight GEMMs
// add into them (beta = 1, fp32 inside the GEMM, rounded once per
// micro-batch), and the dp-cp / edp reductions run on bf16 (a sum rounded
// to bf16 at each hop of the ring); only the owned slice meets fp32, in the
// AdamW update against the fp32 master. Megatron keeps an fp32 main_grad
// instead (4 bytes, 18 per parameter at stage 0): more exact with many
// micro-batches or a large group, at 2 more bytes per parameter than this
// budget. The CUDA bf16 run is held to the fp32 CPU run within 2e-2
// (tests/test_cli_cuda.cpp).
//
// Gradients of tp-replicated parameters (norms, router, shared expert) are
// first summed over tp (each tp rank saw only its sequence shard): once per
// step at stages 0-1, per unit and micro-batch at stages 2-3.
//
// `origami plan` replays these rules to predict the ledger
// (engine/plan_timeline.cpp): a change here changes it too.
//
// The model calls the UnitHooks around each unit's use; the trainer calls
// begin_step / finish_gradients / the optimizer / finish_step. A unit whose
// group has one rank is never sharded, so one rank pays nothing.
//
// Split backward (zero-bubble schedules, engine/model.h WeightPass): the
// input-gradient pass B runs before_backward / after_backward with
// WeightGrads::deferred — stage 3 gathers and frees the unit's params as
// always, but no gradient buffer is allocated and nothing is reduced — and
// the unit's weight-gradient pass W later runs between before_weight (stages
// 2-3 allocate the whole gradient) and after_weight (the tp sum of
// replicated gradients and the reduce-scatter into the owned slice, what
// after_backward does for a fused backward). W reads no parameter, so it
// gathers none. Every rank of a shard group runs its W passes in the same
// order (they are collectives at stages 2-3); at stages 0-1 W accumulates
// into the persistent gradients, so all of a step's W passes end before
// finish_gradients.
#pragma once
#include <optional>
#include <vector>

#include "comm/groups.h"
#include "engine/params.h"

namespace origami {

// What a unit's backward computes: both gradients (fused), or only the
// input gradient, its weight gradients following in a W pass (deferred).
enum class WeightGrads { fused, deferred };

// Called by the model around each unit's use, in execution order: forward
// visits units in registration order, backward in reverse, a deferred W pass
// in its backward's order. A unit may be live together with the one before
// it (a MoE layer uses its dense unit's router and norm around its experts).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(size_t unit) = 0;
  virtual void after_forward(size_t unit) = 0;
  virtual void before_backward(size_t unit, WeightGrads grads) = 0;
  virtual void after_backward(size_t unit, WeightGrads grads) = 0;
  // Around a unit's deferred weight gradients (after its deferred backward).
  virtual void before_weight(size_t unit) {}
  virtual void after_weight(size_t unit) {}
};

// The shard layout ParamStore::allocate should use for `stage` and groups
// (null groups: nothing sharded).
std::function<UnitShard(const ParamUnit&)> zero_shard_plan(int stage, const comm::Groups* groups);

// parallel.reshard_after_forward and parallel.overlap_grad_reduce.
struct ZeroOptions {
  // false: ZeRO-3 units gathered in forward stay whole until the step ends.
  bool reshard_after_forward = true;
  // Stages 2-3 keep one unit's reduce-scatter in flight while the next
  // unit's backward computes (settled before the next one starts and in
  // finish_gradients; on CUDA the compute stream, not the host, waits for
  // it), at the memory of a second whole gradient.
  bool overlap_grad_reduce = false;
};

class ZeroStore final : public UnitHooks {
 public:
  // ctx runs the gradient sums; it must outlive the store.
  ZeroStore(const ExecContext& ctx, ParamStore& params, const comm::Groups& groups, const ZeroOptions& options = {});
  ~ZeroStore() override;

  // Zero the gradient accumulators for a new step.
  void begin_step();
  // After the last micro-batch (and every deferred W pass: checked): stage 0
  // all-reduces whole gradients, stage 1 reduce-scatters them into each
  // rank's slice (stages 2-3 did it per unit); units kept whole
  // (reshard_after_forward = false) are freed.
  void finish_gradients();
  // After the optimizer: stages 1-2 all-gather the updated slices.
  void finish_step();
  // Gathers every unit whole (stage 3), e.g. for export; release_all() undoes it.
  void gather_all();
  void release_all();

  void before_forward(size_t unit) override;
  void after_forward(size_t unit) override;
  void before_backward(size_t unit, WeightGrads grads) override;
  void after_backward(size_t unit, WeightGrads grads) override;
  void before_weight(size_t unit) override;
  void after_weight(size_t unit) override;

  // Bytes of ZeRO-3 parameters whole at once: now, and the peak since reset.
  int64_t gathered_bytes() const { return gathered_bytes_; }
  int64_t peak_gathered_bytes() const { return peak_gathered_bytes_; }
  void reset_peak_gathered() { peak_gathered_bytes_ = gathered_bytes_; }

 private:
  comm::Communicator* group_of(const ParamUnit& u) const;
  void ensure_gathered(size_t unit);
  void start_gather(size_t unit);
  void release(size_t unit);
  void prefetch_after(size_t unit, bool forward);
  int live_units() const;

  const ExecContext* ctx_;
  ParamStore& params_;
  comm::Communicator* dense_ = nullptr;   // dp-cp
  comm::Communicator* expert_ = nullptr;  // edp
  comm::Communicator* tp_ = nullptr;      // sums the tp-replicated params' gradients
  bool reshard_after_forward_ = true;
  void reduce_replicated(ParamUnit& u);
  void reduce_scatter_grad(ParamUnit& u);  // stages 2-3: whole grad → owned slice, freed
  void settle_reduce();                    // overlap_grad_reduce: the one in flight, accumulated
  bool overlap_grad_reduce_ = false;
  // The reduce-scatter in flight: its unit's whole gradient (the send
  // buffer, kept alive until it completes) and the owned slice it sums into.
  struct InFlightReduce {
    ParamUnit* unit = nullptr;
    Tensor whole, mine;
    comm::Request request;
  };
  std::optional<InFlightReduce> in_flight_;
  struct Gather {
    bool live = false;          // param buffer allocated (gathered or in flight)
    std::optional<comm::Request> request;  // in flight
  };
  std::vector<Gather> gathers_;
  std::vector<int> pending_weights_;  // per unit: deferred backwards whose W has not run yet
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0;
};

}  // namespace origami
