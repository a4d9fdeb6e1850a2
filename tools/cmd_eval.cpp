// `origami eval CONFIG --weights DIR --data PREFIX --samples N [--json]`: mean
// token loss of exported weights over the first N unshuffled windows.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "comm/agreement.h"
#include "comm/mpi_communicator.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/preflight.h"
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
  add_set_option(cmd, args->overrides);
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] {
    // Every rank evaluates the whole model; they meet before rank 0 prints,
    // so a job one rank of which failed (its weights unreadable) prints no
    // loss, and ranks given other inputs (an MPMD launch, a relative path
    // under another working directory) are refused rather than answered by
    // rank 0's figure.
    Config cfg;
    const auto world = comm::whole_mpi(MPI_COMM_WORLD, "everyone", comm::CommOptions{});
    comm::run_agreed(*world, [&] { cfg = load_config(args->config, args->overrides); });
    check_same_run(*world, cfg);
    EvalResult r;
    comm::run_agreed(*world, [&] { r = evaluate(cfg, args->weights, args->data, args->samples); },
                     io_meeting_wait(cfg));
    // Within 1e-6: ranks on other CPUs may sum in another order.
    double range[2] = {r.mean_loss, -r.mean_loss};
    world->all_reduce(std::span<double>(range, 2), comm::ReduceOp::max);
    const double lo = -range[1], hi = range[0];
    if (hi - lo > 1e-6 * std::max(std::abs(lo), std::abs(hi)) || !std::isfinite(hi - lo))
      throw JobError(detail::concat("error: the ranks of this eval computed losses from ", lo, " to ", hi,
                                    " (rule: every rank evaluates the same weights on the same data: --weights, "
                                    "--data and --samples must name the same files and count on every rank)"),
                     kExitUserError);
    if (world->rank() != 0) return;
    if (args->json) {
      nlohmann::ordered_json j = {{"loss", r.mean_loss}, {"samples", r.samples}, {"tokens", r.tokens},
                                     {"device", r.device}, {"data_dtype", r.data_dtype}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("eval: mean token loss %.6f over %lld samples (%lld tokens)\n", r.mean_loss,
                  static_cast<long long>(r.samples), static_cast<long long>(r.tokens));
    }
  });
}

}  // namespace origami::tools
