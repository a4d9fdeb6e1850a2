// A rank that skips a collective must not hang the job: the ranks waiting in
// it time out after collective_timeout_s, print rank, group, op, sequence
// number, bytes and where the memory lives, then where the group's other
// members are (comm/census.h: the rank that never came gives no answer, or
// names the op it waits in instead), and MPI_Abort takes every rank down
// with a non-zero exit.
//
// The test (one process, no MPI) launches this same binary under mpirun in
// child mode (`--hang-child SCENARIO TIMEOUT`), where one rank skips a
// collective and every rank then stays busy, and checks exit status, wall
// time and the message.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <regex>
#include <thread>

#include "cli_util.h"
#include "comm/census.h"
#include "comm/groups.h"
#include "comm/mpi_communicator.h"
#include "comm/setup_deadline.h"

namespace origami::comm {
namespace {

// ---- child mode: runs under mpirun ------------------------------------------------------------------

int run_child(const std::string& scenario, double timeout_s) {
  origami::start_mpi(nullptr, nullptr);
  int rank = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  LayoutOptions o;
  GroupKind kind = GroupKind::dp;
  int skipper = 1;
  if (scenario == "ep_all_to_all_v") {  // W = 4: tp = 2 dense, ep = 2 expert
    o.tp = 2;
    o.ep = 2;
    kind = GroupKind::ep;
    skipper = 3;
  }
  if (scenario == "pp_recv") {  // W = 2, pp = 2: stage 0 receives what stage 1 never sends
    o.pp = 2;
    kind = GroupKind::pp;
  }
  if (scenario == "groups_setup" && rank == 1) {  // never joins the groups' set-up
    std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s + 60));
    std::printf("[rank %d] still alive\n", rank);
    MPI_Finalize();
    return 0;
  }
  Groups g = Groups::create(Layout(world, o), MPI_COMM_WORLD,
                            GroupsOptions{.comm = CommOptions{timeout_s}, .setup_timeout_s = timeout_s});
  Communicator& c = g[kind];
  // Where the dp_elsewhere skipper waits instead: a group of its own whose
  // timeout outlasts the others' census, so it is still there to answer.
  const std::unique_ptr<MpiCommunicator> elsewhere =
      whole_mpi(MPI_COMM_WORLD, "elsewhere", CommOptions{timeout_s + 60});
  const size_t n = static_cast<size_t>(c.size());
  std::vector<float> v(std::max<size_t>(8, 2 * n), 1.0f), out(2 * n, 1.0f);
  const std::vector<int64_t> counts(n, 2);
  auto step = [&] {
    if (scenario == "pp_recv") {  // 8 floats from stage 1 to stage 0
      if (c.rank() == 0) c.recv(std::span(v.data(), 8), 1);
      else c.send(std::span<const float>(v.data(), 8), 0);
    } else if (scenario == "ep_all_to_all_v")
      c.all_to_all_v(std::span<const float>(out), counts, std::span(v.data(), 2 * n), counts);
    else
      c.all_reduce(std::span(v.data(), 8));
  };
  step();  // seq 0
  step();  // seq 1
  // The skipper misses seq 2, as a rank lost in a data-dependent branch would.
  // Ranks in other groups complete it. Then everyone stays busy: only the
  // abort from the ranks stuck in seq 2 may end this job.
  if (rank != skipper)
    step();  // seq 2
  else if (scenario == "dp_elsewhere")  // stuck in another group's op that no one else joins
    elsewhere->all_reduce(std::span(v.data(), 8));
  std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s + 60));
  std::printf("[rank %d] still alive\n", rank);
  MPI_Finalize();
  return 0;
}

// ---- the test ------------------------------------------------------------------------------------------

struct Outcome {
  testing::CommandResult result;
  double seconds = 0;
};

