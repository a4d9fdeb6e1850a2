// Training: a Trainer owns one run's state (groups, model, ZeRO store,
// optimizer, data, metrics). run_step() is one optimizer step: gradient
// accumulation over global_batch / (micro_batch · DP) micro-batches drawn per
// §8 through this stage's 1F1B schedule, loss scaled by 1 / (global token
// count), the step's MoE statistics summed (engine/moe_records.h), every
// rank's verdict met, then one AdamW step and the metrics. finish() writes the
// HF export. Also evaluation of exported weights.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/metrics.h"
#include "engine/stop_signals.h"

namespace origami {

struct TrainOptions {
  bool print_steps = true;                               // step lines on rank 0
  bool json_lines = false;                               // step lines as JSON objects instead
  std::function<void(const StepMetrics&)> on_step;        // e.g. tests
};

struct TrainSummary {
  std::vector<double> losses;  // lm loss per step of this run
  int stop_signal = 0;         // the preemption signal the run stopped early for (stop_signals()), else 0
  std::string checkpoint;      // the last checkpoint this run wrote, if any
  double seconds = 0;
  int64_t params = 0;
  int64_t resumed_step = -1;   // the checkpoint's step when the run resumed, else -1
};

// Collective over MPI_COMM_WORLD: every rank constructs, steps and finishes
// alike. A failure on any rank (a UserError) stops all of them at the next
// meeting.
class Trainer {
 public:
  Trainer(const Config& cfg, const TrainOptions& opts = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  int64_t steps_done() const;
  // Whether a rank received a preemption signal (stop_signals()): agreed by
  // every rank after each step, so all stop after the same step. That step
  // checkpoints (when checkpoint.dir is set; its metrics record names the
  // checkpoint and the signal) and finish() skips the export. A stop agreed
  // in the last step is none: the run is done. A second signal of the same
  // kind kills at once. The handlers are the Trainer's for its lifetime (signals
  // are process-wide).
  bool stop_requested() const;
  // The next optimizer step (steps_done() + 1 <= training.steps); its metrics
  // (the same on every rank; written and printed by rank 0).
  StepMetrics run_step();
  // The last meetings (metrics file, then the export); once, after the steps.
  TrainSummary finish();

 private:
  struct Run;
  std::unique_ptr<Run> run_;
};

// The whole run: construct, run_step() until training.steps (or a stop
// signal), finish().
TrainSummary train(const Config& cfg, const TrainOptions& opts = {});

struct EvalResult {
  double mean_loss = 0;
  int64_t samples = 0, tokens = 0;
  std::string device;      // where the forward ran ("cpu", "cuda:0")
  std::string data_dtype;  // its activations' dtype ("f32", "bf16")
};

// Mean token loss over the first `samples` windows (file order, seq_len+1
// tokens each) of the dataset at `data_prefix`, with weights from `weights_dir`.
EvalResult evaluate(const Config& cfg, const std::string& weights_dir, const std::string& data_prefix,
                    int64_t samples);

}  // namespace origami
