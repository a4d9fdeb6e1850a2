// `origami`: one MPI program with subcommands (train, eval, preprocess, bench,
// groups, plan, checkpoint, export, imbalance). Plain `./origami ...` works as a one-rank job.
//
// Exit statuses (kernels/check.h): 0 success, 1 imbalance alerts, 2 bad input, 3 training
// diverged, 4 internal check failed, 5 collective timeout. Every rank leaves
// through one meeting (comm::share_failures on a world communicator of its
// own), failed or not, so an error raised on any subset of ranks reaches the
// user once, tagged with its ranks, and every rank exits with the same
// status. A rank that fails while others are stuck elsewhere waits a short
// grace period, then prints its own error and aborts the job.
//
// Subcommands that never communicate (preprocess, plan, imbalance, groups,
// checkpoint inspect, export from a checkpoint) run without MPI when no MPI
// launcher started the process: OpenMPI starts a one-rank job by spawning an
// orted, ~0.4 s before any work (most of a `plan`'s run time), and a login
// node without a working MPI runtime can still plan, preprocess and inspect.
// Under mpirun they start MPI like every subcommand, whatever they do. A
// one-rank job of the others outside a launcher starts OpenMPI isolated (no
// orted: it never spawns processes), 0.15 s sooner.
#include <mpi.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "comm/agreement.h"
#include "comm/mpi_communicator.h"
#include "engine/config.h"
#include "engine/preflight.h"
#include "engine/stop_signals.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "tools/commands.h"

namespace {

// How long a failed rank waits for the others at the exit meeting before it
// aborts the job itself: ranks that failed alike arrive within moments
// (start-up skew of oversubscribed ranks is a second or two).
constexpr double kFailureGraceSeconds = 10.0;
// How long a rank that finished waits for the rest: they run the same
// collectives, so they finish close together; a rank still missing after
// this is stuck, and the bounded wait must not become a hang.
constexpr double kFinishWaitSeconds = 600.0;

// The registered subcommands: "train", "eval", ...
std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  return names;
}

// A word where a subcommand belongs that is none names itself and the valid
// ones (CLI11 would only say it was not expected): `origami frobnicate`,
// `origami bench frobnicate`.
// Returns the subcommand's path ("origami bench comm").
std::string check_subcommand(const CLI::App& app, int argc, char** argv) {
  const CLI::App* level = &app;
  std::string path = "origami";
  for (int i = 1; i < argc && argv[i][0] != '-'; ++i) {
    const std::vector<std::string> names = subcommand_names(*level);
    if (names.empty()) break;  // past the subcommands: positional arguments
    if (std::find(names.begin(), names.end(), argv[i]) == names.end()) {
      std::string list;
      for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
      ORIGAMI_USER_ERROR("unknown subcommand '", origami::shorten(argv[i]), "' of ", path, " (subcommands: ", list,
                         "; ", path, " --help describes them)");
    }
    level = level->get_subcommand(argv[i]);
    path += std::string(" ") + argv[i];
  }
  return path;
}

// Every rank of a job runs the same subcommand: an MPMD launch of two
// (`mpirun -np 1 origami train ... : -np 1 origami eval ...`) would leave
// each waiting in collectives the other never calls, until the exit
// meeting's long wait ran out.
void check_same_subcommand(origami::comm::Communicator& world, const std::string& path) {
  origami::check_same_lines(world, "subcommand = " + path + "\n",
                            "the ranks of this job run different subcommands (rule: every rank runs the same one; an "
                            "MPMD launch of different subcommands is not one job)");
}

// Collective over `world`. The subcommands that never communicate run on
// rank 0 alone under a launcher (export, checkpoint inspect, plan, groups,
// preprocess): another rank's options would go unheard, so an MPMD launch
// that gives a rank another command line (another --checkpoint) stops the job
// instead of exporting rank 0's choice with status 0.
void check_same_command_line(origami::comm::Communicator& world, int argc, char** argv) {
  std::string lines;
  for (int i = 1; i < argc; ++i) {
    std::string word = argv[i];
    std::replace(word.begin(), word.end(), '\n', ' ');  // one line per word
    lines += origami::detail::concat("word ", i, " = ", word, "\n");
  }
  origami::check_same_lines(world, lines,
                            "the ranks of this job were given different command lines, and this subcommand runs on "
                            "rank 0 alone, so the others' would be ignored (rule: every rank runs the same command "
                            "line)");
}