Outcome launch(const std::string& scenario, int np, double timeout_s) {
  // mpirun's daemons exec the path themselves, so /proc/self/exe must be resolved here.
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  EXPECT_GT(n, 0);
  const std::string cmd = std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe -n " +
                          std::to_string(np) + " " + self + " --hang-child " + scenario + " " +
                          std::to_string(timeout_s);
  const auto t0 = std::chrono::steady_clock::now();
  Outcome o;
  o.result = testing::run_command(cmd);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

constexpr double kTimeout = 3.0;

// A rank that never reaches the rank groups' set-up: the others stand in
// MPI_Comm_split, which has no timeout of its own; the set-up's deadline
// (GroupsOptions::setup_timeout_s; the trainer's is collective_timeout_s)
// ends the job naming the group.
TEST(CommTimeout, ARankMissingTheGroupsSetUpAbortsTheOthersNamingTheGroup) {
  const Outcome o = launch("groups_setup", 3, kTimeout);
  EXPECT_EQ(o.result.status, kExitTimeout) << o.result.output;
  EXPECT_LT(o.seconds, kTimeout + 10) << o.result.output;
  EXPECT_GE(o.seconds, kTimeout) << o.result.output;
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank (0|2)\] set-up timeout: group world )"
                                                            R"(\(MPI_Comm_split\) not done 3\.\d s after it began)")))
      << o.result.output;
  EXPECT_EQ(o.result.output.find("still alive"), std::string::npos) << o.result.output;
}

TEST(CommTimeout, SkippedAllReduceAbortsEveryRankNamingTheCall) {
  const Outcome o = launch("dp_all_reduce", 3, kTimeout);
  EXPECT_NE(o.result.status, 0) << o.result.output;
  EXPECT_LT(o.seconds, kTimeout + 10) << o.result.output;
  EXPECT_GE(o.seconds, kTimeout) << o.result.output;
  // all_reduce of 8 floats over 3 ranks: rank 0 owns block 0 (3 elements) and
  // sends 2·5·4 = 40 bytes; rank 2 owns 2 elements and sends 2·6·4 = 48.
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank (0|2)\] collective timeout: group dp op )"
                                                            R"(all_reduce seq 2 bytes (40|48) memory cpu after 3\.\d s)")))
      << o.result.output;
  // The census: the skipper, busy elsewhere, cannot answer; the other
  // waiting rank waits in this op too.
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank (0|2)\] where the other 2 members of group dp are)")))
      << o.result.output;
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank (0|2)\]   rank 1: no answer \(not in a host wait )"
                                                            R"(of a collective: still computing, blocked elsewhere, )"
                                                            R"(stopped, or gone\))")))
      << o.result.output;
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank (0|2)\]   rank (0|2): waiting in this op too)")))
      << o.result.output;
  EXPECT_EQ(o.result.output.find("still alive"), std::string::npos) << o.result.output;
}

// The skipper stuck in another group's op instead: its answer names that op.
TEST(CommTimeout, TheTimeoutReportNamesTheOpTheMissingRankWaitsIn) {
  const Outcome o = launch("dp_elsewhere", 3, kTimeout);
  EXPECT_NE(o.result.status, 0) << o.result.output;
  EXPECT_LT(o.seconds, kTimeout + 10) << o.result.output;
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank (0|2)\]   rank 1: waiting in group elsewhere )"
                                                            R"(op all_reduce seq 0, [0-9.]+ s so far)")))
      << o.result.output;
  EXPECT_EQ(o.result.output.find("still alive"), std::string::npos) << o.result.output;
}

TEST(CommTimeout, SkippedExpertAllToAllAbortsNamingTheExpertGroup) {
  const Outcome o = launch("ep_all_to_all_v", 4, kTimeout);
  EXPECT_NE(o.result.status, 0) << o.result.output;
  EXPECT_LT(o.seconds, kTimeout + 10) << o.result.output;
  // Rank 2's ep group is [2, 3]; it sends its 2 floats to rank 3: 8 bytes.
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank 2\] collective timeout: group ep op )"
                                                            R"(all_to_all_v seq 2 bytes 8 memory cpu after 3\.\d s)")))
      << o.result.output;
  EXPECT_NE(o.result.output.find("[rank 2]   rank 3: no answer"), std::string::npos) << o.result.output;
  EXPECT_EQ(o.result.output.find("still alive"), std::string::npos) << o.result.output;
}

