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

class AdamW {
 public:
  AdamW(const OptimizerConfig& opt, const LrScheduleConfig& sched, int64_t total_steps)
      : opt_(opt), sched_(sched), total_steps_(total_steps) {}
  // One step on the accumulated (already reduced) gradients. Does not zero
  // them. expert_shards: the group whose ranks hold different experts or
  // expert slices (expert view tp-ep); the expert units' squared norms sum
  // over it so each element of the global model counts once. Dense units are
  // identical on every rank and count once as they are.
  StepStats step(ParamStore& params, comm::Communicator* expert_shards = nullptr);
  int64_t steps_taken() const { return step_; }

 private:
  OptimizerConfig opt_;
  LrScheduleConfig sched_;
  int64_t total_steps_;
  int64_t step_ = 0;
};

}  // namespace origami
