// `origami`: one MPI program with subcommands (train, eval, preprocess, bench).
// Plain `./origami ...` works as a one-rank job. User errors exit 2; internal
// check failures abort the job through ORIGAMI_CHECK.
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <filesystem>

#include "kernels/check.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  CLI::App app{"Origami: Mixture-of-Experts pretraining with parallel folding"};
  app.require_subcommand(1);
  origami::tools::add_train_command(app);
  origami::tools::add_eval_command(app);
  origami::tools::add_preprocess_command(app);
  origami::tools::add_bench_command(app);
  origami::tools::add_groups_command(app);
  origami::tools::add_plan_command(app);
  int status = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    status = app.exit(e);
    if (status != 0) status = 2;
  } catch (const origami::UserError& e) {
    if (rank == 0) std::fprintf(stderr, "error: %s\n", e.what());
    status = 2;
  } catch (const std::filesystem::filesystem_error& e) {
    // Paths come from the user (config dirs, CLI arguments).
    if (rank == 0) std::fprintf(stderr, "error: %s\n", e.what());
    status = 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] internal error: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  // Every rank reads the same config and data, so a user error is raised on
  // all ranks alike and they leave together.
  MPI_Finalize();
  return status;
}
