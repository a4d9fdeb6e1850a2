// The in-flight check (comm/in_flight_check.h) finds each way of touching a
// buffer while its op is in flight — the races a GPU run would have — and
// ends the job naming group, op, sequence number and element (an internal
// check, exit status 4); the same calls made in the right order pass.
//
// The test (one process, no MPI) launches this same binary under
// `mpirun -np 2` in child mode (`--check-child SCENARIO`), where the
// scenario makes its calls on the world group, and reads what came out.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "cli_util.h"
#include "comm/groups.h"
#include "kernels/check.h"

namespace origami::comm {
namespace {

// ---- child mode: runs under mpirun ------------------------------------------------------------------

Tensor filled(int64_t n, float first) {
  Tensor t = Tensor::empty({n}, DType::f32, MemCategory::comm);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = first + static_cast<float>(i);
  return t;
}

int run_child(const std::string& scenario) {
  origami::start_mpi(nullptr, nullptr);
  {
    Groups g = Groups::create(Layout(2, LayoutOptions{}), MPI_COMM_WORLD,
                              GroupsOptions{.comm = CommOptions{.timeout_s = 30, .check_in_flight = true}});
    Communicator& c = g.world();
    const int peer = 1 - c.rank();
    c.barrier();  // seq 0, so the op under test is seq 1
    // 64 Ki floats: a block the host allocator caches, as the GPU's would be.
    Tensor send = filled(1 << 16, 1.0f), recv = filled(2 << 16, -1.0f);
    Request r = c.all_gather_async(send, recv);
    if (scenario == "write-send") send.data<float>()[70] = 5.0f;  // the op may not have read it yet
    if (scenario == "write-recv") recv.data<float>()[9] = 5.0f;   // the op writes it later
    if (scenario == "free-send") send = Tensor();                 // the block may go to the next tensor
    if (scenario == "free-recv") recv = Tensor();
    if (scenario == "read-recv") {  // too early: poison, never the peer's values
      const float v = recv.data<float>()[(1 << 16) * peer + 3];
      std::printf("read before the wait: %s\n", v == v ? "a number" : "NaN");
    }
    c.complete(r);
    // In order: after the wait every buffer is the caller's again.
    send.data<float>()[70] = 5.0f;
    const float got = recv.data<float>()[(1 << 16) * peer + 3];
    send = Tensor();
    recv = Tensor();
    std::printf("rank %d: no check fired, received %g\n", c.rank(), got);
  }
  MPI_Finalize();
  return 0;
}

// ---- the test ------------------------------------------------------------------------------------------

testing::CommandResult run_scenario(const std::string& scenario) { return testing::run_child_scenario(2, scenario); }

TEST(CommInFlight, EachTouchOfABufferInFlightEndsTheJobNamingTheOp) {
  const std::pair<const char*, const char*> cases[] = {
      {"write-send", "group world all_gather seq 1: its send buffer was written while the op was in flight (f32 "
                     "element 70 of 65536 changed)"},
      {"write-recv", "group world all_gather seq 1: its receive buffer was written while the op was in flight (f32 "
                     "element 9 of 131072)"},
      {"free-send", "cpu buffer of 262144 bytes (comm) freed while group world all_gather seq 1 was in flight on it"},
      {"free-recv", "cpu buffer of 524288 bytes (comm) freed while group world all_gather seq 1 was in flight on it"},
  };
  for (const auto& [scenario, message] : cases) {
    SCOPED_TRACE(scenario);
    const testing::CommandResult r = run_scenario(scenario);
    EXPECT_EQ(r.status, kExitInternal) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("no check fired"), std::string::npos) << r.output;
  }
}

TEST(CommInFlight, AReadBeforeTheWaitMeetsPoisonAndTheWaitDeliversTheResult) {
  const testing::CommandResult r = run_scenario("read-recv");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("read before the wait: NaN"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("a number"), std::string::npos) << r.output;
  // Rank p's block is p's send: 1, 2, 3, ... so element 3 of the peer's block is 4.
  EXPECT_NE(r.output.find("rank 0: no check fired, received 4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1: no check fired, received 4"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace origami::comm

int main(int argc, char** argv) {
  if (const char* scenario = origami::testing::child_scenario(argc, argv)) return origami::comm::run_child(scenario);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
