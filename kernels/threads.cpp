// Thread-count policy for CPU ranks, and the alternate signal stacks of the
// threads that run kernels.
#include "kernels/threads.h"

#include <omp.h>
#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/check.h"

namespace origami {

// MPI's own node split once MPI is up (check.h, start_mpi); before that
// (or without MPI) Open MPI's variables, else one rank alone.
int ranks_on_this_node() {
  if (const auto placed = mpi_node_placement()) return placed->second;
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  return s ? std::max(1, std::atoi(s)) : 1;
}

int local_rank_on_this_node() {
  if (const auto placed = mpi_node_placement()) return placed->first;
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return s ? std::max(0, std::atoi(s)) : 0;
}

int default_threads_per_rank() {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int threads = std::max(1, cores / ranks_on_this_node());
  // mpirun binds each rank to a core by default at small rank counts: more
  // threads than the cores this process may run on only time-slice.
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof mask, &mask) == 0) threads = std::min(threads, std::max(1, CPU_COUNT(&mask)));
  return threads;
}

void set_num_threads(int threads) {
  omp_set_num_threads(std::max(1, threads));
  install_signal_stacks();  // the team may have grown
}

int num_threads() { return omp_get_max_threads(); }

namespace {

// One thread's alternate signal stack; removed before its memory goes at
// thread exit. A thread that already had one (a sanitizer's, say) keeps it.
class SignalStack {
 public:
  SignalStack() {
    stack_t current{};
    ORIGAMI_CHECK(sigaltstack(nullptr, &current) == 0, "sigaltstack: ", std::strerror(errno));
    if (!(current.ss_flags & SS_DISABLE)) return;
    memory_.resize(kBytes);
    stack_t ss{};
    ss.ss_sp = memory_.data();
    ss.ss_size = memory_.size();
    ORIGAMI_CHECK(sigaltstack(&ss, nullptr) == 0, "sigaltstack of ", kBytes, " bytes: ", std::strerror(errno));
  }
  ~SignalStack() {
    if (memory_.empty()) return;
    stack_t off{};
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);  // at thread exit nothing is left to report a failure to
  }
  SignalStack(const SignalStack&) = delete;
  SignalStack& operator=(const SignalStack&) = delete;

 private:
  static constexpr size_t kBytes = 64 << 10;  // well above SIGSTKSZ for a handler that stores one atomic
  std::vector<char> memory_;
};

void install_signal_stack_on_this_thread() { thread_local SignalStack stack; }

}  // namespace

void install_signal_stacks() {
  install_signal_stack_on_this_thread();
#pragma omp parallel
  install_signal_stack_on_this_thread();
}

}  // namespace origami
