// comm::Groups: the bundle of communicators a module receives — one per group
// kind of the Layout, plus the whole world. There is no global registry
// (ARCHITECTURE.md §1): whoever builds Groups passes it (or single
// Communicators from it) down explicitly.
//
// Every group has an MPI communicator, always: host metadata (counts,
// statistics, records) goes over it. With a CUDA compute device each group
// also has an NCCL communicator on that device, and get() hands out a
// RoutedCommunicator (comm/routed_communicator.h) that sends each call to the
// backend of its memory — callers never branch. With the CPU compute device
// get() is the MPI communicator itself, exactly as before.
#pragma once
#include <mpi.h>

#include <array>
#include <memory>

#include "comm/communicator.h"
#include "comm/layout.h"

namespace origami::comm {

struct GroupsOptions {
  // cpu: MPI only. cuda:N: NCCL communicators on device N beside the MPI ones
  // (needs a build with NCCL; UserError otherwise).
  Device compute_device = Device::cpu();
  CommOptions comm;
  // A group of one rank moves nothing between ranks, and the engine never
  // calls one (multi_rank below): it gets its MPI communicator alone, not
  // an NCCL one beside it (an NCCL init each, and device memory; at world 1
  // all 16 groups are of one). The tests of NCCL's call paths on one GPU,
  // and an explicit Backend::nccl, ask for them.
  bool nccl_for_groups_of_one = false;
  // The bound on each group's set-up (MPI_Comm_split, then its NCCL
  // communicator: neither has a timeout of its own; comm/setup_deadline.h).
  // Its own setting, not comm.timeout_s: tests bound ops at a second or
  // two, and NCCL's first communicator creation in a process can take
  // longer than that. The trainer passes runtime.collective_timeout_s.
  double setup_timeout_s = 300.0;
};

class Groups {
 public:
  // Collective over `world` (MPI_COMM_WORLD or a duplicate of it): every rank
  // calls it with the same layout, whose world size must equal the
  // communicator's. A CUDA compute device becomes the current device.
  static Groups create(const Layout& layout, MPI_Comm world, const GroupsOptions& options);
  // The same with the compute device named by backend: mpi = cpu; nccl = this
  // rank's local CUDA device (its index on its node mod devices).
  static Groups create(const Layout& layout, MPI_Comm world, Backend backend, CommOptions options);

  Groups(Groups&&) noexcept = default;
  Groups& operator=(Groups&&) noexcept = default;
  ~Groups();

  const Layout& layout() const { return layout_; }
  int world_rank() const { return world_rank_; }
  RankCoords coords() const { return layout_.coords(world_rank_); }
  Device compute_device() const { return compute_device_; }
  // Device tensors' backend: nccl with a CUDA compute device, else mpi.
  Backend backend() const { return compute_device_.kind == DeviceKind::cpu ? Backend::mpi : Backend::nccl; }

  // False only for `embedding` on middle pipeline stages.
  bool has(GroupKind k) const { return comms_[static_cast<size_t>(k)] != nullptr; }
  // This rank's communicator of kind k (checked: has(k)).
  Communicator& get(GroupKind k) const;
  Communicator& operator[](GroupKind k) const { return get(k); }
  Communicator& world() const { return *world_; }

 private:
  Groups(const Layout& layout, int world_rank, Device compute_device)
      : layout_(layout), world_rank_(world_rank), compute_device_(compute_device) {}
  Layout layout_;
  int world_rank_ = 0;
  Device compute_device_;
  std::array<std::unique_ptr<Communicator>, kNumGroupKinds> comms_;
  std::unique_ptr<Communicator> world_;
};

// This rank's group of kind k as modules take it (comm/communicator.h,
// group_size): null for null groups, a kind this rank lacks, or a group of one.
Communicator* multi_rank(const Groups* groups, GroupKind k);
inline Communicator* multi_rank(const Groups& groups, GroupKind k) { return multi_rank(&groups, k); }

}  // namespace origami::comm
