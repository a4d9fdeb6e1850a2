// Evaluation of exported weights (see trainer.h): the whole model on each
// rank, its mean token loss over the dataset's first windows in file order.
#include <algorithm>

#include "engine/export.h"
#include "engine/indexed_dataset.h"
#include "engine/model.h"
#include "engine/preflight.h"
#include "engine/run_context.h"
#include "engine/trainer.h"
#include "kernels/threads.h"

namespace origami {

EvalResult evaluate(const Config& cfg, const std::string& weights_dir, const std::string& data_prefix,
                    int64_t samples) {
  // Evaluation runs the whole model on each rank: the rules of a one-rank layout.
  Config one = cfg;
  one.parallel = ParallelConfig{};
  validate_for_world(one, 1);
  validate_for_machine(one, 1, ranks_on_this_node(), /*trains=*/false);
  check_config_matches_export(cfg, weights_dir);
  const ExecContext ctx = make_context(cfg);
  Model model(ctx, cfg.model, cfg.training.seed, cfg.moe);
  load_hf_weights(model, weights_dir);
  IndexedDataset indexed = IndexedDataset::open(data_prefix, cfg.model.vocab_size);
  GptDataset data(indexed, cfg.training.seq_len, /*shuffle=*/false, cfg.training.seed);
  if (samples < 1 || samples > data.num_windows())
    ORIGAMI_USER_ERROR("--samples ", samples, ": must be in [1, ", data.num_windows(), "], the windows of ",
                       cfg.training.seq_len + 1, " tokens in ", data_prefix);
  const int64_t S = cfg.training.seq_len, mb = cfg.training.micro_batch;
  EvalResult r;
  double loss_sum = 0;
  for (int64_t start = 0; start < samples; start += mb) {
    const int64_t n = std::min(mb, samples - start);
    const Tensor tokens = device_micro_batch(ctx, data, n, S, [&](int64_t i) { return start + i; });
    ModelSaved saved;
    loss_sum += model.forward(tokens, saved);
  }
  r.device = to_string(ctx.device());
  r.data_dtype = std::string(to_string(ctx.data_dtype()));
  r.samples = samples;
  r.tokens = samples * S;
  r.mean_loss = loss_sum / static_cast<double>(r.tokens);
  return r;
}

}  // namespace origami
