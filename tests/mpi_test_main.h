// Shared harness of the multi-rank test binaries (tests/test_*_mpi_*.cpp),
// each run whole under `mpirun -np N` by CTest: MPI setup, gtest output from
// rank 0 only (other ranks print their failures tagged with their rank, so a
// multi-rank log reads like a single-rank one), communicators freed before
// MPI_Finalize, an exit status that fails if any rank failed, and one base
// seed for random inputs on every rank (rank 0's).
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <functional>

#include "kernels/check.h"
#include "kernels/threads.h"
#include "test_seed.h"

namespace origami::testing {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", world_rank(), r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.message());
  }
};

// Runs every test with `threads` OpenMP threads per rank (0: cores / local
// ranks); `before_finalize` frees what holds MPI communicators.
inline int run_mpi_tests(int argc, char** argv, int threads = 0, const std::function<void()>& before_finalize = {}) {
  start_mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  set_num_threads(threads > 0 ? threads : default_threads_per_rank());
  uint32_t seed_base = world_rank() == 0 ? test_seed_base() : 0;
  MPI_Bcast(&seed_base, 1, MPI_UINT32_T, 0, MPI_COMM_WORLD);
  set_test_seed_base(seed_base);
  if (world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter);
  }
  int rc = RUN_ALL_TESTS();
  MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (before_finalize) before_finalize();
  MPI_Finalize();
  return rc;
}

}  // namespace origami::testing
