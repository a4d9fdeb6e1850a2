// Implementation of the check family: diagnostics carry file:line and rank, and
// a failed invariant takes the whole MPI job down instead of hanging peers.
#include "kernels/check.h"

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace origami {

namespace {
// The one process-wide latch of the abort path (the only mutable global of
// the engine, and deliberately so: it must be reachable from any thread of
// any module, and it only ever goes from false to true).
std::atomic<bool> g_aborting{false};
}  // namespace

int world_rank_for_diagnostics() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 0;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void abort_job(int exit_status, const std::string& message) {
  if (g_aborting.exchange(true)) {
    // Another thread is reporting and aborting; it takes this one down too.
    for (;;) ::pause();
  }
  if (!message.empty()) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_status);
  std::_Exit(exit_status);
}

void fail_check(const char* file, int line, const char* cond, const std::string& msg) {
  abort_job(kExitInternal, detail::concat(file, ":", line, " [rank ", world_rank_for_diagnostics(),
                                          "] check failed: ", cond, msg.empty() ? "" : ": ", msg));
}

std::string shorten(std::string_view value, size_t max_chars) {
  if (value.size() <= max_chars) return std::string(value);
  const size_t keep = max_chars > 16 ? max_chars - 16 : max_chars / 2;
  const size_t head = keep * 2 / 3, tail = keep - head;
  return detail::concat(value.substr(0, head), "...", value.substr(value.size() - tail), " (", value.size(),
                        " characters)");
}

}  // namespace origami
