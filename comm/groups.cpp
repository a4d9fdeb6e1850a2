// Groups: one MPI_Comm_split per group kind (the same sequence on every rank,
// as MPI requires), kept as the group's MPI communicator and, with a CUDA
// compute device, also used to bootstrap the group's NCCL communicator
// (groups of more than one rank, unless GroupsOptions asks for all).
#include "comm/groups.h"

#include <string>

#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/routed_communicator.h"
#include "comm/setup_deadline.h"
#include "kernels/check.h"

namespace origami::comm {

Groups Groups::create(const Layout& layout, MPI_Comm world, const GroupsOptions& options) {
  int rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(world, &rank));
  MPI_CHECK(MPI_Comm_size(world, &size));
  if (layout.world() != size)
    ORIGAMI_USER_ERROR("layout is for a world of ", layout.world(), " ranks but the job has ", size);
  const bool cuda = options.compute_device.kind == DeviceKind::cuda;
  if (cuda && !nccl_available())
    ORIGAMI_USER_ERROR("compute device ", to_string(options.compute_device),
                       " needs the NCCL backend, but this build has no NCCL (configure with CUDA)");
  if (cuda) use_cuda_device(options.compute_device);

  Groups g(layout, rank, options.compute_device);
  auto wrap = [&](std::unique_ptr<MpiCommunicator> mpi, bool ring_p2p = false) -> std::unique_ptr<Communicator> {
    if (!mpi || !cuda || (mpi->size() == 1 && !options.nccl_for_groups_of_one)) return mpi;
    CommOptions o = options.comm;
    o.ring_p2p = ring_p2p;
    std::unique_ptr<Communicator> nccl = make_nccl_communicator(*mpi, o);  // bootstraps over the MPI group
    return std::make_unique<RoutedCommunicator>(std::move(mpi), std::move(nccl));
  };
  // Each group's splits and communicator creation wait for other ranks, with
  // no timeout of their own: bounded like a collective.
  const auto set_up = [&](const std::string& name) {
    return SetupDeadline(options.setup_timeout_s,
                         origami::detail::concat("group ", name,
                                                 cuda ? " (MPI_Comm_split, then its NCCL communicator)" : " (MPI_Comm_split)"));
  };
  std::vector<int> all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) all[static_cast<size_t>(r)] = r;
  {
    const SetupDeadline deadline = set_up("world");
    g.world_ = wrap(split_mpi(world, RankGroups{all}, "world", options.comm));
  }
  for (GroupKind k : kAllGroupKinds) {
    // Kind names are unique across both views (etp, edp, ...), so a timeout
    // message's group name says which group hung.
    const std::string name(group_name(k));
    const SetupDeadline deadline = set_up(name);
    g.comms_[static_cast<size_t>(k)] =
        wrap(split_mpi(world, layout.groups(k), name, options.comm), k == GroupKind::pp || k == GroupKind::cp);
  }
  return g;
}

Groups Groups::create(const Layout& layout, MPI_Comm world, Backend backend, CommOptions options) {
  GroupsOptions o;
  o.comm = options;
  if (backend == Backend::nccl) {
    if (!nccl_available())
      ORIGAMI_USER_ERROR("the NCCL backend was asked for, but this build has no NCCL (configure with CUDA)");
    o.compute_device = local_cuda_device();
    o.nccl_for_groups_of_one = true;  // asked for by name
  }
  return create(layout, world, o);
}

Groups::~Groups() = default;

Communicator& Groups::get(GroupKind k) const {
  ORIGAMI_CHECK(has(k), "rank ", world_rank_, " belongs to no ", group_name(k), " group");
  return *comms_[static_cast<size_t>(k)];
}

Communicator* multi_rank(const Groups* groups, GroupKind k) {
  return groups && groups->has(k) && groups->get(k).size() > 1 ? &groups->get(k) : nullptr;
}

}  // namespace origami::comm
