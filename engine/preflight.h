// Checks at the start of a multi-rank run, before any rank commits to work the
// others might not share. Every rank of an MPI job must run the same binary on
// the same resolved config: an MPMD launch (`mpirun -np 1 origami train a.toml
// : -np 1 origami train b.toml`) or a stale file on one node would otherwise
// train with silently different settings, or split communicators that do not
// fit together.
#pragma once
#include "comm/communicator.h"
#include "engine/config.h"

namespace origami {

// Collective over `world`: compares a digest of the binary's version and the
// resolved config (canonical_text) across ranks; one all_reduce when they
// agree. When they differ, throws a JobError on every rank naming each key
// that differs with its value on each rank (status kExitUserError).
void check_same_run(comm::Communicator& world, const Config& cfg);

}  // namespace origami
