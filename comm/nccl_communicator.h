// NCCL backend (device memory) behind the Communicator interface. Compiled for
// real only when the build found CUDA and NCCL (ORIGAMI_WITH_NCCL); otherwise
// nccl_available() is false and Groups refuses a CUDA compute device with a
// UserError. Device memory only (memory_refusal); Groups puts each NCCL
// communicator beside its group's MPI one (comm/routed_communicator.h).
//
// Each NCCL communicator is bootstrapped over the MPI communicator of the same
// group (ncclGetUniqueId on group rank 0, MPI_Bcast, ncclCommInitRank), and
// runs its ops on its own CUDA stream. That stream is a blocking stream, so it
// orders after work already queued on the legacy default stream: buffers the
// caller filled there are ready; with CommOptions::compute_stream it also
// orders each op after the work queued so far on that (non-blocking) stream,
// through an event rather than a host sync. Completion is a CUDA event polled by the
// shared bounded wait, or handed to a caller's stream (Request::wait_on,
// cudaStreamWaitEvent: what Communicator::complete and the blocking Tensor
// forms do when there is a compute stream, the training path's rule); a
// timeout calls ncclCommAbort (bounded, see below) before MPI_Abort. NCCL has
// no message tags: send/recv between two ranks match in call order, and on
// one stream a receive waiting for its peer holds up every op queued behind
// it. With CommOptions::ring_p2p (the pp and cp groups) sends to and
// receives from ring neighbours therefore run on channels of their own, a
// two-rank communicator and stream per direction: each carries one sender's
// messages to one receiver in the order both issue them (the pipeline's and
// the CP ring's orders agree per direction: check_paired_p2p,
// dense/attention_ring.h), and a receive posted ahead blocks nothing but
// later receives from the same peer. Each channel exchanges one element when
// it opens, so that NCCL's connection of the pair (made on its first
// exchange, with both hosts waiting for each other) happens there and not
// at the first transfer, where the schedules' order would deadlock.
// A timeout's ncclCommAbort is given two seconds, then the job ends anyway.
#pragma once
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace origami::comm {

class MpiCommunicator;

bool nccl_available();
// The NCCL library this process loaded, "2.28.3"; "" in a build without NCCL.
std::string nccl_library_version();

// cuda:(local rank mod device count), the local rank this rank's index on
// its node (kernels/threads.h). UserError when there is no device.
Device local_cuda_device();
// cudaSetDevice(d.index): NCCL communicators and their streams live on the
// current device. UserError for a device this rank does not see.
void use_cuda_device(Device d);

// Where `p` points: cuda:N for device (or managed) memory, cpu for host memory,
// memory CUDA does not know, and null. Always cpu in a build without NCCL.
Device memory_device(const void* p);

// Collective over `bootstrap`'s group. Same name, members and group ranks; on
// the current device.
std::unique_ptr<Communicator> make_nccl_communicator(const MpiCommunicator& bootstrap, CommOptions options);

}  // namespace origami::comm
