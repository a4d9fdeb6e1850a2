// Thread-count policy for CPU ranks.
#include "kernels/threads.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace origami {

int ranks_on_this_node() {
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  return s ? std::max(1, std::atoi(s)) : 1;
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

void set_num_threads(int threads) { omp_set_num_threads(std::max(1, threads)); }

int num_threads() { return omp_get_max_threads(); }

}  // namespace origami
