// MpiCommunicator: the host-memory backend — one MPI_Comm per rank group, made
// with MPI_Comm_split, every op issued as its nonblocking MPI call (MPI_Iallreduce,
// MPI_Ialltoallv, ...) so the shared bounded wait can poll it with MPI_Test.
// Host memory only (MPI is not assumed CUDA-aware); bf16 moves as 16-bit
// words and reduces with user MPI_Ops that round each combine to bf16 (as
// NCCL's bf16 sums do).
#pragma once
#include <mpi.h>

#include <memory>

#include "comm/communicator.h"
#include "comm/layout.h"

namespace origami::comm {

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`, whose ranks are `members` (world ranks) in order.
  MpiCommunicator(MPI_Comm comm, std::string name, std::vector<int> members, CommOptions options);
  ~MpiCommunicator() override;
  Backend backend() const override { return Backend::mpi; }
  MPI_Comm handle() const { return comm_; }

 protected:
  Device locate(const Call&) const override { return Device::cpu(); }
  std::string refusal(const Call& call) const override {
    return memory_refusal(Backend::mpi, *call.memory, call.type, call.op);
  }
  std::unique_ptr<detail::PendingOp> start(const Call& call) override;

 private:
  MPI_Comm comm_;
};

// Collective over `parent`: a communicator of all its ranks (a duplicate, so
// its traffic never matches another communicator's).
std::unique_ptr<MpiCommunicator> whole_mpi(MPI_Comm parent, std::string name, CommOptions options);

// Collective over `parent`: the ranks of `parent` that share this rank's node
// (MPI_COMM_TYPE_SHARED), members named by their MPI_COMM_WORLD ranks.
std::unique_ptr<MpiCommunicator> node_mpi(MPI_Comm parent, std::string name, CommOptions options);

// Collective over `parent`: every rank calls it with the same `groups` (a set of
// disjoint groups of parent ranks, members ascending). Returns this rank's group
// as a communicator, or null when no group holds it.
std::unique_ptr<MpiCommunicator> split_mpi(MPI_Comm parent, const RankGroups& groups, std::string name,
                                           CommOptions options);

}  // namespace origami::comm
