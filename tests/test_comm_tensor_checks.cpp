// A Tensor collective the caller got wrong must end the job with a message
// that says what was wrong — mismatched dtypes, a dtype collectives do not
// move, a size that does not fit the group — as
// an internal check (exit status 4), before the call takes a sequence number.
//
// The test (one process, no MPI) launches this same binary under
// `mpirun -np 1` in child mode (`--check-child SCENARIO`), where the scenario
// makes one bad call, and reads what came out.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "cli_util.h"
#include "comm/groups.h"
#include "kernels/check.h"

namespace origami::comm {
namespace {

// ---- child mode: runs under mpirun ------------------------------------------------------------------

int run_child(const std::string& scenario) {
  origami::start_mpi(nullptr, nullptr);
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Groups g = Groups::create(Layout(world, LayoutOptions{}), MPI_COMM_WORLD, GroupsOptions{.comm = CommOptions{30}});
  Communicator& c = g[GroupKind::dp];
  auto t = [](Shape s, DType dt) { return Tensor::zeros(std::move(s), dt, MemCategory::comm); };
  if (scenario == "dtype") c.all_gather(t({4}, DType::f32), t({4}, DType::i32));
  if (scenario == "u8") c.broadcast(t({4}, DType::u8), 0);
  if (scenario == "size") c.all_gather(t({4}, DType::i64), t({3}, DType::i64));
  if (scenario == "undefined") c.send(Tensor(), 0);
  std::printf("scenario %s: no check fired\n", scenario.c_str());
  MPI_Finalize();
  return 0;
}

// ---- the test ------------------------------------------------------------------------------------------

TEST(CommTensorChecks, EveryBadCallAbortsNamingTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"dtype", "group dp all_gather: send is f32, recv is i32"},
      {"u8", "group dp broadcast: data tensor is u8, which collectives do not move"},
      {"size", "group dp all_gather: recv holds 3 elements, expected 1 x 4"},
      {"undefined", "group dp send: data tensor is undefined"},
  };
  for (const auto& [scenario, message] : cases) {
    SCOPED_TRACE(scenario);
    const testing::CommandResult r = testing::run_child_scenario(1, scenario);
    EXPECT_EQ(r.status, kExitInternal) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("no check fired"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace origami::comm

int main(int argc, char** argv) {
  if (const char* scenario = origami::testing::child_scenario(argc, argv)) return origami::comm::run_child(scenario);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
