// Training loop: for each optimizer step, gradient accumulation over
// global_batch / (micro_batch · DP) micro-batches drawn per §8, loss scaled by
// 1 / (global token count), then one AdamW step; metrics per step; HF export
// at the end. Also evaluation of exported weights.
#pragma once
#include <functional>
#include <vector>

#include "engine/config.h"
#include "engine/metrics.h"

namespace origami {

struct TrainOptions {
  bool print_steps = true;                               // step lines on rank 0
  bool json_lines = false;                               // step lines as JSON objects instead
  std::function<void(const StepMetrics&)> on_step;        // e.g. tests
};

struct TrainSummary {
  std::vector<double> losses;  // lm loss per step
  double seconds = 0;
  int64_t params = 0;
};

TrainSummary train(const Config& cfg, const TrainOptions& opts = {});

struct EvalResult {
  double mean_loss = 0;
  int64_t samples = 0, tokens = 0;
};

// Mean token loss over the first `samples` windows (file order, seq_len+1
// tokens each) of the dataset at `data_prefix`, with weights from `weights_dir`.
EvalResult evaluate(const Config& cfg, const std::string& weights_dir, const std::string& data_prefix,
                    int64_t samples);

}  // namespace origami