// The census's arithmetic (comm/census.h): whom a timed-out rank asks, and
// how the answers read.
TEST(Census, EachRankAsksTheNextMembersAndTheReportGroupsTheAnswers) {
  const std::vector<int> five = {0, 2, 4, 6, 8};
  EXPECT_EQ(census::whom_to_ask(five, 4), (std::vector<int>{6, 8, 0, 2}));
  std::vector<int> world(40);
  std::iota(world.begin(), world.end(), 0);
  std::vector<int> after_38 = {39};
  for (int r = 0; r <= 30; ++r) after_38.push_back(r);
  EXPECT_EQ(census::whom_to_ask(world, 38), after_38) << "the next 32, wrapping";
  // Every member is asked by the 32 ranks before it.
  std::vector<int> asked(40, 0);
  for (int me = 0; me < 40; ++me)
    for (int r : census::whom_to_ask(world, me)) ++asked[static_cast<size_t>(r)];
  EXPECT_EQ(asked, std::vector<int>(40, census::kAskAtMost));

  const std::string op = "group dp op all_reduce seq 2";
  const std::vector<census::Answer> answers = {{1, false, {}},
                                               {2, false, {}},
                                               {3, false, {}},
                                               {5, false, {}},
                                               {6, false, {}},
                                               {4, true, op + ", 3.0 s so far"},
                                               {7, true, "group pp op recv (from world rank 9, 64 bytes) seq 4, 2.5 s so far"},
                                               {8, true, op + ", 3.1 s so far"}};
  EXPECT_EQ(census::report(answers, op),
            (std::vector<std::string>{"ranks 1-3, 5, 6: no answer (not in a host wait of a collective: still computing, "
                                      "blocked elsewhere, stopped, or gone)",
                                      "rank 7: waiting in group pp op recv (from world rank 9, 64 bytes) seq 4, 2.5 s so far",
                                      "ranks 4, 8: waiting in this op too"}));
}

// Time a process did not run (RunningClock, kernels/check.h): gaps of over
// a second between polls are left out; shorter ones count.
TEST(RunningClock, GapsOfOverASecondBetweenPollsAreNotRunTime) {
  using namespace std::chrono;
  const RunningClock::Clock::time_point t0{};
  RunningClock c(t0);
  EXPECT_DOUBLE_EQ(c.seconds(t0 + milliseconds(500)), 0.5);
  EXPECT_DOUBLE_EQ(c.seconds(t0 + milliseconds(1400)), 1.4);   // 0.9 s since the last poll: ran
  EXPECT_DOUBLE_EQ(c.seconds(t0 + milliseconds(9400)), 1.4);   // 8 s without a poll: suspended
  EXPECT_EQ(c.poll_gap(t0 + milliseconds(9500)), RunningClock::Clock::duration{});
  EXPECT_DOUBLE_EQ(c.seconds(t0 + milliseconds(10000)), 2.0);
}

// A set-up deadline (comm/setup_deadline.h) in a process stopped past it
// and resumed (the job suspended while a group was being set up): the time
// stopped does not count, and the guard released after the resume ends
// nothing. A second process, not stopped, runs out as before.
TEST(RunningClock, ASetUpDeadlineLeavesOutTheTimeAProcessWasStopped) {
  auto child = [](double hold_s) {
    const pid_t pid = fork();
    if (pid == 0) {
      {
        SetupDeadline guard(1.0, "group test (a child's)");
        std::this_thread::sleep_for(std::chrono::duration<double>(hold_s));
      }
      std::_Exit(0);
    }
    return pid;
  };
  const pid_t stopped = child(0.6);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(kill(stopped, SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  ASSERT_EQ(kill(stopped, SIGCONT), 0);
  int status = 0;
  ASSERT_EQ(waitpid(stopped, &status, 0), stopped);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  const pid_t late = child(2.0);
  ASSERT_EQ(waitpid(late, &status, 0), late);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == kExitTimeout) << "status " << status;
}

// A receive waits on one peer: its line names that peer and what it expected.
TEST(CommTimeout, AReceiveNeverSentAbortsNamingThePeer) {
  const Outcome o = launch("pp_recv", 2, kTimeout);
  EXPECT_NE(o.result.status, 0) << o.result.output;
  EXPECT_LT(o.seconds, kTimeout + 10) << o.result.output;
  EXPECT_TRUE(std::regex_search(o.result.output, std::regex(R"(\[rank 0\] collective timeout: group pp op recv )"
                                                            R"(\(from world rank 1, 32 bytes\) seq 2 bytes 0 )"
                                                            R"(memory cpu after 3\.\d s)")))
      << o.result.output;
  EXPECT_EQ(o.result.output.find("still alive"), std::string::npos) << o.result.output;
}

}  // namespace
}  // namespace origami::comm

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "--hang-child") == 0)
    return origami::comm::run_child(argv[2], std::atof(argv[3]));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
