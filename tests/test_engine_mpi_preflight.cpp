// The start-up checks that compare ranks (run under `mpirun -np 4`, one node):
// check_one_rank_per_gpu over the node's communicator, given the UUID each
// rank's GPU would have. On the CPU the UUIDs are made up; on a GPU the
// trainer passes cuda_device_uuid (tests/test_cli_cuda.cpp refuses two ranks
// on one real GPU through the binary).
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "comm/mpi_communicator.h"
#include "engine/config.h"
#include "engine/preflight.h"
#include "kernels/check.h"
#include "mpi_test_main.h"

namespace origami {
namespace {

using testing::world_rank;

constexpr int kWorld = 4;

Config tiny_config() {
  Config cfg = load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-moe.toml");
  cfg.runtime.device = RuntimeDevice::cuda;
  return cfg;
}

// Each rank's own GPU (per-rank CUDA_VISIBLE_DEVICES: all cuda:0, distinct
// UUIDs), UUIDs of the longest form nvidia-smi prints: no error, on every rank.
TEST(PreflightMpi, RanksOnTheirOwnGpusPass) {
  ASSERT_EQ(testing::world_size(), kWorld);
  const auto node = comm::node_mpi(MPI_COMM_WORLD, "node", comm::CommOptions{30});
  ASSERT_EQ(node->size(), kWorld) << "one node";
  const std::string uuid = "GPU-1d2c7e0a-5b3f-4c8d-9e6a-00000000000" + std::to_string(world_rank());
  EXPECT_NO_THROW(check_one_rank_per_gpu(*node, tiny_config(), uuid));
}

// Ranks 1 and 3 on one GPU, 0 and 2 on their own: every rank throws the same
// user error, naming runtime.device, the pair and their GPU, and the fix.
TEST(PreflightMpi, TwoRanksOnOneGpuAreRefusedOnEveryRankNamingThem) {
  const auto node = comm::node_mpi(MPI_COMM_WORLD, "node", comm::CommOptions{30});
  const int r = world_rank();
  const std::string uuid = r % 2 == 1 ? "GPU-shared" : "GPU-own-" + std::to_string(r);
  try {
    check_one_rank_per_gpu(*node, tiny_config(), uuid);
    ADD_FAILURE() << "two ranks on GPU-shared were accepted";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("runtime.device = \"cuda\" runs one GPU per rank, but ranks 1, 3 share GPU GPU-shared "),
              std::string::npos)
        << what;
    EXPECT_EQ(what.find("GPU-own"), std::string::npos) << "a rank on its own GPU is named: " << what;
    EXPECT_NE(what.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace origami

int main(int argc, char** argv) { return origami::testing::run_mpi_tests(argc, argv, 1); }
