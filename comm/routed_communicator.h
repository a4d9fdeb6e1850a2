// RoutedCommunicator: one group's communicator as callers see it when the
// compute device is CUDA — an MPI communicator for host memory (counts,
// statistics, records) and an NCCL one for device tensors, behind one
// Communicator, so callers never branch on where their memory lives. Each
// call goes to the backend of its memory: a Tensor's device, or for a span
// what CUDA says its pointer is (a span whose buffers are all empty or null
// counts as host memory — pass Tensors where a rank's buffers may be empty
// while other ranks' are on a device). The barrier, which moves no memory, is
// a host synchronization over MPI.
//
// Counting: the call path (checks, sequence number, byte and device counters)
// is this communicator's; the two backends only start ops. So next_seq()
// counts every call of the group in issue order, whichever backend ran it —
// ranks issuing the same calls agree on it, as with one backend — and
// stats(op).bytes is the group's whole volume, its device_bytes the part that
// went over NCCL. The two backends' own counters stay at zero.
#pragma once
#include <memory>

#include "comm/communicator.h"

namespace origami::comm {

class RoutedCommunicator final : public Communicator {
 public:
  // Same group (name, members, rank order) on both; `host` must be MPI.
  RoutedCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<Communicator> device);
  ~RoutedCommunicator() override;
  // The device memory's backend (nccl); host memory goes over MPI.
  Backend backend() const override { return device_->backend(); }
  void settle_stream_waits() override { device_->settle_stream_waits(); }

 protected:
  Device locate(const Call& call) const override;
  std::string refusal(const Call& call) const override { return refusal_of(route(*call.memory), call); }
  std::unique_ptr<detail::PendingOp> start(const Call& call) override { return start_on(route(*call.memory), call); }

 private:
  Communicator& route(Device memory) const { return memory.kind == DeviceKind::cpu ? *host_ : *device_; }
  std::unique_ptr<Communicator> host_, device_;
};

}  // namespace origami::comm
