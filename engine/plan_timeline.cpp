// One pipeline rank's memory over one step, replayed (plan.h StageMemory):
// the stage's schedule walked op by op and, inside each op, unit by unit in
// the order engine/model.cpp opens them, with engine/zero.cpp's hooks and the
// saved activations each layer keeps or frees. Replaying rather than
// bounding gives the ledger's figures: a MoE layer's backward holds its two
// units whole (params and gradients) while the largest two units of the
// stage may never be whole together; a prefetch can keep a unit whole across
// ops (interleaved chunks); and the working buffers peak inside a backward,
// after the layers above have freed their activations.
// ZeRO rules (zero.h): stage 3 gathers a unit before its forward and its
// backward and (reshard_after_forward) frees it after each; the next sharded
// unit in execution order is prefetched while fewer than two are whole (kept
// whole: while no gather is in flight). Stages 2-3 allocate a unit's whole
// gradient before a fused backward (before a deferred backward's W pass
// instead) and reduce-scatter it after, into a receive buffer of the
// shard's size (category comm); with overlap_grad_reduce that pair stays
// until the next unit's reduce-scatter. Stage 1 reduce-scatters every whole
// gradient at the step's end, one unit at a time.
// Inside a B op, each layer's backward adds its busiest moment's buffers
// (ActivationBytes::backward_*) and, under recompute "full", its rebuilt
// saved set. Not replayed: kernel workspaces, a step's scalars, and what a
// forward allocates and frees inside a layer (less than a backward's).
#include "engine/plan_internal.h"

#include <algorithm>
#include <optional>
#include <string>

#include "engine/pipeline.h"
#include "engine/zero.h"
#include "kernels/check.h"

namespace origami::plan::internal {

namespace {

class Replay {
 public:
  Replay(const PlanInput& in, const std::vector<const UnitPlan*>& units) : in_(in) {
    const RecipeBytes rb = recipe_bytes(in.recipe);
    for (const UnitPlan* u : units) {
      const bool multi = u->group > 1;
      unit_.push_back({multi && in.zero_stage >= 3, multi && in.zero_stage >= 2, multi && in.zero_stage == 1,
                       u->padded * rb.param, u->padded * rb.grad,
                       u->padded / std::max<int64_t>(1, u->group) * rb.param});
    }
    live_.assign(unit_.size(), false);
    request_.assign(unit_.size(), false);
  }

  void before_forward(size_t i) {
    if (!unit_[i].params) return;
    ensure_gathered(i);
    prefetch_after(i, Direction::forward);
  }
  void after_forward(size_t i) {
    if (!unit_[i].params) return;
    if (in_.reshard_after_forward) release(i);
    prefetch_after(i, Direction::forward);
  }
  void before_backward(size_t i, WeightGrads grads) {
    if (unit_[i].grads && grads == WeightGrads::fused) add(grad_, unit_[i].grad_bytes);
    if (!unit_[i].params) return;
    ensure_gathered(i);
    prefetch_after(i, Direction::backward);
  }
  void after_backward(size_t i, WeightGrads grads) {
    if (unit_[i].grads && grads == WeightGrads::fused) reduce_scatter(i);
    if (!unit_[i].params) return;
    if (in_.reshard_after_forward) release(i);
    prefetch_after(i, Direction::backward);
  }
  void before_weight(size_t i) {
    if (unit_[i].grads) add(grad_, unit_[i].grad_bytes);
  }
  void after_weight(size_t i) {
    if (unit_[i].grads) reduce_scatter(i);
  }
  // ZeroStore::finish_gradients: the last reduce-scatter lands; units kept
  // whole are freed; stage 1 reduce-scatters each whole gradient.
  void finish_gradients() {
    settle();
    if (!in_.reshard_after_forward)
      for (size_t i = 0; i < unit_.size(); ++i)
        if (live_[i]) release(i);
    for (const Unit& u : unit_)
      if (u.stage1) transient(comm_, u.shard_bytes);
  }
  // Saved activations (or W operands) kept or freed.
  void activations(int64_t bytes) { add(act_, bytes); }
  // Activation bytes allocated and freed inside one op.
  void transient(int64_t bytes) { transient(act_, bytes); }
  int64_t held() const { return act_; }
  ZeroWorking peaks() const { return peak_; }
  int64_t live_peak() const { return live_peak_; }

