// Optimizer step (see optimizer.h).
#include "engine/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/adamw.h"
#include "kernels/elementwise.h"

namespace origami {

double learning_rate(const OptimizerConfig& opt, const LrScheduleConfig& sched, int64_t total_steps, int64_t step) {
  const int64_t W = sched.warmup_steps;
  if (W > 0 && step <= W) return opt.lr * static_cast<double>(step) / static_cast<double>(W);
  const int64_t end = sched.decay_steps > 0 ? sched.decay_steps : total_steps;
  if (end <= W) return opt.lr;
  const double p = std::clamp(static_cast<double>(step - W) / static_cast<double>(end - W), 0.0, 1.0);
  return sched.min_lr + (opt.lr - sched.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

StepStats AdamW::step(ParamStore& params, comm::Communicator* expert_shards) {
  ++step_;
  StepStats st;
  double dense_sq = 0, expert_sq = 0;
  for (const ParamUnit& u : params.units()) (u.expert ? expert_sq : dense_sq) += sum_squares(u.grad);
  if (expert_shards) expert_shards->all_reduce(std::span<double>(&expert_sq, 1));
  st.grad_norm = std::sqrt(dense_sq + expert_sq);
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when below 1.
  if (opt_.clip_grad > 0) {
    const double coef = opt_.clip_grad / (st.grad_norm + 1e-6);
    if (coef < 1.0) {
      st.clipped = true;
      for (ParamUnit& u : params.units()) scale_inplace(u.grad, static_cast<float>(coef));
    }
  }
  st.lr = learning_rate(opt_, sched_, total_steps_, step_);
  AdamWStep s;
  s.lr = static_cast<float>(st.lr);
  s.beta1 = static_cast<float>(opt_.beta1);
  s.beta2 = static_cast<float>(opt_.beta2);
  s.eps = static_cast<float>(opt_.eps);
  s.step = step_;
  for (ParamUnit& u : params.units()) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      s.weight_decay = u.params[i].weight_decay() ? static_cast<float>(opt_.weight_decay) : 0.0f;
      Tensor p = u.view_of(u.param, i), g = u.view_of(u.grad, i);
      Tensor m = u.view_of(u.exp_avg, i), v = u.view_of(u.exp_avg_sq, i);
      adamw_update(p, g, m, v, s);
    }
  }
  return st;
}

}  // namespace origami