// Collective over `world`: every rank tells whether its command line parsed.
// Ranks of one job normally parse the same line, but an MPMD launch can give
// them different options: without this, those that parsed would run the
// command and wait for the others at its first collective.
struct ParseOutcome {
  int first_failed = -1;  // the lowest rank whose line did not parse; -1: none
  int failed = 0;         // how many did not
};
ParseOutcome share_parse_outcome(origami::comm::Communicator& world, bool parsed) {
  const int n = world.size(), rank = world.rank();
  int64_t v[2] = {parsed ? 0 : n - rank, parsed ? 0 : 1};  // max of n − rank: the lowest failing rank
  world.all_reduce(std::span<int64_t>(v, 1), origami::comm::ReduceOp::max);
  world.all_reduce(std::span<int64_t>(v + 1, 1), origami::comm::ReduceOp::sum);
  return {v[0] == 0 ? -1 : static_cast<int>(n - v[0]), static_cast<int>(v[1])};
}

// The subcommand (the first word that is not an option) never communicates.
// Whether the subcommand (the first word that is not an option) is `name`.
bool is_command(int argc, char** argv, std::string_view name) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return argv[i] == name;
  return false;
}

bool host_only_subcommand(std::string_view word) {
  return word == "preprocess" || word == "plan" || word == "imbalance" || word == "groups" || word == "checkpoint" ||
         word == "export";
}

bool host_only_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return host_only_subcommand(argv[i]);
  return true;  // no subcommand: usage or --help
}

bool mpi_started() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

}  // namespace

