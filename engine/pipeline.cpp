// Pipeline stages and the 1F1B schedule (see pipeline.h).
#include "engine/pipeline.h"

#include <algorithm>
#include <chrono>

#include "engine/plan.h"
#include "kernels/check.h"

namespace origami {

PipelineStage pipeline_stage(int64_t num_layers, int64_t pp, int64_t index, const std::vector<int64_t>& pp_layers) {
  ORIGAMI_CHECK(pp >= 1 && index >= 0 && index < pp, "pipeline stage ", index, " of ", pp);
  const std::vector<int64_t> per_stage = plan::stage_layers(num_layers, pp, pp_layers);
  PipelineStage s;
  s.index = index;
  s.count = pp;
  for (int64_t i = 0; i < index; ++i) s.first_layer += per_stage[i];
  s.end_layer = s.first_layer + per_stage[index];
  return s;
}

int stage_root_rank(const comm::Groups& groups) {
  const comm::RankGroup roots = groups.layout().group_of(comm::GroupKind::pp, 0);
  return roots.at(static_cast<size_t>(groups.coords().pp));
}

std::vector<PipeOp> one_f_one_b(int64_t stage, int64_t stages, int64_t m) {
  ORIGAMI_CHECK(stages >= 1 && stage >= 0 && stage < stages && m >= 1, "1F1B: stage ", stage, " of ", stages, ", ",
                m, " micro-batches");
  const int64_t warmup = std::min(stages - stage - 1, m);
  std::vector<PipeOp> ops;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back({PipeOp::forward, f});
  for (; f < m; ++f, ++b) {
    ops.push_back({PipeOp::forward, f});
    ops.push_back({PipeOp::backward, b});
  }
  for (; b < m; ++b) ops.push_back({PipeOp::backward, b});
  return ops;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A boundary tensor on the wire; the tensor lives until the request completes.
struct Transfer {
  Tensor data;
  comm::Request request;
};

}  // namespace

// Megatron's pattern: each op's outgoing send is posted together with the
// next op's receive and both complete before the next compute. Waiting for
// the send matters on MPI transports without single-copy: there a large
// message moves only while its sender is inside MPI, so a send left in
// flight across a compute would stall the receiving stage. Posting the pair first keeps it deadlock-free (the two
// neighbours' matching operations are posted before either waits).
StageTiming run_one_f_one_b(comm::Communicator* pp, int64_t micro_batches, const Shape& boundary,
                            const StageForward& forward, const StageBackward& backward) {
  const int64_t stage = comm::group_rank(pp), stages = comm::group_size(pp);
  const bool first = stage == 0, last = stage == stages - 1;
  const std::vector<PipeOp> ops = one_f_one_b(stage, stages, micro_batches);
  StageTiming t;
  // The receive an op needs: activations from the previous stage for a
  // forward (none on the first), gradients from the next for a backward
  // (none on the last).
  auto post_receive = [&](const PipeOp& op) -> Transfer {
    const bool fwd = op.kind == PipeOp::forward;
    if (fwd ? first : last) return {};
    Tensor x = Tensor::empty(boundary, DType::f32, MemCategory::activation);
    comm::Request r = pp->recv_async(x, static_cast<int>(fwd ? stage - 1 : stage + 1), fwd ? kActivationTag : kGradientTag);
    return {std::move(x), std::move(r)};
  };
  auto wait = [&](comm::Request& r) {
    const auto t0 = Clock::now();
    r.wait(/*sleep_when_idle=*/true);
    t.idle_s += seconds_since(t0);
  };

  Transfer incoming = post_receive(ops.front());
  for (size_t k = 0; k < ops.size(); ++k) {
    const PipeOp& op = ops[k];
    const bool fwd = op.kind == PipeOp::forward;
    wait(incoming.request);
    const auto t0 = Clock::now();
    Tensor out = fwd ? forward(op.micro_batch, std::move(incoming.data)) : backward(op.micro_batch, std::move(incoming.data));
    t.busy_s += seconds_since(t0);
    Transfer outgoing;
    if (fwd ? !last : !first) {
      ORIGAMI_CHECK(out.defined() && out.shape() == boundary, "pipeline stage ", stage, ": boundary tensor of shape ",
                    out.defined() ? shape_string(out.shape()) : "(none)", ", expected ", shape_string(boundary));
      comm::Request r = pp->send_async(out, static_cast<int>(fwd ? stage + 1 : stage - 1),
                                       fwd ? kActivationTag : kGradientTag);
      outgoing = {std::move(out), std::move(r)};
    }
    incoming = k + 1 < ops.size() ? post_receive(ops[k + 1]) : Transfer{};
    wait(outgoing.request);
  }
  // Flush: a stage is idle until the whole pipeline has drained (the last
  // stages finish first), which is what makes every stage's idle share the
  // bubble (p − 1)/(m + p − 1) when stages are equal.
  if (pp) {
    comm::Request drained = pp->barrier_async();
    wait(drained);
  }
  return t;
}

}  // namespace origami
