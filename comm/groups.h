// comm::Groups: the bundle of communicators a module receives — one per group
// kind of the Layout, plus the whole world. There is no global registry
// (ARCHITECTURE.md §1): whoever builds Groups passes it (or single
// Communicators from it) down explicitly.
#pragma once
#include <mpi.h>

#include <array>
#include <memory>

#include "comm/communicator.h"
#include "comm/layout.h"

namespace origami::comm {

class Groups {
 public:
  // Collective over `world` (MPI_COMM_WORLD or a duplicate of it): every rank
  // calls it with the same layout, whose world size must equal the
  // communicator's. Backend::nccl needs a build with NCCL (UserError
  // otherwise) and selects the device OMPI_COMM_WORLD_LOCAL_RANK (mod devices).
  static Groups create(const Layout& layout, MPI_Comm world, Backend backend, CommOptions options);

  Groups(Groups&&) noexcept = default;
  Groups& operator=(Groups&&) noexcept = default;
  ~Groups();

  const Layout& layout() const { return layout_; }
  int world_rank() const { return world_rank_; }
  RankCoords coords() const { return layout_.coords(world_rank_); }
  Backend backend() const { return backend_; }

  // False only for `embedding` on middle pipeline stages.
  bool has(GroupKind k) const { return comms_[static_cast<size_t>(k)] != nullptr; }
  // This rank's communicator of kind k (checked: has(k)).
  Communicator& get(GroupKind k) const;
  Communicator& operator[](GroupKind k) const { return get(k); }
  Communicator& world() const { return *world_; }

 private:
  Groups(const Layout& layout, int world_rank, Backend backend)
      : layout_(layout), world_rank_(world_rank), backend_(backend) {}
  Layout layout_;
  int world_rank_ = 0;
  Backend backend_ = Backend::mpi;
  std::array<std::unique_ptr<Communicator>, kNumGroupKinds> comms_;
  std::unique_ptr<Communicator> world_;
};

}  // namespace origami::comm
