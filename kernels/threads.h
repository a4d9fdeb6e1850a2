// CPU threads per rank (ARCHITECTURE.md §2): max(1, cores / ranks on this
// node) unless runtime.threads says otherwise. Applies to our OpenMP loops and
// to oneDNN, which share the OpenMP runtime.
#pragma once

namespace origami {

// Cores of this node divided by the ranks on it, at least 1.
int default_threads_per_rank();
// Ranks of this job on this node, at least 1, and this rank's index among
// them: MPI's shared-memory split once start_mpi ran (any launcher), else
// Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE / _RANK, else 1 and 0.
int ranks_on_this_node();
int local_rank_on_this_node();
// Also gives the team's threads their signal stacks (below).
void set_num_threads(int threads);
int num_threads();

// Gives the calling thread and every thread of the OpenMP team an alternate
// signal stack, once per thread (a thread that has one keeps it). Needed by
// any signal handler installed while kernels run: oneDNN's JIT GEMM points rsp
// into the heap (oneDNN issue #4845), so a handler run on the interrupted
// stack writes its frame over heap memory. Handlers must set SA_ONSTACK.
void install_signal_stacks();

}  // namespace origami
