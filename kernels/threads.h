// CPU threads per rank (ARCHITECTURE.md §2): max(1, cores / ranks on this
// node) unless runtime.threads says otherwise. Applies to our OpenMP loops and
// to oneDNN, which share the OpenMP runtime.
#pragma once

namespace origami {

// Cores of this node divided by the ranks on it (OMPI_COMM_WORLD_LOCAL_SIZE),
// at least 1.
int default_threads_per_rank();
// Ranks of this job on this node (OMPI_COMM_WORLD_LOCAL_SIZE), at least 1.
int ranks_on_this_node();
void set_num_threads(int threads);
int num_threads();

}  // namespace origami
