// Implementation of the check family: diagnostics carry file:line and rank, and
// a failed invariant takes the whole MPI job down instead of hanging peers.
#include "kernels/check.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace origami {

int world_rank_for_diagnostics() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 0;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void fail_check(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "%s:%d [rank %d] check failed: %s%s%s\n", file, line, world_rank_for_diagnostics(),
               cond, msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();
}

}  // namespace origami
