// NCCL backend (device memory) behind the Communicator interface. Compiled for
// real only when the build found CUDA and NCCL (ORIGAMI_WITH_NCCL); otherwise
// nccl_available() is false and Groups refuses Backend::nccl with a UserError.
//
// Each NCCL communicator is bootstrapped over the MPI communicator of the same
// group (ncclGetUniqueId on group rank 0, MPI_Bcast, ncclCommInitRank), and
// runs its ops on its own CUDA stream. That stream is a blocking stream, so it
// orders after work already queued on the legacy default stream: buffers the
// caller filled there are ready. Completion is a CUDA event polled by the
// shared bounded wait; a timeout calls ncclCommAbort before MPI_Abort. NCCL has
// no message tags: send/recv between two ranks match in call order.
#pragma once
#include <memory>

#include "comm/communicator.h"

namespace origami::comm {

class MpiCommunicator;

bool nccl_available();

// cudaSetDevice(local rank mod device count), the local rank taken from
// OMPI_COMM_WORLD_LOCAL_RANK. UserError when there is no device.
void select_local_device();

// Collective over `bootstrap`'s group. Same name, members and group ranks.
std::unique_ptr<Communicator> make_nccl_communicator(const MpiCommunicator& bootstrap, CommOptions options);

}  // namespace origami::comm
