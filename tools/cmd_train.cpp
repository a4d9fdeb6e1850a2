// `origami train CONFIG [--set section.key=value]...`: trains per the config,
// printing a step line as it goes; metrics.jsonl and the HF export per the
// config's logging and export sections.
#include <mpi.h>

#include <csignal>
#include <cstdio>

#include "engine/config.h"
#include "engine/trainer.h"
#include "tools/commands.h"

namespace origami::tools {

void add_train_command(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("train", "Train a model from a TOML config");
  cmd->add_option("config", args->config, "TOML config file")->required();
  add_set_option(cmd, args->overrides);
  cmd->add_flag("--json", args->json, "Print each step as a JSON object (the metrics.jsonl record)");
  cmd->callback([args] {
    Config cfg = load_config(args->config, args->overrides);
    TrainOptions opts;
    opts.json_lines = args->json;
    TrainSummary s = train(cfg, opts);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0 || args->json) return;
    if (s.stop_signal)
      std::printf("stopped by %s after %zu steps (at step %lld of %lld)%s%s%s\n",
                  stop_signal_name(s.stop_signal).c_str(),
                  s.losses.size(), static_cast<long long>(std::max<int64_t>(0, s.resumed_step) + std::ssize(s.losses)),
                  static_cast<long long>(cfg.training.steps),
                  s.checkpoint.empty() ? " (no checkpoint.dir: nothing saved)" : "; checkpoint ",
                  s.checkpoint.c_str(),
                  s.checkpoint.empty() ? "" : "; resume with --set checkpoint.load=latest");
    else if (!s.losses.empty())
      std::printf("trained %zu step%s in %.1f s, final lm loss %.4f\n", s.losses.size(), s.losses.size() == 1 ? "" : "s",
                  s.seconds, s.losses.back());
    else if (s.resumed_step >= 0)
      std::printf("trained 0 steps: the checkpoint is at step %lld = training.steps, nothing left to train\n",
                  static_cast<long long>(s.resumed_step));
  });
}

}  // namespace origami::tools
