// Faults users hit in real runs, through the real binary, at one rank and
// under mpirun: each ends promptly with the right exit status (2 bad input,
// 3 divergence) on every rank, one message naming the file, key or offset and
// the rule, and never by a signal, a hang or exit 0. One test per class:
// divergence, oversized and overflowing configs, a failure on rank 0 only, an
// error on a non-zero rank, ranks with different configs, writes that fail,
// inputs that are FIFOs or not what they claim (malformed safetensors,
// contradicting eval overrides, Megatron's index rules), and the CLI's own
// argument checks. The internal-check abort path is test_kernels_check.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

#include "cli_util.h"

namespace origami {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::read_jsonl;
using testing::write_file;

const std::string kBinary = ORIGAMI_BINARY;
const std::string kMpirun = std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none";
// Promptly: every case here takes about a second (mpirun start-up included);
// the bound is far below runtime.collective_timeout_s (300 s), which is what
// a rank left waiting in a collective would take.
constexpr double kPromptSeconds = 20.0;

struct Outcome {
  int status = -1;
  std::string output;
  double seconds = 0;
};

Outcome run(const std::string& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = testing::run_command(cmd);
  return {r.status, r.output, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The contract of every case: status, each needle, promptly, no crash, and
// the error reported once (not once per rank).
void expect_outcome(const std::string& what, const Outcome& r, int status, std::initializer_list<std::string> needles) {
  SCOPED_TRACE(what);
  std::printf("[fault] %-58s exit %d in %.2f s\n", what.c_str(), r.status, r.seconds);
  EXPECT_EQ(r.status, status) << r.output;
  for (const std::string& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "missing '" << n << "' in:\n" << r.output;
  EXPECT_LT(r.seconds, kPromptSeconds) << r.output;
  for (const char* crash : {"Segmentation", "signal", "core dumped", "check failed", "internal error", "timeout"})
    EXPECT_EQ(r.output.find(crash), std::string::npos) << "'" << crash << "' in:\n" << r.output;
  EXPECT_LE(count(r.output, "error:") + count(r.output, "error ["), 1) << "reported more than once:\n" << r.output;
}

class CliFaults : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::ScratchDir("faults");
    std::string text;
    for (int i = 0; i < 200; ++i) text += "Pack my box with five dozen liquor jugs, line " + std::to_string(i) + ".\n";
    write_file(*dir_ / "corpus.txt", text);
    auto r = testing::run_command(kBinary + " preprocess --format text --input " + (*dir_ / "corpus.txt") +
                                  " --output-prefix " + (*dir_ / "data"));
    ASSERT_EQ(r.status, 0) << r.output;
    write_file(*dir_ / "moe.toml", config(*dir_ / "data"));
    // The weights of the config: a top-2 softmax MoE.
    r = testing::run_command(kBinary + " train " + (*dir_ / "moe.toml") + " --set training.steps=0 --set export.dir=" +
                             (*dir_ / "weights"));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static void TearDownTestSuite() { delete dir_; }

  // Two layers (dense, then 4 experts top-2), EP-splittable over 2 ranks.
  static std::string config(const std::string& data) {
    return "[model]\nvocab_size = 257\nhidden_size = 32\nnum_layers = 2\nnum_heads = 2\nnum_kv_heads = 1\n"
           "ffn_hidden_size = 48\n[moe]\nnum_experts = 4\ntop_k = 2\nfirst_dense_layers = 1\n"
           "[training]\nsteps = 4\nseq_len = 16\nglobal_batch = 4\nmicro_batch = 2\n[data]\npath = \"" +
           data + "\"\n";
  }
  static std::string path(const std::string& name) { return *dir_ / name; }
  static Outcome train(const std::string& args, int np = 1) {
    const std::string launcher = np == 1 ? kBinary : kMpirun + " -np " + std::to_string(np) + " " + kBinary;
    return run(launcher + " train " + path("moe.toml") + (np > 1 ? " --set parallel.ep=" + std::to_string(np) : "") +
               " " + args);
  }
  static Outcome eval(const std::string& weights, const std::string& args = "", int np = 1) {
    const std::string launcher = np == 1 ? kBinary : kMpirun + " -np " + std::to_string(np) + " " + kBinary;
    return run(launcher + " eval " + path("moe.toml") + " --weights " + weights + " --data " + path("data") +
               " --samples 4 " + args);
  }
  // A copy of the good weights whose safetensors header `edit` rewrites.
  static std::string weights_with_header(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const std::string dir = path(name);
    fs::create_directories(dir);
    fs::copy_file(path("weights/config.json"), dir + "/config.json", fs::copy_options::overwrite_existing);
    const std::string file = read_file(path("weights/model.safetensors"));
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);
    nlohmann::json header = nlohmann::json::parse(file.substr(8, n));
    edit(header);
    std::string text = header.dump();
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(text.size() >> (8 * i));
    write_file(dir + "/model.safetensors", out + text + file.substr(8 + n));
    return dir;
  }

  static testing::ScratchDir* dir_;
};
testing::ScratchDir* CliFaults::dir_ = nullptr;

TEST_F(CliFaults, DivergedTrainingStopsBeforeTheUpdateWithStatus3) {
  auto r = train("--set optimizer.lr=1e30 --set logging.dir=" + path("div1"));
  expect_outcome("diverged: optimizer.lr = 1e30, 1 rank", r, 3,
                 {"training diverged at step 2 of 4", "grad norm is not finite", "optimizer.lr = 1e+30",
                  "stopped before the optimizer applied this step", "those of step 1", "model.init_std"});
  // The diverged step never reached the metrics: the run stopped before it.
  EXPECT_EQ(count(read_file(path("div1/metrics.jsonl")), "\n"), 1);
  r = train("--set model.init_std=1e30");
  expect_outcome("diverged: model.init_std = 1e30, 1 rank", r, 3,
                 {"training diverged at step 1", "not finite", "model.init_std = 1e+30", "untouched"});
  // Infinite weights: NaN from the first norm on, through the router's
  // top-k (valid experts, NaN weights: kernels/moe_ops.h) and every kernel
  // of the step after it, the losses NaN.
  r = train("--set model.init_std=1e38");
  expect_outcome("diverged: model.init_std = 1e38, 1 rank", r, 3,
                 {"training diverged at step 1", "lm loss nan", "model.init_std = 1e+38"});
  r = train("--set optimizer.lr=1e30", 2);
  expect_outcome("diverged: optimizer.lr = 1e30, 2 ranks", r, 3,
                 {"error: training diverged at step 2 of 4", "optimizer.lr = 1e+30"});
  // Weights that are not finite cannot be evaluated.
  const std::string bad = path("nan-weights");
  fs::create_directories(bad);
  fs::copy_file(path("weights/config.json"), bad + "/config.json", fs::copy_options::overwrite_existing);
  std::string st = read_file(path("weights/model.safetensors"));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(st.data() + st.size() - 4, &nan, 4);  // the last element of the last tensor
  write_file(bad + "/model.safetensors", st);
  r = eval(bad);
  expect_outcome("eval of weights holding NaN", r, 2, {bad + "/model.safetensors", "tensor '", "is nan", "finite"});
}

// Settings that need more memory than the rank has (here a 1.2 GB address
// space, `ulimit -v`, against ~1.1 GB of training state, which the start-up
// estimate against the machine's memory lets through): status 2 at the
// failing allocation, with the rank's ledger by category and what to
// change, not an internal error. One thread and two malloc arenas, so
// that a many-core machine's per-thread address space (64 MB an arena)
// cannot fail the start instead.
TEST_F(CliFaults, RunningOutOfMemoryIsStatus2WithTheLedger) {
  const auto r = run("bash -c 'ulimit -v 1200000 && MALLOC_ARENA_MAX=2 exec " + kBinary + " train " +
                     path("moe.toml") +
                     " --set runtime.threads=1 --set model.hidden_size=1024 --set model.ffn_hidden_size=4096 "
                     "--set moe.ffn_hidden_size=4096 --set export.dir='");
  expect_outcome("out of memory: ~1.1 GB of state in a 1.2 GB address space", r, 2,
                 {"error [rank 0]: out of memory on cpu: an allocation of ", " bytes live (param ", ", optim ",
                  "the run needs less memory per rank: a smaller training.micro_batch"});
}

TEST_F(CliFaults, OversizedAndOverflowingConfigsAreRefusedNamingKeyAndLimit) {
  const struct {
    std::string set;
    std::vector<std::string> needles;
  } cases[] = {
      {"moe.num_experts=0 --set model.ffn_hidden_size=576460752303423489",
       {"model.ffn_hidden_size = 576460752303423489", "must be <= 2147483647"}},
      {"model.vocab_size=576460752303423489 --set training.steps=0 --set export.dir=" + path("never"),
       {"model.vocab_size = 576460752303423489", "must be <= 2147483647", "token ids are i32"}},
      {"runtime.threads=100000", {"runtime.threads = 100000", "logical CPUs of this machine"}},
      {"model.rope_theta=1e-300", {"model.rope_theta = 1e-300", "fp32"}},
      {"moe.topk_scaling=1e300", {"moe.topk_scaling = 1e+300", "fp32"}},
      {"moe.capacity_factor=1e15 --set moe.pad_to_capacity=true",
       {"moe.capacity_factor = 1e+15", "must be <= moe.num_experts = 4"}},
      {"moe.capacity_factor=4 --set moe.pad_to_capacity=true --set training.micro_batch=32768 "
       "--set training.global_batch=32768 --set training.seq_len=16384",
       {"moe.capacity_factor = 4", "permuted rows", "i32 row indices"}},
      {"training.micro_batch=65536 --set training.global_batch=65536 --set training.seq_len=65536",
       {"training.micro_batch · seq_len · moe.top_k", "must be <= 2147483647"}},
      {"model.num_layers=100000000", {"needs at least", "TB", "of memory", "model.num_layers"}},
      {"moe.num_experts=1000000000", {"needs at least", "TB", "moe.num_experts"}},
      {"model.hidden_size=2147483646 --set model.num_heads=1 --set model.num_kv_heads=1 "
       "--set model.num_layers=2147483647 --set model.ffn_hidden_size=2147483647",
       {"parameters: their training state (16 bytes each) does not fit in 64-bit sizes"}},
  };
  for (const auto& c : cases) {
    auto r = train("--set " + c.set);
    SCOPED_TRACE(c.set);
    std::initializer_list<std::string> none{};
    expect_outcome("config: " + c.set.substr(0, 50), r, 2, none);
    for (const std::string& n : c.needles) EXPECT_NE(r.output.find(n), std::string::npos) << n << " in:\n" << r.output;
    EXPECT_FALSE(fs::exists(path("never/model.safetensors")));
  }
  // Every rank finds the same fault: one message, every rank exits 2.
  expect_outcome("config: model.num_layers=100000000, 2 ranks", train("--set model.num_layers=100000000", 2), 2,
                 {"error: ", "needs at least"});
}

TEST_F(CliFaults, AFailureOnRankZeroAloneStopsEveryRank) {
  auto r = train("--set logging.dir=/proc/origami-nowhere", 2);
  expect_outcome("rank 0 cannot create logging.dir", r, 2,
                 {"error [rank 0]: logging.dir = \"/proc/origami-nowhere\"", "cannot create the directory"});
  r = train("--set export.dir=/proc/origami-nowhere", 2);
  expect_outcome("rank 0 cannot create export.dir", r, 2, {"error [rank 0]: export.dir", "/proc/origami-nowhere"});
  // Mid-run: rank 0's metrics file fills the disk at step 1; both ranks stop at
  // the next meeting.
  fs::create_directories(path("full2"));
  fs::create_symlink("/dev/full", path("full2/metrics.jsonl"));
  r = train("--set logging.dir=" + path("full2"), 2);
  expect_outcome("rank 0's metrics.jsonl on /dev/full, 2 ranks", r, 2,
                 {"error [rank 0]: " + path("full2/metrics.jsonl") + ": write failed: No space left on device"});
}

// Ranks launched in different working directories (mpirun's -wdir per app
// context; node-local directories do the same) resolve one relative path
// to different files: a corpus of another size is refused naming the
// counts, and a checkpoint.dir rank 1 sees elsewhere is refused before any
// save could publish files rank 0 never saw (before: `saved`, then a resume
// failing on rank 1's missing shards).
TEST_F(CliFaults, RanksWhosePathsNameDifferentFilesAreRefused) {
  for (const char* w : {"wdir-a", "wdir-b"}) fs::create_directories(path(w));
  for (const char* ext : {".bin", ".idx"}) fs::copy_file(path("data") + ext, path("wdir-a/data") + ext);
  write_file(path("wdir-b/corpus.txt"), "Another corpus, long enough for one window of sixteen tokens.\n");
  auto pre = run(kBinary + " preprocess --format text --input " + path("wdir-b/corpus.txt") + " --output-prefix " +
                 path("wdir-b/data"));
  ASSERT_EQ(pre.status, 0) << pre.output;
  auto job = [&](const std::string& sets) {
    const std::string cmd = kBinary + " train " + path("moe.toml") + " --set parallel.ep=2 --set data.path=data " + sets;
    return run(kMpirun + " -np 1 -wdir " + path("wdir-a") + " " + cmd + " : -np 1 -wdir " + path("wdir-b") + " " + cmd);
  };
  expect_outcome("ranks reading different corpora through one relative data.path", job(""), 2,
                 {"error: the ranks of this job opened different corpora through data.path",
                  "data.tokens: 10091 on rank 0; 63 on rank 1"});  // one document each
  for (const char* ext : {".bin", ".idx"})
    fs::copy_file(path("data") + ext, path("wdir-b/data") + ext, fs::copy_options::overwrite_existing);
  const Outcome r = job("--set checkpoint.dir=ck --set checkpoint.interval=2");
  expect_outcome("ranks seeing different checkpoint.dirs through one relative path", r, 2,
                 {"error [rank 1]: --set checkpoint.dir=ck: checkpoint.dir = \"ck\" (" + path("wdir-b/ck") +
                      " on this rank) is not the directory rank 0 uses"});
  EXPECT_FALSE(fs::exists(path("wdir-a/ck/step-00000002"))) << "no step saved";
  for (const auto& e : fs::directory_iterator(path("wdir-a/ck")))
    EXPECT_EQ(e.path().filename().string().rfind(".origami-shared-", 0), std::string::npos) << "probe left: " << e.path();
  // Every rank in one directory: trains and saves as ever.
  const Outcome same = run(kMpirun + " -np 2 -wdir " + path("wdir-a") + " " + kBinary + " train " + path("moe.toml") +
                           " --set parallel.ep=2 --set data.path=data --set checkpoint.dir=ck-same --set checkpoint.interval=2");
  EXPECT_EQ(same.status, 0) << same.output;
  EXPECT_TRUE(fs::exists(path("wdir-a/ck-same/step-00000004/metadata.json"))) << same.output;
}

// A whole job suspended (every rank SIGSTOPped, as a gang scheduler or
// `scontrol suspend` does) for longer than runtime.collective_timeout_s and
// then resumed trains on: time a rank did not run is no wait, in a
// collective's wait or a meeting's. Before, a rank stopped inside a wait
// resumed into a deadline that had run on while it was stopped and ended
// the job as a collective timeout (exit 5; 1 in 3 single suspends on a busy
// machine, so three of them in one run). The run is long and ends by
// SIGTERM, so that the suspends land mid-run however fast steps are.
TEST_F(CliFaults, AJobSuspendedPastTheCollectiveTimeoutTrainsOnWhenResumed) {
  const std::string log = path("suspended");
  const std::string script =
      kMpirun + " -np 2 " + kBinary + " train " + path("moe.toml") +
      " --set parallel.ep=2 --set training.steps=10000000 --set logging.interval=10000000"
      " --set runtime.collective_timeout_s=2 --set logging.dir=" + log + " & M=$!\n"
      "i=0; until [ -s " + log + "/metrics.jsonl ] || [ $i -ge 600 ]; do sleep 0.1; i=$((i+1)); done\n"
      "ranks() {  # mpirun's children, from /proc (no procps in a bare root): stat's field 4 is the parent\n"
      "  P=''; for s in /proc/[0-9]*/stat; do\n"
      "    set -f; set -- $(cat $s 2>/dev/null); set +f; [ \"$4\" = \"$M\" ] && P=\"$P $1\"\n"
      "  done\n"
      "}\n"
      "for cycle in 1 2 3; do sleep 0.5; ranks; kill -STOP $P; sleep 3; kill -CONT $P; done\n"
      "sleep 0.5; ranks; kill -TERM $P\n"
      "wait $M\n";
  const std::string file = path("suspend.sh");
  write_file(file, script);
  const Outcome r = run("sh " + file);
  std::printf("[fault] %-58s exit %d in %.2f s\n", "a 2-rank job suspended 3 times for 3 s, timeout 2 s", r.status,
              r.seconds);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("stopped by SIGTERM after "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("timeout"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("did not all report"), std::string::npos) << r.output;
  EXPECT_GT(read_jsonl(log + "/metrics.jsonl").size(), 1u);
}

// The meetings that wait on file I/O (start-up, saves, loads, the export
// rank 0 writes while the other waits) are bounded by runtime.io_timeout_s,
// not the collective timeout: here 0.1 ms (in effect 1 ms, the meetings'
// polling grain), which the export of this model (hidden 512: ~70 MB, more
// than memory bandwidth can copy in 1 ms) outlasts whatever else does. Exit
// 5, naming the setting to raise, promptly.
TEST_F(CliFaults, AnIoMeetingPastRuntimeIoTimeoutEndsTheJobNamingTheSetting) {
  const auto r = train("--set runtime.io_timeout_s=1e-4 --set training.steps=1 --set model.hidden_size=512 "
                       "--set model.ffn_hidden_size=2048 --set export.dir=" + path("io-export"), 2);
  std::printf("[fault] %-58s exit %d in %.2f s\n", "an I/O meeting past runtime.io_timeout_s, 2 ranks", r.status,
              r.seconds);
  EXPECT_EQ(r.status, 5) << r.output;
  EXPECT_NE(r.output.find("did not all report within 0.0001 s (runtime.io_timeout_s)"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, kPromptSeconds) << r.output;
}

// A rank that stalls before MPI starts (here: a shell that sleeps before it
// execs origami) held the other in MPI_Init for good; now that rank gives
// up after ORIGAMI_MPI_INIT_TIMEOUT_S, exits 5 saying why, and the launcher
// ends the job, the sleeper included. Were it still held, the sleeper would
// start after 120 s and the job would end with status 0, late: a failure,
// not a hang. A malformed value is the user's error (2), named.
TEST_F(CliFaults, ARankThatNeverStartsMpiEndsTheJobAfterTheStartUpTimeout) {
  const std::string cmd = kBinary + " plan " + path("moe.toml") + " --world 2";
  auto r = run("ORIGAMI_MPI_INIT_TIMEOUT_S=2 " + kMpirun + " -np 1 " + cmd + " : -np 1 sh -c 'sleep 120; exec " + cmd +
               "'");
  std::printf("[fault] %-58s exit %d in %.2f s\n", "rank 1 stalls before MPI_Init", r.status, r.seconds);
  EXPECT_EQ(r.status, 5) << r.output;
  EXPECT_NE(r.output.find("[rank 0] start-up timeout: MPI_Init not done 2 s after it began "
                          "(ORIGAMI_MPI_INIT_TIMEOUT_S)"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, kPromptSeconds) << r.output;
  r = run("ORIGAMI_MPI_INIT_TIMEOUT_S=soon " + kMpirun + " -np 2 " + cmd);
  std::printf("[fault] %-58s exit %d in %.2f s\n", "ORIGAMI_MPI_INIT_TIMEOUT_S=soon", r.status, r.seconds);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("ORIGAMI_MPI_INIT_TIMEOUT_S='soon': must be seconds in [1, 1e6]"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, kPromptSeconds) << r.output;
}

TEST_F(CliFaults, AnErrorOnANonZeroRankReachesTheUserTaggedWithItsRank) {
  // The same config on both ranks, a relative data.path, and rank 1 started
  // where that path does not exist (a node missing the dataset).
  fs::create_directories(path("here"));
  fs::create_directories(path("elsewhere"));
  fs::copy_file(path("data.bin"), path("here/data.bin"));
  fs::copy_file(path("data.idx"), path("here/data.idx"));
  write_file(path("rel.toml"), config("data"));
  const std::string cmd = kBinary + " train " + path("rel.toml") + " --set parallel.ep=2";
  auto r = run(kMpirun + " -np 1 --wdir " + path("here") + " " + cmd + " : -np 1 --wdir " + path("elsewhere") + " " +
               cmd);
  expect_outcome("rank 1 cannot open its data.path", r, 2,
                 {"error [rank 1]: ", ": data.path: data.idx: cannot open the indexed dataset file", "No such file"});
}

TEST_F(CliFaults, RanksWithDifferentConfigsOrCommandLinesAreRefusedNamingTheDifference) {
  const std::string cmd = kBinary + " train " + path("moe.toml") + " --set parallel.ep=2";
  auto r = run(kMpirun + " -np 1 " + cmd + " : -np 1 " + cmd + " --set optimizer.lr=1e-3 --set training.seq_len=32");
  expect_outcome("MPMD: rank 1 with other --set values", r, 2,
                 {"error: the ranks of this job resolved different configs", "optimizer.lr: 0.003 on rank 0; 0.001 on rank 1",
                  "training.seq_len: 16 on rank 0; 32 on rank 1"});
  EXPECT_EQ(r.output.find("model.hidden_size"), std::string::npos) << "only differing keys:\n" << r.output;
  // Two subcommands in one job: refused at once, not after the exit meeting's 600 s.
  r = run(kMpirun + " -np 1 " + cmd + " : -np 1 " + kBinary + " eval " + path("moe.toml") + " --weights " +
          path("weights") + " --data " + path("data") + " --samples 4");
  expect_outcome("MPMD: train on rank 0, eval on rank 1", r, 2,
                 {"error: the ranks of this job run different subcommands",
                  "subcommand: origami train on rank 0; origami eval on rank 1"});
  // One subcommand, but rank 1's options do not parse: rank 0 does not start
  // training and wait for it (it did, until the exit meeting's 600 s).
  r = run(kMpirun + " -np 1 " + cmd + " : -np 1 " + cmd + " --no-such-option");
  expect_outcome("MPMD: rank 1's options do not parse", r, 2,
                 {"The following argument was not expected: --no-such-option",
                  "the job stops: the command line of 1 of 2 ranks (the first: rank 1, which printed why) did not "
                  "parse"});
  r = run(kMpirun + " -np 1 " + cmd + " --no-such-option : -np 1 " + cmd);
  expect_outcome("MPMD: rank 0's options do not parse", r, 2,
                 {"The following argument was not expected: --no-such-option"});
  EXPECT_EQ(r.output.find("did not parse"), std::string::npos) << "rank 0 printed its own error:\n" << r.output;
}

// The one-process commands under a launcher: several ranks are refused (each
// would run the whole command alone and write the same outputs), and bench
// imbalance at -np 1 finishes (its `origami imbalance` children inherited
// the launcher's variables, failed to start MPI, and the bench hung).
TEST_F(CliFaults, OneProcessCommandsUnderALauncher) {
  for (const auto& [name, args] : {std::pair<std::string, std::string>{"imbalance", path("nowhere")},
                                   {"bench kernels", "--json"},
                                   {"bench imbalance", "--size-mb 1"},
                                   {"bench step", "--config " + path("moe.toml")}}) {
    auto r = run(kMpirun + " -np 2 " + kBinary + " " + name + " " + args);
    expect_outcome("-np 2 origami " + name, r, 2,
                   {"error: origami " + name + " runs as one process, and this job has 2 ranks"});
  }
  auto r = run(kMpirun + " -np 1 " + kBinary + " bench imbalance --size-mb 1 --layers 2 --experts 8 --repeat 1 --dir " +
               path("bench-imbalance") + " --json");
  expect_outcome("-np 1 origami bench imbalance", r, 0, {"\"imbalance_s\""});
  // The commands rank 0 runs alone: a rank given another command line (MPMD)
  // is refused, not ignored (export exported rank 0's --checkpoint, status 0).
  const std::string exp = kBinary + " export --out " + path("export-mpmd") + " --checkpoint ";
  r = run(kMpirun + " -np 1 " + exp + path("ck-a") + " : -np 1 " + exp + path("ck-b"));
  expect_outcome("MPMD export with another --checkpoint on rank 1", r, 2,
                 {"error: the ranks of this job were given different command lines", "word 5: ", "ck-a",
                  " on rank 0; ", "ck-b", " on rank 1"});
  EXPECT_EQ(r.output.find("no checkpoint"), std::string::npos) << "refused before reading:\n" << r.output;
  r = run(kMpirun + " -np 2 " + kBinary + " plan " + path("moe.toml") + " --world 2");
  expect_outcome("-np 2 origami plan, one command line", r, 0, {"peak"});
}

// Two runs on one output directory: the second is refused naming the first
// (here this test holds the lock, as another run would); logging.dir and
// checkpoint.dir may be one directory; once the holder is gone, a run starts.
TEST_F(CliFaults, ADirectoryAnotherRunUsesIsRefused) {
  for (const char* key : {"logging.dir", "checkpoint.dir"}) {
    const std::string dir = path(std::string("locked-") + key);
    fs::create_directories(dir);
    const int fd = ::open((dir + "/.origami.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    ASSERT_EQ(::write(fd, "pid 4242 on elsewhere\n", 22), 22);
    const std::string sets = std::string("--set training.steps=1 --set ") + key + "=" + dir +
                             (key == std::string("checkpoint.dir") ? " --set checkpoint.interval=1" : "");
    auto r = train(sets, 2);
    expect_outcome(std::string("another run holds ") + key, r, 2,
                   {std::string("error [rank 0]: ") + key + " = \"" + dir + "\": another origami run uses this directory "
                    "(pid 4242 on elsewhere; rule: one run per directory"});
    ::close(fd);
    r = train(sets);
    EXPECT_EQ(r.status, 0) << r.output;
  }
  const std::string all = path("one-dir");
  auto r = train("--set training.steps=1 --set checkpoint.interval=1 --set logging.dir=" + all +
                 " --set checkpoint.dir=" + all + " --set export.dir=" + all);
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_F(CliFaults, WritesThatFailAreErrors) {
  fs::create_directories(path("full1"));
  fs::create_symlink("/dev/full", path("full1/metrics.jsonl"));
  auto r = train("--set logging.dir=" + path("full1"));
  expect_outcome("metrics.jsonl on /dev/full", r, 2,
                 {path("full1/metrics.jsonl") + ": write failed: No space left on device"});
  // An export that fails leaves the previous one whole: each file is written
  // as <file>.tmp (here on /dev/full) and renamed over the old one at the end.
  for (const char* file : {"model.safetensors", "config.json"}) {
    const std::string dir = path(std::string("full-export-") + file);
    r = train("--set training.steps=0 --set export.dir=" + dir);
    ASSERT_EQ(r.status, 0) << r.output;
    const std::string before = testing::read_file(dir + "/model.safetensors") + testing::read_file(dir + "/config.json");
    fs::create_symlink("/dev/full", dir + "/" + file + ".tmp");
    r = train("--set training.steps=0 --set export.dir=" + dir, 2);
    expect_outcome(std::string("export ") + file + " on /dev/full, 2 ranks", r, 2,
                   {"error [rank 0]: " + dir + "/" + file + ".tmp", "No space left on device"});
    EXPECT_EQ(testing::read_file(dir + "/model.safetensors") + testing::read_file(dir + "/config.json"), before);
    EXPECT_FALSE(fs::exists(fs::symlink_status(dir + "/" + file + ".tmp"))) << "the partial file stays behind";
  }
  // A full disk under standard output loses the step lines: an error too.
  r = run("sh -c '" + kBinary + " train " + path("moe.toml") + " >/dev/full'");
  expect_outcome("stdout on /dev/full", r, 2, {"writing standard output failed"});
  // A reader that goes away (`| head`): reported and exit 2, not a silent
  // death by SIGPIPE (141). The status is origami's, the pipe's first command.
  r = run("bash -c '" + kBinary + " train " + path("moe.toml") +
          " --set training.steps=200 | head -c 1 >/dev/null; exit ${PIPESTATUS[0]}'");
  expect_outcome("stdout read by a head that exits", r, 2, {"writing standard output failed: Broken pipe"});
}

TEST_F(CliFaults, FifosAndDirectoriesAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(path("fifo-data.idx").c_str(), 0600), 0);
  fs::copy_file(path("data.bin"), path("fifo-data.bin"));
  auto r = train("--set data.path=" + path("fifo-data"));
  expect_outcome("data .idx is a FIFO", r, 2, {path("fifo-data.idx") + ": is a FIFO", "must be a regular file"});
  fs::create_directories(path("fifo-weights"));
  fs::copy_file(path("weights/config.json"), path("fifo-weights/config.json"));
  ASSERT_EQ(::mkfifo(path("fifo-weights/model.safetensors").c_str(), 0600), 0);
  r = train("--set data.path=" + path("fifo-data"), 2);
  expect_outcome("data .idx is a FIFO, 2 ranks", r, 2, {"error: --set data.path=", "data.path: " + path("fifo-data.idx") + ": is a FIFO"});
  r = eval(path("fifo-weights"));
  expect_outcome("weights are a FIFO", r, 2, {"model.safetensors: is a FIFO"});
  ASSERT_EQ(::mkfifo(path("fifo.toml").c_str(), 0600), 0);
  r = run(kBinary + " train " + path("fifo.toml"));
  expect_outcome("config is a FIFO", r, 2, {"fifo.toml: is a FIFO"});
  r = run(kBinary + " train " + path("weights"));
  expect_outcome("config is a directory", r, 2, {path("weights") + ": is a directory"});
  fs::create_symlink("/dev/zero", path("device.idx"));
  fs::copy_file(path("data.bin"), path("device.bin"));
  r = train("--set data.path=" + path("device"));
  expect_outcome("data .idx is a character device", r, 2, {path("device.idx") + ": is a character device"});
}

// An output that is a FIFO nobody reads would block its writer forever (and
// a blocked open never sees SIGTERM's graceful stop): refused at once. A FIFO
// something reads is a fine output, a pipe to a consumer.
TEST_F(CliFaults, OutputFifosWithoutAReaderAreRefusedAndOnesWithAReaderWork) {
  const std::string rule = ": is a FIFO that no process reads";
  for (const char* file : {"metrics.jsonl", "config.toml"}) {
    const std::string dir = path(std::string("fifo-log-") + file);
    fs::create_directories(dir);
    ASSERT_EQ(::mkfifo((dir + "/" + file).c_str(), 0600), 0);
    const Outcome r = train("--set logging.dir=" + dir);
    expect_outcome(std::string("logging.dir's ") + file + " is a FIFO", r, 2, {dir + "/" + file + rule});
  }
  const std::string exported = path("fifo-export");
  fs::create_directories(exported);
  ASSERT_EQ(::mkfifo((exported + "/model.safetensors").c_str(), 0600), 0);
  // An export replaces its files whole (files.h, ReplacedFiles): a FIFO
  // there is refused at start, before any step.
  Outcome r = train("--set training.steps=0 --set export.dir=" + exported, 2);
  expect_outcome("export model.safetensors is a FIFO, 2 ranks", r, 2,
                 {"error [rank 0]: " + exported + "/model.safetensors: exists and is not a regular file"});
  // The export's own .tmp, left as a FIFO: its write lock would be the
  // FIFO's reader, and the export would fill it and wait forever.
  const std::string tmp_fifo = path("fifo-export-tmp");
  fs::create_directories(tmp_fifo);
  ASSERT_EQ(::mkfifo((tmp_fifo + "/model.safetensors.tmp").c_str(), 0600), 0);
  r = train("--set training.steps=0 --set export.dir=" + tmp_fifo);
  expect_outcome("export's model.safetensors.tmp is a FIFO", r, 2,
                 {tmp_fifo + "/model.safetensors.tmp: is a FIFO", "remove what is at that path"});

  const std::string piped = path("fifo-piped");
  fs::create_directories(piped);
  ASSERT_EQ(::mkfifo((piped + "/metrics.jsonl").c_str(), 0600), 0);
  // fd 3 holds the FIFO open (read-write: no wait) so that it has a reader
  // before origami opens it, however late cat starts; cat sees the end once
  // fd 3 and origami have closed it.
  const std::string fifo = piped + "/metrics.jsonl";
  r = run("sh -c 'exec 3<>" + fifo + "; (exec 3<&-; cat " + fifo + " > " + path("piped-copy.jsonl") + ") & " +
          kBinary + " train " + path("moe.toml") + " --set logging.dir=" + piped +
          " 3<&-; status=$?; exec 3<&-; wait; exit $status'");
  expect_outcome("metrics.jsonl a FIFO that cat reads", r, 0, {});
  EXPECT_EQ(count(read_file(path("piped-copy.jsonl")), "{\"step\":"), 4) << read_file(path("piped-copy.jsonl"));

  // The imbalance tool: its input and its HTML page.
  r = run(kBinary + " imbalance " + piped);
  expect_outcome("imbalance reads a FIFO", r, 2, {piped + "/metrics.jsonl: is a FIFO", "must be a regular file"});
  const std::string logged = path("fifo-logged");
  ASSERT_EQ(train("--set logging.dir=" + logged).status, 0);
  ASSERT_EQ(::mkfifo(path("page.html").c_str(), 0600), 0);
  r = run(kBinary + " imbalance " + logged + " --html " + path("page.html"));
  expect_outcome("imbalance --html is a FIFO", r, 2, {path("page.html") + rule});
}

TEST_F(CliFaults, MalformedSafetensorsHeadersNameTheFileAndTensor) {
  const std::string head = "model.layers.1.block_sparse_moe.experts.0.w1.weight";
  const struct {
    std::string name;
    std::function<void(nlohmann::json&)> edit;
    std::vector<std::string> needles;
  } cases[] = {
      {"shape-string", [&](nlohmann::json& h) { h[head]["shape"] = "[48, 32]"; }, {"shape must be an array"}},
      {"offsets-string", [&](nlohmann::json& h) { h[head]["data_offsets"] = "0,100"; }, {"data_offsets must be"}},
      {"shape-float", [&](nlohmann::json& h) { h[head]["shape"] = {32.5, 32}; }, {"integers >= 0", "32.5"}},
      {"shape-negative", [&](nlohmann::json& h) { h[head]["shape"] = {-48, 32}; }, {"integers >= 0", "-48"}},
      {"offsets-short", [&](nlohmann::json& h) { h[head]["data_offsets"] = {0}; }, {"two integers"}},
      {"dtype-other", [&](nlohmann::json& h) { h[head]["dtype"] = "BF16"; }, {"\"BF16\" is not supported"}},
      {"shape-mismatch", [&](nlohmann::json& h) { h[head]["shape"] = {48, 31}; }, {"needs 1488 x 4 bytes"}},
      {"overlap",
       [&](nlohmann::json& h) {
         // Shift one tensor's range back into the tensors before it.
         auto& o = h[head]["data_offsets"];
         const int64_t shift = (o[1].get<int64_t>() - o[0].get<int64_t>()) / 2;
         o = {o[0].get<int64_t>() - shift, o[1].get<int64_t>() - shift};
       },
       {"overlap tensor"}},
      {"alias",
       [&](nlohmann::json& h) {
         // Another tensor of the same shape pointing at the same bytes.
         const std::string other = "model.layers.1.block_sparse_moe.experts.1.w1.weight";
         h[other]["data_offsets"] = h[head]["data_offsets"];
       },
       {"overlap tensor"}},
      {"hole",
       [&](nlohmann::json& h) {
         // Drop one tensor: its bytes stay in the file, owned by nobody.
         h.erase(head);
       },
       {"unused", "without holes"}},
      {"not-object", [&](nlohmann::json& h) { h = nlohmann::json::array({1, 2}); }, {"header must be a JSON object"}},
      {"metadata-type", [&](nlohmann::json& h) { h["__metadata__"]["format"] = 3; }, {"__metadata__ 'format'"}},
  };
  for (const auto& c : cases) {
    const std::string dir = weights_with_header("st-" + c.name, c.edit);
    auto r = eval(dir);
    std::initializer_list<std::string> file{dir + "/model.safetensors: "};
    expect_outcome("safetensors: " + c.name, r, 2, file);
    for (const std::string& n : c.needles) EXPECT_NE(r.output.find(n), std::string::npos) << n << " in:\n" << r.output;
    if (c.name != "not-object" && c.name != "metadata-type") {
      EXPECT_NE(r.output.find("tensor '"), std::string::npos) << r.output;
    }
  }
  expect_outcome("safetensors: shape-float, 2 ranks", eval(path("st-shape-float"), "", 2), 2,
                 {"error: " + path("st-shape-float/model.safetensors") + ": tensor '"});
  // A header length beyond the file.
  const std::string dir = path("st-length");
  fs::create_directories(dir);
  fs::copy_file(path("weights/config.json"), dir + "/config.json");
  std::string st = read_file(path("weights/model.safetensors"));
  st[7] = 0x10;
  write_file(dir + "/model.safetensors", st);
  expect_outcome("safetensors: header length beyond the file", eval(dir), 2, {"byte offset 0: header length"});
}

TEST_F(CliFaults, EvalRefusesSettingsThatContradictTheExport) {
  auto r = eval(path("weights"), "--set moe.top_k=1 --set moe.score_function=sigmoid");
  expect_outcome("eval --set moe.top_k=1 on top-2 weights", r, 2,
                 {"--set moe.top_k=1: moe.top_k gives \"num_experts_per_tok\": 1", "weights/config.json has 2"});
  r = eval(path("weights"), "--set moe.top_k=1", 2);
  expect_outcome("eval --set moe.top_k=1, 2 ranks", r, 2, {"error: --set moe.top_k=1: moe.top_k gives"});
  r = eval(path("weights"), "--set model.rope_theta=500000");
  expect_outcome("eval --set model.rope_theta", r, 2, {"model.rope_theta", "\"rope_theta\""});
  const std::string garbage = path("garbage-config");
  fs::create_directories(garbage);
  fs::copy_file(path("weights/model.safetensors"), garbage + "/model.safetensors");
  write_file(garbage + "/config.json", "{\"vocab_size\": 257, oops");
  r = eval(garbage);
  expect_outcome("eval with a garbage config.json", r, 2, {garbage + "/config.json: not valid JSON"});
  fs::remove(garbage + "/config.json");
  r = eval(garbage);
  expect_outcome("eval without config.json", r, 2, {garbage + "/config.json: cannot open"});
  r = eval(path("weights"));
  EXPECT_EQ(r.status, 0) << r.output;  // and the matching config evaluates
  // Ranks given other inputs (an MPMD launch): one whose weights do not
  // open fails the job before rank 0 prints a loss; one evaluating another
  // sample count is refused, not answered by rank 0's figure.
  auto mpmd = [&](const std::string& rank1_args) {
    const std::string cmd = kBinary + " eval " + path("moe.toml") + " --data " + path("data") + " --json ";
    return run(kMpirun + " -np 1 " + cmd + "--weights " + path("weights") + " --samples 4 : -np 1 " + cmd + rank1_args);
  };
  r = mpmd("--weights " + path("no-such-weights") + " --samples 4");
  expect_outcome("eval, rank 1's weights missing", r, 2, {"error [rank 1]: " + path("no-such-weights")});
  EXPECT_EQ(r.output.find("\"loss\""), std::string::npos) << "no loss printed:\n" << r.output;
  r = mpmd("--weights " + path("weights") + " --samples 2");
  expect_outcome("eval, rank 1 evaluating another sample count", r, 2,
                 {"error: the ranks of this eval computed losses from "});
  EXPECT_EQ(r.output.find("\"loss\""), std::string::npos) << "no loss printed:\n" << r.output;
}

// data.path is training's rule: eval reads --data, plan reads no data, so a
// config without it (training.steps 4) serves both; train refuses it.
TEST_F(CliFaults, OnlyTrainingNeedsDataPath) {
  const std::string text = config("unused");
  write_file(path("no-data.toml"), text.substr(0, text.find("[data]")));
  auto r = run(kBinary + " eval " + path("no-data.toml") + " --weights " + path("weights") + " --data " + path("data") +
               " --samples 4");
  EXPECT_EQ(r.status, 0) << r.output;
  r = run(kBinary + " plan " + path("no-data.toml") + " --world 2");
  EXPECT_EQ(r.status, 0) << r.output;
  r = run(kBinary + " train " + path("no-data.toml"));
  expect_outcome("train without data.path", r, 2,
                 {path("no-data.toml") + ": data.path is required to train (training.steps = 4)"});
}

TEST_F(CliFaults, MegatronIndexRulesAreEnforced) {
  std::string idx = read_file(path("data.idx"));
  uint64_t sequences = 0;
  std::memcpy(&sequences, idx.data() + 18, 8);
  // doc_idx ends one sequence short: Megatron asserts document_indices[-1] == len.
  const size_t last = idx.size() - 8;
  const int64_t short_end = static_cast<int64_t>(sequences) - 1;
  std::memcpy(idx.data() + last, &short_end, 8);
  write_file(path("short.idx"), idx);
  fs::copy_file(path("data.bin"), path("short.bin"));
  auto r = train("--set data.path=" + path("short"));
  expect_outcome("doc_idx not ending at the sequence count", r, 2,
                 {path("short.idx") + ": byte offset " + std::to_string(last), "equals num_sequences", "Megatron"});
  idx = read_file(path("data.idx"));
  idx[17] = 7;  // Megatron's float32
  write_file(path("f32.idx"), idx);
  fs::copy_file(path("data.bin"), path("f32.bin"));
  r = train("--set data.path=" + path("f32"));
  expect_outcome("dtype code 7", r, 2, {"byte offset 17", "dtype code 7 (f32)"});
}

TEST_F(CliFaults, CommandLineMistakesNameThemselves) {
  auto r = run(kBinary + " frobnicate");
  expect_outcome("unknown subcommand", r, 2, {"unknown subcommand 'frobnicate'", "train, eval, preprocess"});
  r = run(kMpirun + " -np 2 " + kBinary + " frobnicate");
  expect_outcome("unknown subcommand, 2 ranks", r, 2, {"error: unknown subcommand 'frobnicate'"});
  r = run(kBinary + " bench frobnicate");
  expect_outcome("unknown bench subcommand", r, 2, {"unknown subcommand 'frobnicate' of origami bench", "moe-layer"});
  for (const char* flag : {"--memory-gb nan", "--memory-gb -3", "--link-gbs inf", "--flops-per-rank x"}) {
    r = run(kBinary + " plan " + path("moe.toml") + " --world 2 " + flag);
    expect_outcome(std::string("plan ") + flag, r, 2, {std::string(flag).substr(0, std::string(flag).find(' '))});
  }
  // Sizes and fractions past what the tool can hold or mean: named with
  // their bounds, never an allocation failure (exit 4) or an OOM kill.
  const std::pair<std::string, std::string> bounded[] = {
      {"imbalance " + path("no-such-run") + " --collapse-share nan", "--collapse-share: must be a finite number in [0, 1]"},
      {"bench comm --min-bytes 1K --max-bytes 2G", "--max-bytes <= 1G"},
      {"bench imbalance --experts 4000000000", "--experts: Value 4000000000 not in range 1 to 4096"},
      {"bench imbalance --size-mb 9223372036854775807", "--size-mb: Value 9223372036854775807 not in range"},
      {"groups --world 8 --rank -1", "error: origami groups: --rank: Value -1 not in range 0 to"},
      {"plan --params 2e18 --world 8", "--params 2e+18: must be a whole number of parameters in [1, 576460752303423480]"},
      {"plan --params 576460752303423488 --world 1", "in [1, 576460752303423487]"},
      {"bench kernels --only nosuchop --samples 1 --warmup 0", "--only nosuchop: no op's key starts with it"},
      {"bench kernels --only gemm --skip gemm --samples 1 --warmup 0",
       "--skip leaves out every op --only selects (nothing would be measured)"},
      {"bench imbalance --size-mb 1 --dir " + path("moe.toml"), "cannot create it as a directory"},
      {"plan " + path("moe.toml") + " --world 1 --set model.num_layers=10000000", "the planner takes at most 4194304"},
      // Options of a config's plan, given to a bare parameter count: refused, not ignored.
      {"plan --world 2 --params 5 --stage 1", "--stage goes with a config"},
      {"plan --world 2 --params 5 --set parallel.tp=2", "--set goes with a config"},
      {"bench moe-layer --config " + path("moe.toml") + " --steps 1 --warmup 0 --set runtime.threads=99999",
       "runtime.threads = 99999: must be <="},
  };
  for (const auto& [args, needle] : bounded) {
    r = run(kBinary + " " + args);
    expect_outcome(args, r, 2, {needle});
    // A selection that names no op is refused before anything is timed.
    if (args.starts_with("bench kernels")) {
      EXPECT_EQ(r.output.find("ceiling"), std::string::npos) << "measured first:\n" << r.output;
    }
  }
  // One value per --set: the config's path after it is the config, not a
  // second override.
  r = run(kBinary + " plan --set parallel.ep=2 " + path("moe.toml") + " --world 2");
  expect_outcome("plan --set before the config", r, 0, {"EP 2"});
  // The parser's errors read like the engine's: `error:`, the command, where
  // its options are described.
  r = run(kBinary + " preprocess --input " + path("no-such-file") + " --output-prefix " + path("pre"));
  expect_outcome("preprocess of a missing file", r, 2,
                 {"error: origami preprocess: --input: File does not exist: " + path("no-such-file"),
                  "(origami preprocess --help describes the options)"});
  r = run(kBinary + " plan --params 7e9 --world 8 --link-gbs 10 --intra-gbs 5");
  expect_outcome("one bandwidth and a node's", r, 2, {"error: origami plan: --link-gbs excludes --intra-gbs"});
  // Just under the bound (2^59 - 512, exact in the double the option is
  // read into): every stage's bytes still count in 64 bits.
  r = run(kBinary + " plan --params 576460752303422976 --world 8 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto planned = nlohmann::json::parse(r.output);
  for (const auto& st : planned.at("stages")) EXPECT_GT(st.at("total").get<int64_t>(), 0) << st.dump();
  for (const char* help : {"--help", "train --help", "imbalance --help"}) {
    r = run("sh -c '" + kBinary + " " + help + " >/dev/full'");
    expect_outcome(std::string(help) + " to /dev/full", r, 2, {"writing standard output failed"});
  }
  // A huge value is quoted shortened, so the rule stays readable.
  r = train("--set data.path=" + std::string(5000, 'x'));
  expect_outcome("a 5000-character value", r, 2, {".idx (5004 characters): cannot open"});
  EXPECT_LT(r.output.size(), 1000u) << r.output;
}

}  // namespace
}  // namespace origami
