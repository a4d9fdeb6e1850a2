// The job's diagnostics communicator: a duplicate of MPI_COMM_WORLD that
// start_mpi makes (its ranks are world ranks) with errors returned rather
// than fatal, for the messages a failing job sends about itself
// (comm/census.h). Being a communicator of its own, its traffic can match
// no other message, and a failure there cannot take over the job's exit.
#pragma once
#include <mpi.h>

namespace origami {

// MPI_COMM_NULL until start_mpi has run (MPI started by other code has none).
MPI_Comm diagnostics_comm();

}  // namespace origami
