// `origami eval CONFIG --weights DIR --data PREFIX --samples N [--json]`: mean
// token loss of exported weights over the first N unshuffled windows.
#include <mpi.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/trainer.h"
#include "tools/commands.h"

namespace origami::tools {

void add_eval_command(CLI::App& app) {
  struct Args {
    std::string config, weights, data;
    int64_t samples = 0;
    std::vector<std::string> overrides;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("eval", "Mean token loss of exported weights on a dataset");
  cmd->add_option("config", args->config, "TOML config the weights were trained with")->required();
  cmd->add_option("--weights", args->weights,
                  "Directory with model.safetensors (or HF's shards and model.safetensors.index.json)")
      ->required();
  cmd->add_option("--data", args->data, "Dataset prefix (.bin/.idx)")->required();
  cmd->add_option("--samples", args->samples, "Number of windows of seq_len+1 tokens, in file order")->required();
  cmd->add_option("--set", args->overrides, "Override a config value: section.key=value");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] {
    Config cfg = load_config(args->config, args->overrides);
    EvalResult r = evaluate(cfg, args->weights, args->data, args->samples);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0) return;
    if (args->json) {
      nlohmann::ordered_json j = {{"loss", r.mean_loss}, {"samples", r.samples}, {"tokens", r.tokens}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("eval: mean token loss %.6f over %lld samples (%lld tokens)\n", r.mean_loss,
                  static_cast<long long>(r.samples), static_cast<long long>(r.tokens));
    }
  });
}

}  // namespace origami::tools
