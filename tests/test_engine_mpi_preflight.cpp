// The start-up checks that compare ranks (run under `mpirun -np 4`, one node):
// check_one_rank_per_gpu over the node's communicator, given the UUID each
// rank's GPU would have, and check_same_nccl_setup given each rank's NCCL
// environment and version. On the CPU the UUIDs are made up; on a GPU the
// trainer passes cuda_device_uuid (tests/test_cli_cuda.cpp refuses two ranks
// on one real GPU through the binary).
#include <gtest/gtest.h>
#include <mpi.h>

#include <map>
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

// An environment of the given variables only.
std::function<const char*(const char*)> environment(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(PreflightMpi, NcclSetupLinesNameTheVersionAndTheTuningVariablesSet) {
  const std::string lines = nccl_setup_lines(
      environment({{"NCCL_PROTO", "Simple"}, {"NCCL_DEBUG", "INFO"}, {"NCCL_SOCKET_IFNAME", "eth0"},
                   {"NCCL_BUFFSIZE", ""}, {"NCCL_ALGO", "Ring\nTree"}}),
      "2.28.3");
  // Set ones only; per-node variables (interfaces, debug output) left out;
  // one line per variable whatever its value holds.
  EXPECT_EQ(lines, "nccl.library = 2.28.3\nNCCL_ALGO = Ring Tree\nNCCL_PROTO = Simple\nNCCL_BUFFSIZE = (empty)\n");
  EXPECT_EQ(nccl_setup_lines(environment({}), ""), "nccl.library = (none)\n");
}

// Alike on every rank (per-node variables aside): no error and no exchange
// beyond the digest.
TEST(PreflightMpi, RanksWithTheSameNcclSetupPass) {
  const auto world = comm::whole_mpi(MPI_COMM_WORLD, "everyone", comm::CommOptions{30});
  const std::string ifname = "eth" + std::to_string(world_rank());
  EXPECT_NO_THROW(check_same_nccl_setup(
      *world, nccl_setup_lines(environment({{"NCCL_PROTO", "LL128"}, {"NCCL_SOCKET_IFNAME", ifname}}), "2.28.3")));
}

// Rank 2 forces NCCL's protocol, rank 3 loaded another NCCL: every rank
// throws the same user error, naming each difference and the ranks holding
// each value, and how to pass the variable to every rank.
TEST(PreflightMpi, RanksWithDifferentNcclSetupsAreRefusedNamingTheDifferences) {
  const auto world = comm::whole_mpi(MPI_COMM_WORLD, "everyone", comm::CommOptions{30});
  const int r = world_rank();
  std::map<std::string, std::string> vars = {{"NCCL_MAX_NCHANNELS", "16"}};
  if (r == 2) vars["NCCL_PROTO"] = "Simple";
  try {
    check_same_nccl_setup(*world, nccl_setup_lines(environment(vars), r == 3 ? "2.27.7" : "2.28.3"));
    ADD_FAILURE() << "different NCCL setups were accepted";
  } catch (const JobError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.exit_status(), kExitUserError);
    for (const char* part :
         {"error: the ranks of this CUDA job load different NCCL libraries or set NCCL's tuning variables differently",
          "NCCL_PROTO: (absent) on ranks 0, 1, 3; Simple on rank 2",
          "nccl.library: 2.28.3 on ranks 0, 1, 2; 2.27.7 on rank 3", "mpirun -x NAME"})
      EXPECT_NE(what.find(part), std::string::npos) << part << "\n" << what;
    EXPECT_EQ(what.find("NCCL_MAX_NCHANNELS"), std::string::npos) << "a variable alike everywhere is named: " << what;
  }
}

}  // namespace
}  // namespace origami

int main(int argc, char** argv) { return origami::testing::run_mpi_tests(argc, argv, 1); }
