// The in-flight check of host-memory communication (CommOptions::
// check_in_flight, on in the host stand-in's groups): a test mode that
// makes a CPU run meet its buffers the way a GPU run does, so that a
// missing wait shows on the host.
//
// On a GPU an NCCL op reads its send buffer and writes its receive buffer
// on the communication stream at some moment between its launch and the
// point where the compute stream waits for it (Communicator::complete); the
// host has long gone on queueing compute that may overlap it. Code that
// writes a buffer an op still reads, reads a buffer an op has not written
// yet, or frees one (the GPU allocator hands the block out again at once)
// is wrong there, and on the CPU, where MPI usually moves small messages at
// once and the host waits inside complete(), it passes unnoticed. Under the
// check a host op instead runs on private copies of its buffers: the bytes
// it reads are copied at the launch, the bytes it writes are filled with a
// poison value (NaN for floating types, a negative value for integers)
// until it completes, and the allocator holds both ranges. On completion
// the op's read bytes must be unchanged and its written bytes still poison
// (else the job aborts naming group, op, sequence number, buffer and
// element); then the results are written in. A read before the wait meets
// NaN, which the parity tests see in the losses; a free before it is
// refused by the allocator (TrackedAllocator::hold).
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace origami::comm::detail {

// The bytes an op reads and writes; either may be empty, and they may
// overlap (in place: all_reduce, all_gather with the send block in its slot).
struct InFlightRegions {
  const std::byte* read = nullptr;
  size_t read_bytes = 0;
  std::byte* write = nullptr;
  size_t write_bytes = 0;
};

class InFlightCheck {
 public:
  // Copies the read bytes, poisons the write bytes and holds both on the
  // host allocator; `what` names the op in every message ("group dp
  // all_gather seq 12").
  InFlightCheck(const InFlightRegions& regions, ElemType type, std::string what);
  ~InFlightCheck();
  InFlightCheck(const InFlightCheck&) = delete;
  InFlightCheck& operator=(const InFlightCheck&) = delete;

  // Where the backend finds a pointer into the read or write region (its
  // private copy, offsets kept, so in-place calls stay in place); any other
  // pointer unchanged.
  void* staged(const void* p) const;
  // The backend's op wrapped: when it completes, the check runs and the
  // results are written into the caller's buffers.
  static std::unique_ptr<PendingOp> wrap(std::unique_ptr<InFlightCheck> check, std::unique_ptr<PendingOp> op);
  // Once the backend's op has completed: checks the caller's buffers, then
  // writes the results into them and releases the holds (wrap's op calls it).
  void finish();

 private:
  // One contiguous range of the caller's memory and its private copy.
  struct Stage {
    const std::byte* user = nullptr;
    size_t bytes = 0;
    std::vector<std::byte> copy;
  };
  const Stage* stage_of(const void* p) const;
  void release_holds();
  void check_unchanged(const std::byte* begin, const std::byte* end) const;
  InFlightRegions regions_;
  ElemType type_;
  std::string what_;
  std::vector<Stage> stages_;
  std::vector<int64_t> holds_;  // TrackedAllocator::host() hold ids, one per stage
  bool finished_ = false;
};

}  // namespace origami::comm::detail
