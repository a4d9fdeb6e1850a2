// RoutedCommunicator: locating a span's memory, and the group identity check.
#include "comm/routed_communicator.h"

#include "comm/nccl_communicator.h"
#include "kernels/check.h"

namespace origami::comm {

namespace {

// The host's timeout; the device communicator's compute stream, so that the
// blocking forms complete device ops on it (complete()).
CommOptions routed_options(const Communicator& host, const Communicator* device) {
  CommOptions o{host.timeout_s()};
  if (device) o.compute_stream = device->compute_stream();
  return o;
}

}  // namespace

RoutedCommunicator::RoutedCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<Communicator> device)
    : Communicator(host->name(), host->members(), host->rank(), routed_options(*host, device.get())),
      host_(std::move(host)),
      device_(std::move(device)) {
  ORIGAMI_CHECK(host_->backend() == Backend::mpi, "group ", name(), ": host memory must go over MPI");
  ORIGAMI_CHECK(device_->name() == name() && device_->members() == members() && device_->rank() == rank(),
                "group ", name(), ": the device communicator is of another group (", device_->name(), ")");
}

RoutedCommunicator::~RoutedCommunicator() = default;

Device RoutedCommunicator::locate(const Call& c) const {
  const Device send = memory_device(c.send_count > 0 ? c.send : nullptr);
  const Device recv = memory_device(c.recv_count > 0 ? c.recv : nullptr);
  const bool send_known = c.send && c.send_count > 0, recv_known = c.recv && c.recv_count > 0;
  if (send_known && recv_known)
    ORIGAMI_CHECK(send == recv, "group ", name(), " ", op_name(c.op), ": send memory on ", to_string(send),
                  ", recv memory on ", to_string(recv), " (one call moves memory of one device)");
  return send_known ? send : recv;  // cpu when neither holds anything
}

}  // namespace origami::comm
