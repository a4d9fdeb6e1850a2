// The abort path of the check family (kernels/check.h): an internal check
// that fails inside an OpenMP parallel region, on every thread at once and on
// every rank, ends in one message per rank and one clean job abort with exit
// status kExitInternal (4): no second report racing the first inside MPI's
// error printer, no signal, no hang. The DISABLED_ test is the job itself;
// the outer test launches it under mpirun and reads what came out.
#include <gtest/gtest.h>
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <string>
#include <thread>

#include "cli_util.h"
#include "kernels/check.h"

namespace origami {
namespace {

// The line of the failing check below, which every report must name.
constexpr int kCheckLine = __LINE__ + 10;

TEST(CheckAbort, DISABLED_FailsOnEveryThreadOfAParallelRegion) {
  origami::start_mpi(nullptr, nullptr);
  omp_set_dynamic(0);
#pragma omp parallel num_threads(8)
  {
    // Every thread reaches the check together, the worst case for a racy
    // abort path.
#pragma omp barrier
    ORIGAMI_CHECK(omp_get_thread_num() < 0, "thread ", omp_get_thread_num(), " of ", omp_get_num_threads());
  }
  MPI_Finalize();  // not reached
}

// A check failing on a thread of its own (as the NCCL watchdog's, the
// set-up deadline's or the checkpoint writer's would), while the main thread
// waits inside MPI. ORIGAMI_CHILD_THREAD_LEVEL is the level to ask for: at
// MPI_THREAD_MULTIPLE the thread calls MPI_Abort; below it, the thread may
// not call MPI and exits, and mpirun ends the job.
constexpr int kThreadCheckLine = __LINE__ + 10;

TEST(CheckAbort, DISABLED_FailsOnAThreadWhileTheMainThreadWaitsInMpi) {
  const char* level_env = std::getenv("ORIGAMI_CHILD_THREAD_LEVEL");
  ASSERT_NE(level_env, nullptr);
  origami::start_mpi(nullptr, nullptr, std::atoi(level_env));
  std::printf("[rank %d] thread level %d\n", world_rank_for_diagnostics(), mpi_thread_level());
  std::fflush(stdout);
  std::thread failing;
  if (world_rank_for_diagnostics() == 0)
    failing = std::thread([] { ORIGAMI_CHECK(mpi_thread_level() < 0, "level ", mpi_thread_level()); });
  // Every main thread (rank 0's too) waits for a message nobody sends: only
  // the failing thread's abort ends the job.
  int never = 0;
  MPI_Recv(&never, 1, MPI_INT, MPI_ANY_SOURCE, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  failing.join();  // not reached
  MPI_Finalize();
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(CheckAbort, InternalCheckInAParallelRegionAbortsTheJobOnceAndCleanly) {
  char self[PATH_MAX] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  for (int np : {1, 2}) {
    SCOPED_TRACE("np " + std::to_string(np));
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = testing::run_command(std::string(ORIGAMI_MPIEXEC) +
                                        " --allow-run-as-root --oversubscribe --bind-to none -np " +
                                        std::to_string(np) + " " + self +
                                        " --gtest_also_run_disabled_tests --gtest_filter=CheckAbort.DISABLED_*");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[check abort] np %d: exit %d in %.2f s\n", np, r.status, seconds);
    EXPECT_EQ(r.status, kExitInternal) << r.output;
    // At most one report per rank (never one per thread), each naming file,
    // line, rank and the condition. Not always every rank's: the first rank
    // to abort takes the job down, and under load mpirun may kill another
    // rank before its report is out (seen once in a full suite run, np 2).
    const int reports = count(r.output, "check failed: omp_get_thread_num() < 0: thread ");
    EXPECT_GE(reports, 1) << r.output;
    EXPECT_LE(reports, np) << r.output;
    int ranks_reporting = 0;
    for (int rank = 0; rank < np; ++rank)
      ranks_reporting += r.output.find("test_kernels_check.cpp:" + std::to_string(kCheckLine) + " [rank " +
                                       std::to_string(rank) + "] check failed") != std::string::npos;
    EXPECT_EQ(ranks_reporting, reports) << "every report names its own rank, once:\n" << r.output;
    for (const char* crash : {"Segmentation", "signal", "core dumped", "Aborted"})
      EXPECT_EQ(r.output.find(crash), std::string::npos) << crash << " in:\n" << r.output;
    EXPECT_LT(seconds, 20.0) << r.output;
  }
}

TEST(CheckAbort, ACheckFailingOffTheMainThreadEndsTheJobAtEitherThreadLevel) {
  // The MPI_Abort path needs MPI_THREAD_MULTIPLE; start_mpi asks for it, and
  // Open MPI grants it. A library granting less gets the exit path instead,
  // tested here by asking for MPI_THREAD_FUNNELED.
  char self[PATH_MAX] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  for (int level : {MPI_THREAD_MULTIPLE, MPI_THREAD_FUNNELED}) {
    SCOPED_TRACE("thread level " + std::to_string(level));
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = testing::run_command("ORIGAMI_CHILD_THREAD_LEVEL=" + std::to_string(level) + " " +
                                        ORIGAMI_MPIEXEC + " --allow-run-as-root --oversubscribe --bind-to none -np 2 " +
                                        self + " --gtest_also_run_disabled_tests " +
                                        "--gtest_filter=CheckAbort.DISABLED_FailsOnAThread*");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[check abort off the main thread] level %d: exit %d in %.2f s\n", level, r.status, seconds);
    for (int rank : {0, 1})  // the child ran at the level asked for, or it tests nothing
      EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] thread level " + std::to_string(level)),
                std::string::npos)
          << r.output;
    EXPECT_EQ(r.status, kExitInternal) << r.output;
    EXPECT_EQ(count(r.output, "check failed: mpi_thread_level() < 0: level " + std::to_string(level)), 1) << r.output;
    EXPECT_NE(r.output.find("test_kernels_check.cpp:" + std::to_string(kThreadCheckLine) + " [rank 0] check failed"),
              std::string::npos)
        << r.output;
    for (const char* crash : {"Segmentation", "signal", "core dumped", "Aborted"})
      EXPECT_EQ(r.output.find(crash), std::string::npos) << crash << " in:\n" << r.output;
    EXPECT_LT(seconds, 20.0) << r.output;
  }
}

}  // namespace
}  // namespace origami
