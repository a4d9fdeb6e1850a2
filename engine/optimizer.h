// Optimizer step over the parameter store: global grad-norm clipping
// (torch.nn.utils.clip_grad_norm_ semantics), then AdamW per tensor (weight
// decay on tensors of rank >= 2 only), and the LR schedule.
#pragma once
#include "comm/communicator.h"
#include "engine/config.h"
#include "engine/params.h"

namespace origami {

// LR at 1-based optimizer step t: linear warmup lr·t/W for t <= W, then cosine
// from lr to min_lr over (W, decay_end]: p = (t − W)/(decay_end − W) clamped to
// [0, 1], lr_t = min_lr + (lr − min_lr)·(1 + cos(π p))/2. decay_end =
// lr_schedule.decay_steps, or training.steps when 0.
double learning_rate(const OptimizerConfig& opt, const LrScheduleConfig& sched, int64_t total_steps, int64_t step);

struct StepStats {
  double grad_norm = 0;  // before clipping
  double lr = 0;
  bool clipped = false;
};

// Where the squared gradient norm is summed (AdamW::step); null: not needed.
struct GradNormGroups {
  comm::Communicator* dense_shards = nullptr;   // dp-cp
  comm::Communicator* expert_shards = nullptr;  // edp
  comm::Communicator* expert_model = nullptr;   // tp-ep
  comm::Communicator* tp = nullptr;             // dense slices; tp-replicated params count on tp rank 0
  comm::Communicator* pp = nullptr;             // pipeline stages: each holds its own layers
};

class AdamW {
 public:
  AdamW(const OptimizerConfig& opt, const LrScheduleConfig& sched, int64_t total_steps)
      : opt_(opt), sched_(sched), total_steps_(total_steps) {}
  // One step on the accumulated, reduced gradients, over each unit's owned
  // slice (UnitShard: the whole unit unless ZeRO shards it). Does not zero
  // them. The squared grad norm is summed so every element of the global
  // model counts once: over `groups.dense_shards` (dp-cp) and
  // `groups.expert_shards` (edp) for ZeRO-sharded units, then the expert part
  // over `groups.expert_model` (tp-ep: ranks holding different experts).
  StepStats step(const ExecContext& ctx, ParamStore& params, const GradNormGroups& groups = {}) {
    return update(ctx, params, grad_norm(ctx, params, groups));
  }
  // The two halves of step(), so a caller can look at the norm (and the
  // loss) before anything changes: the global norm of the accumulated
  // gradients before clipping (collective over `groups`), then clipping by
  // that norm and the AdamW update, which advances the step count.
  double grad_norm(const ExecContext& ctx, const ParamStore& params, const GradNormGroups& groups = {}) const;
  StepStats update(const ExecContext& ctx, ParamStore& params, double grad_norm);
  int64_t steps_taken() const { return step_; }
  // A resumed run's position: the steps its checkpoint had taken (the
  // moments themselves live in the ParamStore).
  void restore_steps(int64_t steps) { step_ = steps; }

 private:
  OptimizerConfig opt_;
  LrScheduleConfig sched_;
  int64_t total_steps_;
  int64_t step_ = 0;
};

}  // namespace origami