 private:
  struct Unit {
    bool params, grads, stage1;
    int64_t param_bytes, grad_bytes, shard_bytes;
  };
  const PlanInput& in_;
  std::vector<Unit> unit_;  // the stage's units in table order
  std::vector<bool> live_, request_;
  int live_count_ = 0, request_count_ = 0;
  std::optional<size_t> in_flight_;  // overlap_grad_reduce: the unit whose whole gradient is still on the wire
  int64_t param_ = 0, grad_ = 0, comm_ = 0, act_ = 0;
  ZeroWorking peak_;
  int64_t live_peak_ = 0;  // of working buffers + activations

  enum class Direction { forward, backward };  // of the prefetch walk
  void transient(int64_t& category, int64_t bytes) {
    add(category, bytes);
    add(category, -bytes);
  }
  void add(int64_t& category, int64_t bytes) {
    category += bytes;
    peak_.param = std::max(peak_.param, param_);
    peak_.grad = std::max(peak_.grad, grad_);
    peak_.comm = std::max(peak_.comm, comm_);
    peak_.total = std::max(peak_.total, param_ + grad_ + comm_);
    live_peak_ = std::max(live_peak_, param_ + grad_ + comm_ + act_);
  }
  void start_gather(size_t i) {
    live_[i] = true;
    request_[i] = true;
    ++live_count_;
    ++request_count_;
    add(param_, unit_[i].param_bytes);
  }
  void complete_request(size_t i) {
    if (!request_[i]) return;
    request_[i] = false;
    --request_count_;
  }
  void ensure_gathered(size_t i) {
    if (!live_[i]) start_gather(i);
    complete_request(i);
  }
  void release(size_t i) {
    complete_request(i);
    live_[i] = false;
    --live_count_;
    add(param_, -unit_[i].param_bytes);
  }
  void prefetch_after(size_t i, Direction direction) {
    if (in_.reshard_after_forward ? live_count_ >= 2 : request_count_ > 0) return;
    const bool forward = direction == Direction::forward;
    for (size_t k = 1; k < unit_.size(); ++k) {
      if (!forward && k > i) return;
      const size_t j = forward ? i + k : i - k;
      if (j >= unit_.size()) return;
      if (!unit_[j].params || live_[j]) continue;
      start_gather(j);
      return;
    }
  }
  void settle() {
    if (!in_flight_) return;
    add(comm_, -unit_[*in_flight_].shard_bytes);
    add(grad_, -unit_[*in_flight_].grad_bytes);
    in_flight_.reset();
  }
  void reduce_scatter(size_t i) {
    settle();
    add(comm_, unit_[i].shard_bytes);
    if (in_.overlap_grad_reduce) {
      in_flight_ = i;
      return;
    }
    add(comm_, -unit_[i].shard_bytes);
    add(grad_, -unit_[i].grad_bytes);
  }
};

}  // namespace

void replay_stage(const PlanInput& in, const std::vector<UnitPlan>& units, const ActivationBytes& act, int64_t pp,
                  const PipeScheduleSpec& schedule, const std::vector<int64_t>* boundary, StageMemory& st) {
  // The stage's units in table order (the ParamStore's, which prefetch walks).
  std::vector<const UnitPlan*> mine;
  for (const UnitPlan& u : units)
    if (u.stage == st.stage) mine.push_back(&u);
  std::optional<size_t> embedding, final;
  std::vector<std::optional<size_t>> layer_unit(static_cast<size_t>(in.model.num_layers)),
      expert_unit(static_cast<size_t>(in.model.num_layers));
  for (size_t i = 0; i < mine.size(); ++i) {
    const UnitPlan& u = *mine[i];
    if (u.layer >= 0) (u.expert ? expert_unit : layer_unit)[static_cast<size_t>(u.layer)] = i;
    if (u.name == "embedding") embedding = i;
    if (u.name == "final") final = i;
  }
  // A layer's units in the order Model opens them for forward: the layer's,
  // then its experts' (backward and W: the reverse).
  const auto layer_units = [&](int64_t l) {
    std::vector<size_t> u{layer_unit[static_cast<size_t>(l)].value()};
    if (const std::optional<size_t> e = expert_unit[static_cast<size_t>(l)]) u.push_back(*e);
    return u;
  };
  const int64_t v = static_cast<int64_t>(st.chunk_layers.size());
  const bool first_rank = st.stage == 0, last_rank = st.stage == pp - 1;
  const bool deferred = in.pp_schedule == PipeSchedule::zb_h1;  // B leaves the weight gradients to a W op
  const WeightGrads grads = deferred ? WeightGrads::deferred : WeightGrads::fused;
  const auto saved = [&](int64_t l) { return in.moe.is_moe_layer(l) ? act.moe_layer : act.dense_layer; };
  const auto rebuilt = [&](int64_t l) {
    return in.moe.is_moe_layer(l) ? act.rebuild_moe_layer : act.rebuild_dense_layer;
  };
  const auto pending = [&](int64_t l) {
    return in.moe.is_moe_layer(l) ? act.weight_pending_moe_layer : act.weight_pending_dense_layer;
  };

  Replay z(in, mine);
  int64_t in_flight = 0, pending_w = 0;
  st.activations = st.in_flight = st.pending_w = 0;
  const std::vector<PipeOp> ops = pipeline_schedule(schedule, st.stage);
  ORIGAMI_CHECK(!boundary || boundary->size() == ops.size(), "replay: ", boundary ? boundary->size() : 0,
                " boundary counts for ", ops.size(), " ops");
  for (size_t k = 0; k < ops.size(); ++k) {
    const PipeOp& op = ops[k];
    // The pipeline's receives posted ahead and sends in flight, beside the op.
    const int64_t wire = boundary ? (*boundary)[k] * act.grad_stream : 0;
    z.activations(wire);
    const int64_t c = op.chunk, first = st.chunk_first[static_cast<size_t>(c)];
    const int64_t end = first + st.chunk_layers[static_cast<size_t>(c)];
    const bool with_embedding = first_rank && c == 0 && embedding, with_final = last_rank && c == v - 1 && final;
    switch (op.kind) {
      case PipeOp::forward:
        ++in_flight;
        z.activations(act.every_stage + (with_embedding ? act.first_stage : 0));
        if (with_embedding) {
          z.before_forward(*embedding);
          z.after_forward(*embedding);
        }
        for (int64_t l = first; l < end; ++l) {
          const std::vector<size_t> u = layer_units(l);
          for (size_t i : u) z.before_forward(i);
          z.activations(saved(l));
          for (size_t i : u) z.after_forward(i);
        }
        if (with_final) {
          z.before_forward(*final);
          z.activations(act.last_stage);
          z.after_forward(*final);
        }
        break;
      case PipeOp::backward:
        --in_flight;
        if (deferred) ++pending_w;
        if (with_final) {
          z.before_backward(*final, grads);
          z.transient(act.backward_last_stage);
          // The logits go and the rest of the head's and final norm's saved
          // tensors at the op's end; deferred, the W operands (the logits
          // among them) take the place of them all at once.
          z.activations(deferred ? act.weight_pending_last_stage - act.last_stage : -act.last_stage_logits);
          z.after_backward(*final, grads);
        }
        z.activations(act.grad_stream);
        for (int64_t l = end - 1; l >= first; --l) {
          std::vector<size_t> u = layer_units(l);
          std::reverse(u.begin(), u.end());
          for (size_t i : u) z.before_backward(i, grads);
          // Recompute "full": the layer's forward runs again first, its
          // saved set (the kept input among it) alive through its backward.
          z.activations(rebuilt(l) - (rebuilt(l) > 0 ? saved(l) : 0));
          z.transient(in.moe.is_moe_layer(l) ? act.backward_moe(l) : act.backward_dense_layer);
          z.activations(-(rebuilt(l) > 0 ? rebuilt(l) : saved(l)) + (deferred ? pending(l) : 0));
          for (size_t i : u) z.after_backward(i, grads);
        }
        if (with_embedding) {
          z.before_backward(*embedding, grads);
          z.activations(deferred ? act.weight_pending_first_stage : 0);
          z.after_backward(*embedding, grads);
        }
        z.activations(-act.grad_stream - act.every_stage - (with_embedding ? act.first_stage : 0) -
                      (with_final && !deferred ? act.last_stage - act.last_stage_logits : 0));
        break;
      case PipeOp::weight:  // the steps in the order the B pass added them
        --pending_w;
        if (with_final) {
          z.before_weight(*final);
          z.activations(-act.weight_pending_last_stage);
          z.after_weight(*final);
        }
        for (int64_t l = end - 1; l >= first; --l) {
          std::vector<size_t> u = layer_units(l);
          std::reverse(u.begin(), u.end());
          for (size_t i : u) z.before_weight(i);
          z.activations(-pending(l));
          for (size_t i : u) z.after_weight(i);
        }
        if (with_embedding) {
          z.before_weight(*embedding);
          z.activations(-act.weight_pending_first_stage);
          z.after_weight(*embedding);
        }
        break;
    }
    z.activations(-wire);
    st.activations = std::max(st.activations, z.held());
    st.in_flight = std::max(st.in_flight, in_flight);
    st.pending_w = std::max(st.pending_w, pending_w);
  }
  z.finish_gradients();
  st.zero = z.peaks();
  st.live = z.live_peak();
}

}  // namespace origami::plan::internal
