// Checks at the start of a multi-rank run, before any rank commits to work the
// others might not share. Every rank of an MPI job must run the same binary on
// the same resolved config: an MPMD launch (`mpirun -np 1 origami train a.toml
// : -np 1 origami train b.toml`) or a stale file on one node would otherwise
// train with silently different settings, or split communicators that do not
// fit together.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "comm/agreement.h"
#include "comm/communicator.h"
#include "engine/config.h"

namespace origami {

// Collective over `world`: compares a digest of the binary's version and the
// resolved config (canonical_text) across ranks; one all_reduce when they
// agree. When they differ, throws a JobError on every rank naming each key
// that differs with its value on each rank (status kExitUserError).
void check_same_run(comm::Communicator& world, const Config& cfg);

// Collective over `world`: whether every rank passed the same `text` (one
// all_reduce of a 62-bit digest, min and max at once).
bool same_on_every_rank(comm::Communicator& world, const std::string& text);

// Collective over `world`, `text` being "key = value" lines: returns when
// every rank passed the same; else throws a JobError on every rank, "error:
// <rule>; differing keys:" and each key that differs with its value on each
// rank (the texts travel only then).
void check_same_lines(comm::Communicator& world, const std::string& text, const std::string& rule);

// The NCCL setup that must be alike on every rank of a CUDA job, as "key =
// value" lines: the library's version (`nccl_version`, "" for none) and each
// of NCCL's variables that steer its choice of algorithm, protocol, channels
// or buffer sizes which `env` (getenv) finds set. Ranks of a communicator
// that choose differently for one collective wait on each other forever
// (NCCL's maintainers: set the environment alike on every rank; mpirun -x
// passes it to other nodes). Variables that may rightly differ per node
// (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG_FILE, ...) are not among them.
std::string nccl_setup_lines(const std::function<const char*(const char*)>& env, const std::string& nccl_version);

// Collective over `world`: check_same_lines over nccl_setup_lines, the
// JobError naming each variable (or the version) that differs per rank.
void check_same_nccl_setup(comm::Communicator& world, const std::string& lines);

// The rule broken when ranks of one node would train on one GPU, or "":
// `gpu_by_node_rank[i]` is the UUID of the GPU the node's i-th rank trains
// on, `world_rank_by_node_rank[i]` that rank's place in the job. UUIDs, not
// device indices: with CUDA_VISIBLE_DEVICES per rank every rank's GPU is
// cuda:0, and distinct.
std::string shared_gpu_rule(const std::vector<std::string>& gpu_by_node_rank,
                            const std::vector<int>& world_rank_by_node_rank);

// Collective over `node` (the ranks of this node), each passing the UUID of
// the GPU it trains on (cuda_device_uuid): UserError naming runtime.device,
// the ranks and the GPU when two of them train on one GPU (NCCL refuses two
// ranks of a communicator on one device, and they would share its memory).
void check_one_rank_per_gpu(comm::Communicator& node, const Config& cfg, const std::string& gpu_uuid);

// UserError naming the environment variable and parallel.pp / parallel.cp
// when a CUDA run's point-to-point channels (a pipeline, or ring attention)
// would meet serialised streams (cuda_stream_serialization_rule,
// kernels/device.h). Reads this process's environment.
void check_cuda_streams_run_apart(const Config& cfg);

// Collective over `everyone` (the whole job), after rank 0 created
// cfg.checkpoint.dir: rank 0 creates a file of a random name in it and every
// other rank looks for it there. Each rank writes its shards into its own view
// of checkpoint.dir and rank 0 commits them, so views that differ (a relative
// path under per-rank working directories, node-local disks) would publish
// checkpoints that name files no one can load. UserError on the ranks that do
// not see it, agreed within `wait`; the file is removed either way. Nothing
// without a checkpoint.dir or on one rank.
void check_shared_checkpoint_dir(comm::Communicator& everyone, const Config& cfg, const comm::MeetingWait& wait);

// Collective over `everyone`: the corpus every rank opened through data.path
// has the same documents and tokens (counts compared; the config's text
// alone passes a relative path that names different files per rank).
// JobError naming the counts per rank otherwise.
void check_same_corpus(comm::Communicator& everyone, int64_t documents, int64_t tokens);

}  // namespace origami
