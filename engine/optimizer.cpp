// Optimizer step (see optimizer.h).
#include "engine/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

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

namespace {

// The owned elements of a unit: [lo, hi) of its flat index space (padding excluded).
std::pair<int64_t, int64_t> owned(const ParamUnit& u) {
  return {u.shard.begin, std::min(u.shard.begin + u.shard.size, u.numel)};
}
// The reduced gradient of the owned elements.
Tensor owned_grad(const ParamUnit& u) {
  auto [lo, hi] = owned(u);
  const int64_t n = std::max<int64_t>(0, hi - lo);
  return u.shard.grads ? u.grad_shard.flat_view(0, n, {n}) : u.grad.flat_view(lo, n, {n});
}

}  // namespace

double AdamW::grad_norm(const ExecContext& ctx, const ParamStore& params, const GradNormGroups& groups) const {
  // Σ g² of the dense and the expert parameters, summed on the device in
  // parameter order and read once (a read per parameter would be a stream
  // sync each on a GPU); the same sums, added in the same order, as on the host.
  Tensor sq_2 = ctx.zeros({2}, DType::f64, MemCategory::workspace);
  Tensor sq_of[2] = {sq_2.slice(0, 1), sq_2.slice(1, 1)};  // dense, expert
  bool sharded[2] = {false, false};
  const bool skip_replicated = groups.tp && groups.tp->rank() != 0;
  for (const ParamUnit& u : params.units()) {
    sharded[u.expert] = sharded[u.expert] || u.shard.optim;
    auto [lo, hi] = owned(u);
    const Tensor g = owned_grad(u);
    // One sum per run of adjacent counted parameters (a whole unit unless
    // tp-replicated ones are skipped): a DeepSeek-like expert unit holds
    // 192 parameters, and a sum per parameter was two launches each.
    int64_t run_lo = -1, run_hi = -1;  // [run_lo, run_hi): the run so far, none at -1
    const auto flush = [&] {
      const int64_t n = run_hi - run_lo;
      if (n > 0) sum_squares_add(ctx, g.flat_view(run_lo - lo, n, {n}), sq_of[u.expert]);
      run_lo = run_hi = -1;
    };
    for (const ParamInfo& p : u.params) {
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel());
      if (a >= b) continue;
      if (skip_replicated && p.tp_replicated) {
        flush();
        continue;
      }
      if (run_hi != a) {
        flush();
        run_lo = a;
      }
      run_hi = b;
    }
    flush();
  }
  const Tensor sq_host = ctx.to(sq_2, Device::cpu());
  const double* sq_read = sq_host.data<double>();
  double sq[2] = {sq_read[0], sq_read[1]};
  if (sharded[0] && groups.dense_shards) groups.dense_shards->all_reduce(std::span<double>(&sq[0], 1));
  if (groups.tp) groups.tp->all_reduce(std::span<double>(&sq[0], 1));
  if (sharded[1] && groups.expert_shards) groups.expert_shards->all_reduce(std::span<double>(&sq[1], 1));
  if (groups.expert_model) groups.expert_model->all_reduce(std::span<double>(&sq[1], 1));
  if (groups.pp) groups.pp->all_reduce(std::span<double>(sq, 2));
  return std::sqrt(sq[0] + sq[1]);
}

StepStats AdamW::update(const ExecContext& ctx, ParamStore& params, double grad_norm) {
  ++step_;
  StepStats st;
  st.grad_norm = grad_norm;
  // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when below 1.
  float clip = 1.0f;
  if (opt_.clip_grad > 0) {
    const double coef = opt_.clip_grad / (st.grad_norm + 1e-6);
    if (coef < 1.0) {
      st.clipped = true;
      clip = static_cast<float>(coef);
    }
  }
  st.lr = learning_rate(opt_, sched_, total_steps_, step_);
  AdamWStep s;
  s.lr = static_cast<float>(st.lr);
  s.beta1 = static_cast<float>(opt_.beta1);
  s.beta2 = static_cast<float>(opt_.beta2);
  s.eps = static_cast<float>(opt_.eps);
  s.step = step_;
  // One fused call per unit (kernels/adamw.h): the clip, the update and the
  // bf16 working copy, over the unit's owned range in runs of one weight decay.
  std::vector<AdamWSegment> segments;
  for (ParamUnit& u : params.units()) {
    auto [lo, hi] = owned(u);
    const int64_t n = hi - lo;
    if (n <= 0) continue;
    segments.clear();
    for (const ParamInfo& p : u.params) {  // contiguous in order (params.h), so the runs tile [lo, hi)
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel());
      if (a >= b) continue;
      const float wd = p.weight_decay() ? static_cast<float>(opt_.weight_decay) : 0.0f;
      if (!segments.empty() && segments.back().weight_decay == wd)
        segments.back().numel += b - a;
      else
        segments.push_back({a - lo, b - a, wd});
    }
    // The owned range of each buffer: shards hold it from 0, whole buffers at lo.
    const int64_t pbase = u.shard.params ? lo : 0, mbase = u.shard.optim ? lo : 0;
    Tensor p = (u.shard.params ? u.param_shard : u.param).flat_view(lo - pbase, n, {n});
    Tensor g = owned_grad(u);
    Tensor m = u.exp_avg.flat_view(lo - mbase, n, {n});
    Tensor v = u.exp_avg_sq.flat_view(lo - mbase, n, {n});
    if (!u.master.defined()) {  // fp32: the params are the master weights
      Tensor none;
      adamw_update_fused(ctx, p, g, m, v, none, segments, clip, s);
      continue;
    }
    // bf16: the fp32 master takes the step (from the bf16 gradient, widened
    // exactly), the working copy is the master rounded.
    Tensor master = u.master.flat_view(lo - mbase, n, {n});
    adamw_update_fused(ctx, master, g, m, v, p, segments, clip, s);
  }
  return st;
}

}  // namespace origami
