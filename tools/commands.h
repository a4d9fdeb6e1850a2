// Subcommand registration for the `origami` binary. Each tools/cmd_*.cpp adds
// one CLI11 subcommand and its callback; callbacks throw UserError for bad
// input, which main() prints and turns into exit status 2.
#pragma once
#include <CLI/CLI.hpp>
#include <string_view>
#include <vector>

namespace origami {
struct Config;
}

namespace origami::tools {

// For floating-point options: a finite number > 0 (CLI11's PositiveNumber
// lets "nan" through, since NaN <= 0 is false).
CLI::Validator finite_positive();
// For fractions: a finite number in [lo, hi] (CLI::Range lets "nan" through).
CLI::Validator finite_in(double lo, double hi);
// `--set section.key=value`, repeatable, one value each: a vector option
// would otherwise take the words after it too, the config's path among
// them (`plan --set a=1 CONFIG`).
CLI::Option* add_set_option(CLI::App* cmd, std::vector<std::string>& overrides);
// A comma-separated list option (`--only a,b`, repeatable), registered as
// text and split here: CLI11's own splitting drops empty items, so "2,,2"
// read as 2,2 and "" as no list at all. UserError naming the option and
// the text for an empty item.
std::vector<std::string> comma_items(const std::vector<std::string>& given, std::string_view option);
// Every value-taking option and positional of `app` and its subcommands
// refuses an empty value (an empty --html or --out would read as "not
// given" and write elsewhere, or nowhere), and every integer one a number
// past 64 bits (CLI11 saturates it, and the message then quotes a value
// nobody typed). Run once, after every subcommand is registered.
void check_every_value(CLI::App& app);
// The median of benchmark repeats (the upper middle of an even count).
double median(std::vector<double> v);
// The host-engine benchmarks (bench step, moe-layer, checkpoint) refuse a
// config asking for CUDA, naming what measures a GPU, rather than timing
// the CPU under a GPU config.
void require_host_engine(const Config& cfg, std::string_view command);
// This process's rank in the job and the job's size: MPI_COMM_WORLD's, or 0
// and 1 for a host-only command run outside an MPI launcher, which never
// starts MPI (tools/origami.cpp).
int job_rank();
int job_size();
// Commands that measure or analyse in one process (bench step, kernels,
// imbalance; imbalance) refuse a job of several ranks, in which each rank
// would run the whole command alone and write the same outputs.
void require_one_process(std::string_view command);

void add_train_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_preprocess_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_groups_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_checkpoint_command(CLI::App& app);
void add_export_command(CLI::App& app);
// Its verdict goes to exit_status (0 healthy, 1 an alert fired) for main to return.
void add_imbalance_command(CLI::App& app, int& exit_status);
// Subcommands of `bench` (tools/bench_*.cpp).
void add_bench_moe_layer_command(CLI::App& bench);
void add_bench_comm_command(CLI::App& bench);
void add_bench_checkpoint_command(CLI::App& bench);
void add_bench_imbalance_command(CLI::App& bench);
void add_bench_kernels_command(CLI::App& bench);

}  // namespace origami::tools