namespace origami::tools {

int job_rank() {
  int rank = 0;
  if (mpi_started()) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int job_size() {
  int size = 1;
  if (mpi_started()) MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

void require_one_process(std::string_view command) {
  if (const int n = job_size(); n > 1)
    ORIGAMI_USER_ERROR("origami ", command, " runs as one process, and this job has ", n,
                       " ranks (rule: run it without mpirun, or with -np 1)");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void require_host_engine(const Config& cfg, std::string_view command) {
  if (cfg.runtime.device == RuntimeDevice::cuda)
    ORIGAMI_USER_ERROR(cfg.origin("runtime.device"), ": runtime.device = \"cuda\": ", command,
                       " times the CPU engine, not the GPU's; on a GPU, `origami train` reports tokens/s, TFLOP/s ",
                       "and MFU each step, and `origami bench kernels --device cuda` times its ops");
}

namespace {
// A floating-point option's value, checked whole: "" when `text` is a finite
// number that `ok` accepts, else the message (`rule` names what ok wants).
CLI::Validator finite_validator(std::function<bool(double)> ok, std::string rule, std::string name) {
  return CLI::Validator(
      [ok = std::move(ok), rule = std::move(rule)](std::string& text) -> std::string {
        size_t used = 0;
        double v = 0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != text.size() || text.empty()) return "'" + shorten(text) + "' is not a number";
        if (!std::isfinite(v) || !ok(v)) return "must be a finite number " + rule + ", got " + shorten(text);
        return "";
      },
      std::move(name));
}
}  // namespace

CLI::Validator finite_positive() {
  return finite_validator([](double v) { return v > 0; }, "> 0", "FINITE > 0");
}

CLI::Option* add_set_option(CLI::App* cmd, std::vector<std::string>& overrides) {
  return cmd->add_option("--set", overrides, "Override a config value: section.key=value (a TOML value); repeatable")
      ->allow_extra_args(false);
}

std::vector<std::string> comma_items(const std::vector<std::string>& given, std::string_view option) {
  std::vector<std::string> items;
  for (const std::string& text : given) {
    size_t from = 0;
    for (int number = 1;; ++number) {
      const size_t comma = text.find(',', from);
      const std::string item = text.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
      if (item.find_first_not_of(" \t") == std::string::npos)
        ORIGAMI_USER_ERROR(option, " '", shorten(text), "': item ", number,
                           " is empty (rule: comma-separated items, none empty)");
      items.push_back(item);
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
  }
  return items;
}

void check_every_value(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_items_expected_min() == 0) continue;  // a flag
    const std::string type = opt->get_type_name();
    const bool is_unsigned = type.starts_with("UINT"), integer = is_unsigned || type.starts_with("INT");
    opt->check(CLI::Validator(
        [integer, is_unsigned](std::string& text) -> std::string {
          if (text.empty()) return "an empty value (rule: give one, or leave the option out)";
          if (!integer) return "";
          // As CLI11 reads integers (strtoll/strtoull, base 0: hex, octal
          // and leading blanks too), which saturate where this refuses.
          errno = 0;
          char* end = nullptr;
          if (is_unsigned) std::strtoull(text.c_str(), &end, 0);
          else std::strtoll(text.c_str(), &end, 0);
          if (errno == ERANGE) return "'" + shorten(text) + "' does not fit in 64 bits";
          return "";  // CLI11 names what is not a number at all
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands({})) check_every_value(*sub);
}

CLI::Validator finite_in(double lo, double hi) {
  const std::string range = detail::concat("in [", lo, ", ", hi, "]");
  return finite_validator([lo, hi](double v) { return v >= lo && v <= hi; }, range, "FINITE " + range);
}

}  // namespace origami::tools

int main(int argc, char** argv) {
  // A closed standard output (`| head`, a dead tee) is a failed write, which
  // every command checks and reports (exit 2), not a silent SIGPIPE death.
  std::signal(SIGPIPE, SIG_IGN);
  // A preemption signal during start-up (MPI_Init waits for every rank)
  // stops the run after its first step, as one a moment later would.
  if (is_command(argc, argv, "train")) origami::catch_stop_signals_from_start();
  origami::choose_cuda_module_loading();  // before anything can start CUDA (MPI_Init may)
  origami::choose_cuda_device_max_connections();
  const bool use_mpi = origami::launched_by_mpi() || !host_only_command(argc, argv);
  if (use_mpi) origami::start_mpi(&argc, &argv);
  const int rank = origami::tools::job_rank();
  // The exit meeting's own communicator: its traffic never matches the
  // engine's collectives, whatever state a failing rank left them in. None
  // without MPI: this process is the whole job.
  std::unique_ptr<origami::comm::MpiCommunicator> exit_comm;
  if (use_mpi)
    exit_comm = origami::comm::whole_mpi(MPI_COMM_WORLD, "exit", origami::comm::CommOptions{kFinishWaitSeconds});

  CLI::App app{"Origami: Mixture-of-Experts pretraining with parallel folding"};
  app.require_subcommand(1);
  origami::tools::add_train_command(app);
  origami::tools::add_eval_command(app);
  origami::tools::add_preprocess_command(app);
  origami::tools::add_bench_command(app);
  origami::tools::add_groups_command(app);
  origami::tools::add_plan_command(app);
  origami::tools::add_checkpoint_command(app);
  origami::tools::add_export_command(app);
  int verdict = 0;  // a command's own non-error status (imbalance: 1 when an alert fired)
  origami::tools::add_imbalance_command(app, verdict);
  origami::tools::check_every_value(app);

  int status = 0;
  std::string message;
  bool agreed = false;  // every rank already knows the outcome (a JobError, or the same command line)
  // Before any subcommand's callback runs: the ranks whose lines parsed stop
  // too when another's did not.
  app.parse_complete_callback([&] {
    if (!exit_comm) return;
    const ParseOutcome o = share_parse_outcome(*exit_comm, /*parsed=*/true);
    if (o.failed > 0)
      throw origami::JobError(
          origami::detail::concat("the job stops: the command line of ", o.failed, " of ", exit_comm->size(),
                                  " ranks (the first: rank ", o.first_failed,
                                  ", which printed why) did not parse, and rank 0's did (rule: every rank of a job runs "
                                  "the same command line)"),
          origami::kExitUserError);
  });
  // The parser's own errors ("--world: Value 0 not in range 1 to 1048576")
  // read like the engine's: `error:`, the command, and where the options are
  // described.
  std::string command_path = "origami";
  app.failure_message([&command_path](const CLI::App*, const CLI::Error& e) {
    return origami::detail::concat("error: ", command_path, ": ", e.what(), " (", command_path,
                                   " --help describes the options)\n");
  });
  try {
    const std::string path = check_subcommand(app, argc, argv);
    command_path = path;
    if (exit_comm) check_same_subcommand(*exit_comm, path);
    // From the agreed path, so every rank takes the same branch.
    if (const size_t space = path.find(' '); exit_comm && space != std::string::npos) {
      // The subcommand's first word ("checkpoint" of "origami checkpoint inspect").
      const std::string word = path.substr(space + 1, path.find(' ', space + 1) - space - 1);
      if (host_only_subcommand(word)) check_same_command_line(*exit_comm, argc, argv);
    }
    app.parse(argc, argv);
    // Output that never reached its file is a failure too (stdout on a full disk).
    if (std::fflush(stdout) != 0 || std::ferror(stdout))
      ORIGAMI_USER_ERROR("writing standard output failed: ", std::strerror(errno));
  } catch (const CLI::ParseError& e) {
    // Ranks normally parse the same command line: only the first whose line
    // did not parse prints (rank 0, unless an MPMD launch gave ranks
    // different options).
    const int printer = exit_comm ? share_parse_outcome(*exit_comm, /*parsed=*/false).first_failed : rank;
    std::ostringstream quiet;
    const int code = rank == printer ? app.exit(e) : app.exit(e, quiet, quiet);
    status = code != 0 ? origami::kExitUserError : 0;
    agreed = true;
    // --help and --version print to standard output: a full disk there is
    // an error too. Only one rank printed, so only its status can say so.
    if (rank == printer && code == 0 && (std::fflush(stdout) != 0 || std::ferror(stdout))) {
      std::fprintf(stderr, "error: writing standard output failed: %s\n", std::strerror(errno));
      status = origami::kExitUserError;
    }
  } catch (const origami::JobError& e) {
    if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
    status = e.exit_status();
    agreed = true;
  } catch (const origami::UserError& e) {
    status = e.exit_status();
    message = e.what();
  } catch (const std::filesystem::filesystem_error& e) {
    // Paths come from the user (config dirs, CLI arguments).
    status = origami::kExitUserError;
    message = e.what();
  } catch (const std::exception& e) {
    origami::abort_job(origami::kExitInternal, origami::detail::concat("[rank ", rank, "] internal error: ", e.what()));
  }
  if (!agreed && !exit_comm) {
    // Alone: the failure is the job's.
    if (status != 0) {
      const std::vector<origami::comm::RankFailure> mine{{0, status, message}};
      std::fprintf(stderr, "%s\n", origami::comm::format_failures(mine, 1).c_str());
    }
  } else if (!agreed) {
    const double wait = status != 0 ? kFailureGraceSeconds : kFinishWaitSeconds;
    const auto failures = origami::comm::share_failures(*exit_comm, status, message, wait);
    if (!failures) {
      if (status != 0)
        origami::abort_job(status, origami::detail::concat("error [rank ", rank, "]: ", message));
      origami::abort_job(origami::kExitTimeout,
                         origami::detail::concat("[rank ", rank, "] finished, but not every rank finished within ",
                                                 kFinishWaitSeconds, " s"));
    }
    if (!failures->empty()) {
      status = origami::comm::failure_status(*failures);
      if (rank == 0) std::fprintf(stderr, "%s\n", origami::comm::format_failures(*failures, exit_comm->size()).c_str());
    }
  }
  if (status == 0) status = verdict;
  exit_comm.reset();
  if (use_mpi) MPI_Finalize();
  return status;
}
