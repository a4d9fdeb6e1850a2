// Pipeline parallelism (ARCHITECTURE.md §7): which layers a stage runs, the
// 1F1B schedule, and the loop that runs one step of it over the `pp` group.
//
// A stage's ranks all run the same schedule (the stage index is the only
// input besides the stage and micro-batch counts), so every collective inside
// a forward or backward (tp, cp, ep, etp, ZeRO) is issued in the same order on
// every rank of its group. Boundary tensors go stage s → s+1 (activations,
// tag kActivationTag) and s+1 → s (their gradients, kGradientTag); each
// direction carries one kind in micro-batch order, so a receive always
// matches the send the schedule meant.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "comm/groups.h"
#include "kernels/tensor.h"

namespace origami {

// The layers stage `index` of `count` runs: [first_layer, end_layer). Stage 0
// also owns the embedding, the last stage the final norm, head and loss.
struct PipelineStage {
  int64_t index = 0, count = 1;
  int64_t first_layer = 0, end_layer = 0;
  bool first() const { return index == 0; }
  bool last() const { return index == count - 1; }
  bool owns_layer(int64_t l) const { return l >= first_layer && l < end_layer; }
};

// Stage `index` of `pp` under `pp_layers` (layers per stage; empty: even
// split with the first num_layers % pp stages one layer longer — the rule of
// plan::stage_layers, which validates an explicit list).
PipelineStage pipeline_stage(int64_t num_layers, int64_t pp, int64_t index, const std::vector<int64_t>& pp_layers = {});

// The first rank of this rank's stage (every coordinate 0 but pp): it
// gathers the stage's weights for export. Stage roots form world rank 0's pp
// group, in stage order.
int stage_root_rank(const comm::Groups& groups);

// One entry of a stage's schedule.
struct PipeOp {
  enum Kind { forward, backward } kind;
  int64_t micro_batch;
  bool operator==(const PipeOp&) const = default;
};

// 1F1B (PipeDream-flush, Megatron's non-interleaved schedule) for `stage` of
// `stages` with m micro-batches: warm-up of min(stages − stage − 1, m)
// forwards, then alternate one forward and one backward, then cool-down
// backwards. Stage s never holds more than min(stages − s, m) micro-batches'
// activations.
std::vector<PipeOp> one_f_one_b(int64_t stage, int64_t stages, int64_t micro_batches);

// Where a stage's time went in one step's schedule: busy inside forward and
// backward (their own collectives included), idle waiting on the pipeline's
// receives, the final sends and the flush (every stage waits until the
// pipeline has drained). In a balanced pipeline with a core per rank every
// stage's idle fraction is the bubble (p − 1) / (m + p − 1); ranks sharing
// cores run the steady state slower than the fill and drain, which lowers it.
struct StageTiming {
  double busy_s = 0, idle_s = 0;
  double idle_fraction() const { return busy_s + idle_s > 0 ? idle_s / (busy_s + idle_s) : 0.0; }
};

// A stage's forward of one micro-batch: takes the previous stage's output
// (undefined on the first stage), returns its own (undefined on the last).
using StageForward = std::function<Tensor(int64_t micro_batch, Tensor h_in)>;
// A stage's backward: takes the gradient of its output (undefined on the last
// stage), returns the gradient of its input (undefined on the first).
using StageBackward = std::function<Tensor(int64_t micro_batch, Tensor dh_out)>;

inline constexpr int kActivationTag = 71, kGradientTag = 72;

// Runs one step's 1F1B schedule over `pp` (null: one stage). boundary is the
// shape of the tensors between stages ([rows, hidden] of one micro-batch).
StageTiming run_one_f_one_b(comm::Communicator* pp, int64_t micro_batches, const Shape& boundary,
                            const StageForward& forward, const StageBackward& backward);

}  // namespace origami
