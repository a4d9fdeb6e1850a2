// Training on the GPU through the binary (runtime.device = "cuda"), against
// the CPU engine. With a CUDA build and a device:
//   - 20 steps of configs/tiny-moe.toml on cuda:0 in fp32 give the one-rank
//     CPU run's per-step LM and aux losses within 1e-4 relative, and its
//     grad norms within 1e-3. Why 1e-4 holds: both runs compute the same
//     fp32 math in another summation order (cuBLAS against oneDNN GEMMs, the
//     tiled attention against the CPU's, CUB against the CPU's reductions),
//     ~1e-6 relative per op; measured CPU layouts differ by ~1e-7 over 10
//     steps. A flipped near-tie in routing would show as a jump above it.
//   - 20 steps in bf16 (the CUDA default) give per-step LM losses within
//     2e-2 relative of the CPU's fp32 run with a falling curve (issue 18's
//     bar; the CPU's emulated bf16 measures 1.25e-2 against fp32,
//     tests/test_cli_bf16.cpp), and the device ledger's persistent bytes are
//     `origami plan`'s for runtime.device = "cuda" (whose recipe is bf16).
//     The distance to the CPU's emulated bf16 run (same rule per element,
//     other summation order) is within 5e-3. The host's ledger holds no training
//     state; every step reports MFU and no exposed communication (one rank).
//   - a checkpoint written by a bf16 GPU run loads on two fp32 CPU ranks at
//     ZeRO-3 and one written there loads into a bf16 GPU run (expert bias
//     on): loaded and saved again at once, the consolidated parameters (the
//     fp32 master) and AdamW moments are bitwise those saved; every run's
//     export holds its checkpoint's weights (rounded to bf16 on the GPU: the
//     working copy rebuilt on load), as does the fp32 GPU run's after its
//     20 steps (tests/cli_checks.h).
//   - the start-up GEMM peak that MFU divides by (engine/device_peak.h), timed
//     after the GPU's clocks have ramped up: two measurements in a row agree
//     within 10% (a peak timed on a cold clock reads low and inflates MFU).
//   - a GPU run resumed from its checkpoint (saving in the background)
//     continues bit for bit, and a second run (runtime.device = "auto")
//     repeats the first bit for bit.
//   - SIGTERM stops a GPU run at a step boundary with a checkpoint, and
//     the resume is bit-exact.
//   - `origami eval` on cuda:0 gives the CPU's loss (fp32 1e-4, bf16 2e-2),
//     and init_from_hf loads the same weights into a GPU run bit for bit.
//   - capacity/padding, z-loss, sequence and global aux losses, a shared
//     expert, a grouped sigmoid router and both recompute modes train in
//     fp32 as on the CPU (1e-4).
//   - a diverged run (infinite initial weights, NaN through every kernel
//     of the step; a learning rate of 1e30) exits 3 as on the CPU.
//   - `bench kernels --device cuda` at the tiny shapes, f32 and bf16, times
//     every op the CPU times, with its data right.
//   - a model past the GPU's memory, or more experts than the CUDA router
//     holds, is refused before training (exit 2).
//   - one rank more than the node's GPUs (two ranks on one GPU) is refused
//     before any step, exit 2, naming the ranks, the GPU's UUID and
//     runtime.device; each rank's GPU is cuda:(local rank mod devices).
// Each figure is printed on a line of its own beginning "[ measured ]",
// which tools/gpu_check.sh copies from CTest's JUnit file into its summary.
// Without a device every test skips (runtime.device = "cuda" refused there:
// tests/test_cli_errors.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "cli_checks.h"
#include "engine/config.h"
#include "engine/device_peak.h"
#include "kernels/attention.h"
#include "kernels/context.h"
#include "kernels/device.h"

namespace origami {
namespace {

using testing::read_jsonl;
using testing::run_command;

bool have_gpu() { return built_with_cuda() && cuda_device_count() > 0; }

class CudaTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::ScratchDir("cuda-train");
    corpus_ = testing::preprocess_fortunes(*dir_ / "fortunes");
  }
  // GoogleTest reports a failure in SetUpTestSuite as skipped tests (and
  // CTest counts them so): each test fails on it instead.
  void SetUp() override { ASSERT_EQ(corpus_.status, 0) << corpus_.output; }
  static inline testing::CommandResult corpus_;
  static void TearDownTestSuite() { delete dir_; }

  // One rank of tiny-moe, logging into tag/.
  static std::string train_command(const std::string& tag, const std::string& extra) {
    return std::string(ORIGAMI_BINARY) + " train " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml" +
           " --set data.path=" + (*dir_ / "fortunes") + " --set logging.dir=" + (*dir_ / tag) + " --set export.dir= " +
           extra;
  }
  static testing::CommandResult train(const std::string& tag, const std::string& extra) {
    return run_command(train_command(tag, extra));
  }
  // `np` CPU ranks of tiny-moe (runtime.device = "cpu"), logging into tag/.
  static testing::CommandResult train_cpu_ranks(int np, const std::string& tag, const std::string& extra) {
    return run_command(std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -np " +
                       std::to_string(np) + " " + ORIGAMI_BINARY + " train " + ORIGAMI_SOURCE_DIR +
                       "/configs/tiny-moe.toml --set data.path=" + (*dir_ / "fortunes") + " --set logging.dir=" +
                       (*dir_ / tag) + " --set export.dir= --set runtime.device=cpu " + extra);
  }
  static testing::ScratchDir* dir_;
};

testing::ScratchDir* CudaTrain::dir_ = nullptr;

TEST_F(CudaTrain, Fp32StepsMatchTheCpuRun) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string steps = " --set training.steps=20";
  auto r = train("cpu", steps + " --set runtime.device=cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  // It also saves at its last step and exports: in fp32 the export is the
  // checkpoint's weights to the bit (the GPU's fp32 save path).
  const std::string ckpt = *dir_ / "gpu-fp32-ckpt";
  r = train("gpu", steps + " --set runtime.device=cuda --set runtime.precision=fp32 --set checkpoint.interval=20" +
                       " --set checkpoint.dir=" + ckpt + " --set export.dir=" + (*dir_ / "gpu-fp32-hf"));
  ASSERT_EQ(r.status, 0) << r.output;
  testing::consolidated(testing::step_dir(ckpt, 20), *dir_ / "gpu-fp32-export");
  testing::expect_export_holds_the_checkpoint_weights(*dir_ / "gpu-fp32-hf", *dir_ / "gpu-fp32-export", false);
  const auto cpu = read_jsonl(*dir_ / "cpu/metrics.jsonl"), gpu = read_jsonl(*dir_ / "gpu/metrics.jsonl");
  ASSERT_EQ(cpu.size(), 20u);
  ASSERT_EQ(gpu.size(), 20u);
  double worst = 0;
  for (size_t s = 0; s < cpu.size(); ++s) {
    const double b = cpu[s].at("lm_loss").get<double>(), x = gpu[s].at("lm_loss").get<double>();
    worst = std::max(worst, std::abs(x - b) / std::abs(b));
    EXPECT_LE(std::abs(x - b), 1e-4 * std::abs(b)) << "lm loss, step " << s + 1 << ": " << x << " vs " << b;
    const double ba = cpu[s].at("aux_loss").get<double>(), xa = gpu[s].at("aux_loss").get<double>();
    EXPECT_LE(std::abs(xa - ba), 1e-4 * std::abs(ba)) << "aux loss, step " << s + 1;
    const double bg = cpu[s].at("grad_norm").get<double>(), xg = gpu[s].at("grad_norm").get<double>();
    EXPECT_LE(std::abs(xg - bg), 1e-3 * bg) << "grad norm, step " << s + 1;
    EXPECT_EQ(gpu[s].at("mem").at("device").get<std::string>(), "cuda:0");
  }
  std::printf("[ measured ] fp32 on cuda:0 against the CPU: worst lm loss difference %.3g relative over 20 steps\n",
              worst);
  EXPECT_LT(gpu.back().at("lm_loss").get<double>(), gpu.front().at("lm_loss").get<double>());
}

// Two ranks on two GPUs (one each): every device collective across ranks
// over NCCL, each layout in fp32 against one CPU rank, 5 steps, lm and aux
// losses within 1e-4 relative and grad norms within 1e-3 (the bar and
// reasons of Fp32StepsMatchTheCpuRun): the pipeline's sends and receives on
// their ring channels; the expert all-to-all with ZeRO-3's gathers and
// reduce-scatters over DP 2, left in flight on the communication stream
// (overlap_grad_reduce); ring attention's K/V exchange over CP 2; and TP's
// all-gathers and reduce-scatters of the tokens. A one-GPU machine (the
// GPU check's) skips it, by design: NCCL refuses two ranks on one device.
TEST_F(CudaTrain, TwoGpuLayoutsMatchOneCpuRankInFp32) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices (this machine has " << cuda_device_count() << ")";
  const std::string sets = " --set training.steps=5 --set runtime.precision=fp32";
  auto r = train("two-gpu-cpu", sets + " --set runtime.device=cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto cpu = read_jsonl(*dir_ / "two-gpu-cpu/metrics.jsonl");
  ASSERT_EQ(cpu.size(), 5u);
  const std::pair<const char*, const char*> layouts[] = {
      {"pp2", " --set parallel.pp=2"},
      {"ep2-dp2-overlap", " --set parallel.ep=2 --set parallel.overlap_grad_reduce=true"},
      {"cp2-ring", " --set parallel.cp=2 --set parallel.cp_comm=ring"},
      {"tp2", " --set parallel.tp=2"}};
  for (const auto& [name, layout] : layouts) {
    SCOPED_TRACE(name);
    const std::string tag = std::string("two-gpu-") + name;
    r = run_command(std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -np 2 " +
                    train_command(tag, sets + " --set runtime.device=cuda" + layout));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto gpu = read_jsonl(*dir_ / (tag + "/metrics.jsonl"));
    ASSERT_EQ(gpu.size(), 5u);
    double worst = 0;
    for (size_t s = 0; s < cpu.size(); ++s) {
      EXPECT_EQ(gpu[s].at("mem").at("device").get<std::string>(), "cuda:0") << "rank 0's record, step " << s + 1;
      for (const char* key : {"lm_loss", "aux_loss"}) {
        const double b = cpu[s].at(key).get<double>(), x = gpu[s].at(key).get<double>();
        worst = std::max(worst, std::abs(x - b) / std::abs(b));
        EXPECT_LE(std::abs(x - b), 1e-4 * std::abs(b)) << key << ", step " << s + 1 << ": " << x << " vs " << b;
      }
      const double bg = cpu[s].at("grad_norm").get<double>(), xg = gpu[s].at("grad_norm").get<double>();
      EXPECT_LE(std::abs(xg - bg), 1e-3 * bg) << "grad norm, step " << s + 1;
    }
    std::printf("[ measured ] fp32 on two GPUs, %s: worst loss difference %.3g relative to one CPU rank over 5 steps\n",
                name, worst);
  }
}

TEST_F(CudaTrain, Bf16StepsTrackTheCpuFp32RunWithThePlannedBytes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string steps = " --set training.steps=20";
  auto r = train("cpu-fp32", steps + " --set runtime.device=cpu --set runtime.precision=fp32");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("cpu-bf16", steps + " --set runtime.device=cpu --set runtime.precision=bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("gpu-bf16", steps + " --set runtime.device=cuda");  // precision auto: bf16 on CUDA
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("training on cuda:0 in bf16;"), std::string::npos) << r.output;
  const auto cpu = read_jsonl(*dir_ / "cpu-fp32/metrics.jsonl"), emulated = read_jsonl(*dir_ / "cpu-bf16/metrics.jsonl"),
             gpu = read_jsonl(*dir_ / "gpu-bf16/metrics.jsonl");
  ASSERT_EQ(cpu.size(), 20u);
  ASSERT_EQ(emulated.size(), 20u);
  ASSERT_EQ(gpu.size(), 20u);
  double worst = 0, worst_emulated = 0;
  for (size_t s = 0; s < cpu.size(); ++s) {
    const double b = cpu[s].at("lm_loss").get<double>(), x = gpu[s].at("lm_loss").get<double>();
    ASSERT_TRUE(std::isfinite(x)) << "step " << s + 1;
    worst = std::max(worst, std::abs(x - b) / std::abs(b));
    EXPECT_LE(std::abs(x - b), 2e-2 * std::abs(b)) << "lm loss, step " << s + 1 << ": " << x << " vs " << b;
    const double e = emulated[s].at("lm_loss").get<double>();
    worst_emulated = std::max(worst_emulated, std::abs(x - e) / std::abs(e));
  }
  std::printf("[ measured ] bf16 on cuda:0: worst lm loss difference %.3g relative to the CPU's fp32 run, "
              "%.3g to its emulated bf16 run, over 20 steps\n",
              worst, worst_emulated);
  // The CPU's bf16 run rounds where the CUDA kernels round (the dtype rule,
  // kernels/cuda/README.md; tiny-moe's head_dim 32 takes the fp32 SIMT
  // attention, which rounds no P or dS inside), so the two differ by fp32
  // summation order alone, which flips a bf16 rounding now and then:
  // layouts that change only that measured 1.6e-5 over 6 steps
  // (tests/test_cli_bf16.cpp); 20 steps and the router's near-ties are not
  // yet measured on a device, hence the margin. A GPU that rounded somewhere
  // the recipe does not would drift towards the bf16-vs-fp32 distance
  // (1.25e-2 measured on the CPU), which 2e-2 alone would not catch.
  EXPECT_LE(worst_emulated, 5e-3) << "bf16 on cuda:0 against the CPU's emulated bf16 run";
  EXPECT_LT(gpu.back().at("lm_loss").get<double>(), 0.9 * gpu.front().at("lm_loss").get<double>());
  r = run_command(std::string(ORIGAMI_BINARY) + " plan " + ORIGAMI_SOURCE_DIR +
                  "/configs/tiny-moe.toml --world 1 --json --set runtime.device=cuda");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json plan = nlohmann::json::parse(r.output);
  EXPECT_EQ(plan.at("recipe"), "bf16");
  const nlohmann::json& planned = plan.at("ledger").at("stages").at(0);
  for (const auto& rec : gpu) {
    EXPECT_EQ(rec.at("mem").at("device").get<std::string>(), "cuda:0");
    for (const char* key : {"param", "grad", "optim"}) {
      EXPECT_EQ(rec.at("mem").at("persistent").at(key).get<int64_t>(), planned.at(key).get<int64_t>())
          << key << " bytes at step " << rec.at("step");
      // The training state lives on the device: the host's ledger holds none of it.
      EXPECT_EQ(rec.at("mem").at("host").at("persistent").at(key).get<int64_t>(), 0)
          << key << " bytes on the host at step " << rec.at("step");
    }
    // The step line's GPU figures: MFU against the start-up peak, and exposed
    // communication, none at all on one rank (no group has a second member).
    EXPECT_GT(rec.at("mfu").get<double>(), 0.0) << "step " << rec.at("step");
    EXPECT_GT(rec.at("peak_gflops").get<double>(), 10e3) << "step " << rec.at("step");
    EXPECT_NEAR(rec.at("mfu").get<double>(), rec.at("gflops").get<double>() / rec.at("peak_gflops").get<double>(),
                1e-12)
        << "step " << rec.at("step");
    EXPECT_EQ(rec.at("comm_exposed_s").get<double>(), 0.0) << "step " << rec.at("step");
  }
}

TEST_F(CudaTrain, CheckpointsMoveBetweenGpuAndCpuBitExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  // The GPU in bf16 (its default), two CPU ranks in fp32 at ZeRO-3 (sharded,
  // resharded on each load), the expert bias on both: tests/cli_checks.h.
  const auto cpu_ranks = [](const std::string& tag, const std::string& sets) { return train_cpu_ranks(2, tag, sets); };
  testing::expect_moves_keep_the_state(train, "--set runtime.device=cuda --set moe.expert_bias=true", true, cpu_ranks,
                                       "--set runtime.precision=fp32 --set moe.expert_bias=true "
                                       "--set parallel.zero_stage=3",
                                       false, dir_->str());
}

// A GPU run resumed from its own checkpoint continues bit for bit while
// saving in the background, and a whole GPU step is bitwise reproducible
// run to run (each CUDA op's claim, kernels/cuda/README.md, composed): a
// second uninterrupted run (runtime.device = "auto", which on a machine
// with a GPU is cuda:0 in bf16) equals the first at every step, and a run
// resumed from the first's step-3 checkpoint equals it at steps 4-6, as do
// the two runs' step-6 checkpoints (consolidated parameters and moments).
// The expert bias is on (its update a CUDA kernel of the step). A
// synchronous save stages device state through host copies one tensor at a
// time (host bytes far below the rank's state); a background save copies
// all of it to the host before training goes on.
TEST_F(CudaTrain, ResumedGpuRunContinuesBitwiseAndRepeatsRunToRun) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string sets = " --set moe.expert_bias=true --set training.steps=6 --set checkpoint.interval=3";
  const std::string ck = *dir_ / "rerun-base-ckpt", ck_resumed = *dir_ / "rerun-resumed-ckpt";
  auto r = train("rerun-base", sets + " --set runtime.device=cuda --set checkpoint.dir=" + ck);
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("rerun-again", sets + " --set runtime.device=auto --set checkpoint.dir=" + (*dir_ / "rerun-again-ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("training on cuda:0 in bf16;"), std::string::npos) << r.output;
  r = train("rerun-resumed", sets + " --set runtime.device=cuda --set checkpoint.async=true --set checkpoint.dir=" +
                                 ck_resumed + " --set checkpoint.load=" + testing::step_dir(ck, 3));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + testing::step_dir(ck, 3) + " at step 3"), std::string::npos) << r.output;
  const auto base = read_jsonl(*dir_ / "rerun-base/metrics.jsonl");
  const auto again = read_jsonl(*dir_ / "rerun-again/metrics.jsonl");
  const auto resumed = read_jsonl(*dir_ / "rerun-resumed/metrics.jsonl");
  ASSERT_EQ(base.size(), 6u);
  testing::expect_same_steps(base, again, 1, 6);
  testing::expect_same_steps(base, resumed, 4, 6);
  const nlohmann::json& sync = base.at(2).at("checkpoint");
  EXPECT_FALSE(sync.at("async").get<bool>());
  EXPECT_GT(sync.at("host_staged_bytes").get<int64_t>(), 0) << "device state reaches the files through the host";
  EXPECT_LT(sync.at("host_staged_bytes").get<int64_t>(), sync.at("max_rank_bytes").get<int64_t>() / 2)
      << "a synchronous save stages one tensor at a time, not the rank's whole state";
  const nlohmann::json* background = nullptr;
  for (const auto& rec : resumed)
    if (rec.at("step") == 6 && rec.contains("checkpoint")) background = &rec.at("checkpoint");
  ASSERT_NE(background, nullptr) << "the resumed run saved no checkpoint at step 6";
  EXPECT_TRUE(background->at("async").get<bool>());
  EXPECT_EQ(background->at("host_staged_bytes"), background->at("rank_bytes"))
      << "a background save copies the rank's whole state to the host";
  const auto a = testing::consolidated(testing::step_dir(ck, 6), *dir_ / "rerun-base-export");
  const auto b = testing::consolidated(testing::step_dir(ck_resumed, 6), *dir_ / "rerun-resumed-export");
  EXPECT_TRUE(a.first == b.first) << "parameters at step 6 differ between the base and the resumed run";
  EXPECT_TRUE(a.second == b.second) << "AdamW moments at step 6 differ between the base and the resumed run";
}

// SIGTERM on the GPU (a scheduler's preemption): the step in flight
// finishes, a checkpoint of it is written from the device, the run exits 0
// without exporting, and resuming from `latest` continues bit for bit: the
// 200 steps of the interrupted and resumed run are an uninterrupted run's.
TEST_F(CudaTrain, SigtermCheckpointsFromTheGpuAndTheResumeIsBitExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string ck = *dir_ / "sigterm-ckpt", log = *dir_ / "sigterm/metrics.jsonl";
  const std::string sets = " --set runtime.device=cuda --set training.steps=200 --set checkpoint.dir=" + ck;
  // Signalled once three steps are logged.
  auto r = run_command("bash -c \"" + train_command("sigterm", sets + " --set export.dir=" + (*dir_ / "sigterm-hf")) +
                       " & p=\\$!; while [ \\$(cat " + log + " 2>/dev/null | wc -l) -lt 3 ]; do sleep 0.02; done; " +
                       "kill -TERM \\$p; wait \\$p\"");
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_NE(r.output.find("stopped by SIGTERM after "), std::string::npos) << r.output;
  const size_t stopped = read_jsonl(log).size();
  ASSERT_GE(stopped, 3u);
  ASSERT_LT(stopped, 200u) << "the signal came too late to test anything";
  char name[32];
  std::snprintf(name, sizeof name, "step-%08zu\n", stopped);
  EXPECT_EQ(testing::read_file(ck + "/latest"), name) << "the checkpoint is of the last finished step";
  EXPECT_FALSE(std::filesystem::exists(*dir_ / "sigterm-hf/model.safetensors")) << "a preempted run does not export";
  r = train("sigterm", sets + " --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("sigterm-whole", " --set runtime.device=cuda --set training.steps=200");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto resumed = read_jsonl(log);
  EXPECT_EQ(resumed.size(), 200u) << "one record per step";
  testing::expect_same_steps(read_jsonl(*dir_ / "sigterm-whole/metrics.jsonl"), resumed, 1, 200);
}

// `origami eval` on the GPU (the forward alone, weights loaded from an
// export into device state: a bf16 working copy beside the fp32 master, or
// the fp32 parameters): the weights of 5 CPU steps evaluated over 13
// windows (a last micro-batch of 1 beside micro-batches of 2) give the
// CPU's mean loss within 1e-4 relative in fp32 (the same math in another
// summation order, as the training comparison above) and within 2e-2 in
// bf16 (the training bar; activations and GEMM operands rounded to bf16).
// The same export then starts GPU runs (checkpoint.init_from_hf).
TEST_F(CudaTrain, EvalOnTheGpuGivesTheCpusLoss) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string weights = *dir_ / "eval-weights";
  auto r = train("eval-train", " --set training.steps=5 --set runtime.device=cpu --set export.dir=" + weights);
  ASSERT_EQ(r.status, 0) << r.output;
  // Each eval's --json names where it ran: a run that fell back to the CPU
  // would match the CPU's loss exactly and prove nothing.
  const auto eval = [&](const std::string& sets, const char* device, const char* dtype) {
    const testing::CommandResult e =
        run_command(std::string(ORIGAMI_BINARY) + " eval " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml --weights " +
                    weights + " --data " + (*dir_ / "fortunes") + " --samples 13 --json " + sets);
    EXPECT_EQ(e.status, 0) << e.output;
    const nlohmann::json j = nlohmann::json::parse(e.output.substr(e.output.rfind('{')));
    EXPECT_EQ(j.at("samples").get<int64_t>(), 13);
    EXPECT_EQ(j.at("device").get<std::string>(), device) << sets;
    EXPECT_EQ(j.at("data_dtype").get<std::string>(), dtype) << sets;
    return j.at("loss").get<double>();
  };
  const double cpu = eval("--set runtime.device=cpu", "cpu", "f32");
  const double fp32 = eval("--set runtime.device=cuda --set runtime.precision=fp32", "cuda:0", "f32");
  const double bf16 = eval("--set runtime.device=cuda --set runtime.precision=bf16", "cuda:0", "bf16");
  std::printf("[ measured ] eval on cuda:0: fp32 %.3g, bf16 %.3g relative to the CPU's loss %.6f\n",
              std::abs(fp32 - cpu) / cpu, std::abs(bf16 - cpu) / cpu, cpu);
  EXPECT_TRUE(std::isfinite(cpu) && cpu > 0) << cpu;
  EXPECT_LE(std::abs(fp32 - cpu), 1e-4 * cpu) << "fp32 eval on cuda:0 " << fp32 << " vs the CPU's " << cpu;
  EXPECT_LE(std::abs(bf16 - cpu), 2e-2 * cpu) << "bf16 eval on cuda:0 " << bf16 << " vs the CPU's " << cpu;
  // checkpoint.init_from_hf on the GPU: the same weights loaded into device
  // state and exported at once (no step) come back bit for bit in fp32, and
  // rounded to bf16 (the working copy the export reads) in bf16.
  for (const bool in_bf16 : {false, true}) {
    SCOPED_TRACE(in_bf16 ? "bf16" : "fp32");
    const std::string tag = in_bf16 ? "hf-init-bf16" : "hf-init-fp32", out = *dir_ / (tag + "-export");
    r = train(tag, std::string(" --set training.steps=0 --set runtime.device=cuda --set runtime.precision=") +
                       (in_bf16 ? "bf16" : "fp32") + " --set checkpoint.init_from_hf=" + weights +
                       " --set export.dir=" + out);
    ASSERT_EQ(r.status, 0) << r.output;
    testing::expect_export_holds_the_checkpoint_weights(out, weights, in_bf16);
  }
}

// The MoE layer's other paths trained on the GPU in fp32 against the CPU,
// 10 steps each, per-step LM, aux and z losses within 1e-4 relative and
// grad norms within 1e-3 (the bar and reasons of Fp32StepsMatchTheCpuRun):
// capacity with position drops and padding, z-loss, the per-sequence aux
// loss, a shared expert, recomputed expert activations, weight gradients
// deferred past the data gradients (zb-h1's split, at pp = 1); then a sigmoid
// router with normalized, scaled weights, group-limited routing, the global
// aux loss and the aux-loss-free expert bias (updated from each step's
// counts), with whole layers recomputed. Position drops, not
// probability drops: which slots a capacity keeps then depends only on the
// routing, not on near-ties between weights.
TEST_F(CudaTrain, MoeVariantsMatchTheCpuInFp32) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::pair<const char*, const char*> variants[] = {
      {"capacity",
       " --set moe.capacity_factor=1.0 --set moe.drop_policy=position --set moe.pad_to_capacity=true"
       " --set moe.z_loss_coeff=1e-3 --set moe.load_balancing=seq_aux_loss --set moe.shared_expert_hidden_size=64"
       " --set training.recompute=moe --set parallel.pp_schedule=zb-h1"},
      {"grouped-sigmoid",
       " --set moe.score_function=sigmoid --set moe.normalize_topk=true --set moe.topk_scaling=2.5"
       " --set moe.num_groups=4 --set moe.group_topk=2 --set moe.load_balancing=global_aux_loss"
       " --set moe.expert_bias=true --set moe.bias_update_rate=1e-3 --set training.recompute=full"}};
  for (const auto& [name, variant] : variants) {
    SCOPED_TRACE(name);
    const std::string sets = std::string(" --set training.steps=10 --set runtime.precision=fp32") + variant;
    auto r = train(std::string(name) + "-cpu", sets + " --set runtime.device=cpu");
    ASSERT_EQ(r.status, 0) << r.output;
    r = train(std::string(name) + "-gpu", sets + " --set runtime.device=cuda");
    ASSERT_EQ(r.status, 0) << r.output;
    const auto cpu = read_jsonl(*dir_ / (std::string(name) + "-cpu/metrics.jsonl"));
    const auto gpu = read_jsonl(*dir_ / (std::string(name) + "-gpu/metrics.jsonl"));
    ASSERT_EQ(cpu.size(), 10u);
    ASSERT_EQ(gpu.size(), 10u);
    double worst = 0;
    for (size_t s = 0; s < cpu.size(); ++s) {
      EXPECT_EQ(gpu[s].at("mem").at("device").get<std::string>(), "cuda:0") << "step " << s + 1;
      for (const char* key : {"lm_loss", "aux_loss", "z_loss"}) {
        const double b = cpu[s].at(key).get<double>(), x = gpu[s].at(key).get<double>();
        if (b != 0) worst = std::max(worst, std::abs(x - b) / std::abs(b));
        EXPECT_LE(std::abs(x - b), 1e-4 * std::abs(b)) << key << ", step " << s + 1 << ": " << x << " vs " << b;
      }
      const double bg = cpu[s].at("grad_norm").get<double>(), xg = gpu[s].at("grad_norm").get<double>();
      EXPECT_LE(std::abs(xg - bg), 1e-3 * bg) << "grad norm, step " << s + 1;
    }
    std::printf("[ measured ] fp32 on cuda:0, %s: worst loss difference %.3g relative over 10 steps\n", name, worst);
  }
}

// A diverged GPU run ends as a CPU run does (tests/test_cli_faults.cpp):
// exit 3 naming the step, the losses and the setting to change, before the
// optimizer applies the step, with no device fault on the way. init_std =
// 1e38 gives infinite weights, so NaN flows from the first norm through
// the router's top-k on NaN logits (valid experts, NaN weights:
// kernels/moe_ops.h), the dispatch, the grouped GEMMs and the backward,
// in both precisions; lr = 1e30 breaks the second step (bf16).
TEST_F(CudaTrain, DivergenceEndsWithStatus3AsOnTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const auto expect_diverged = [](const testing::CommandResult& r, std::initializer_list<const char*> needles) {
    EXPECT_EQ(r.status, 3) << r.output;
    for (const char* needle : needles)
      EXPECT_NE(r.output.find(needle), std::string::npos) << "missing '" << needle << "' in:\n" << r.output;
    for (const char* fault : {"check failed", "internal error", "cudaError", "Assertion", "Segmentation", "signal"})
      EXPECT_EQ(r.output.find(fault), std::string::npos) << "'" << fault << "' in:\n" << r.output;
  };
  for (const std::string precision : {"bf16", "fp32"}) {
    SCOPED_TRACE(precision);
    const std::string base = " --set training.steps=4 --set runtime.device=cuda --set runtime.precision=" + precision;
    expect_diverged(train("diverged-init-" + precision, base + " --set model.init_std=1e38"),
                    {"training diverged at step 1 of 4", "lm loss nan", "model.init_std = 1e+38"});
    if (precision != "bf16") continue;  // the update's path: the bf16 recipe's (fp32 shares its kernels)
    expect_diverged(train("diverged-lr-" + precision, base + " --set optimizer.lr=1e30"),
                    {"training diverged at step 2 of 4", "grad norm is not finite", "optimizer.lr = 1e+30"});
  }
}

// One rank more than the node has GPUs: local ranks map to cuda:(local rank
// mod devices), so the last shares rank 0's GPU, and the job is refused
// before any step, every rank exiting 2 with one message naming the ranks,
// the GPU's UUID and runtime.device (NCCL would refuse the pair anyway, less
// clearly, and they would share the GPU's memory).
TEST_F(CudaTrain, TwoRanksOnOneGpuAreRefusedNamingThem) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const int devices = cuda_device_count(), np = devices + 1;
  const testing::CommandResult r = run_command(
      std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -n " + std::to_string(np) +
      " " + ORIGAMI_BINARY + " train " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml --set data.path=" +
      (*dir_ / "fortunes") + " --set logging.dir=" + (*dir_ / "shared-gpu") + " --set export.dir=" +
      " --set runtime.device=cuda --set training.steps=1 --set training.global_batch=" + std::to_string(2 * np));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("runtime.device = \"cuda\" runs one GPU per rank, but ranks 0, " + std::to_string(devices) +
                          " share GPU GPU-"),
            std::string::npos)
      << r.output;
  // Every other rank has a GPU of its own: cuda:(local rank).
  const Config cfg = load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-moe.toml");
  Config on_cuda = cfg;
  on_cuda.runtime.device = RuntimeDevice::cuda;
  for (int local = 0; local < np; ++local)
    EXPECT_EQ(resolve_placement(on_cuda, local, np).device, Device::cuda(local % devices));
}

// A model that cannot fit the GPU is refused before anything is allocated
// (engine/config_rules.cpp's lower bound against the device's memory, not
// the host's): the Mixtral-like config at 60 layers, exit 2 naming cuda:0
// and what to change.
TEST_F(CudaTrain, AModelPastTheGpusMemoryIsRefusedBeforeTraining) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const testing::CommandResult r = run_command(
      std::string(ORIGAMI_BINARY) + " train " + ORIGAMI_SOURCE_DIR + "/configs/gpu-mixtral-h200.toml --set data.path=" +
      (*dir_ / "fortunes") + " --set logging.dir=" + (*dir_ / "too-big") +
      " --set export.dir= --set runtime.device=cuda --set model.num_layers=60");
  EXPECT_EQ(r.status, 2) << r.output;
  for (const char* needle : {"needs at least", "and its cuda:0 has", "check model.num_layers"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << "missing '" << needle << "' in:\n" << r.output;
}

// More experts than the CUDA router's shared memory holds (kernels/moe_ops.h)
// is the config's doing: refused before training, exit 2 naming the key
// and the limit, not an internal error at the first step.
TEST_F(CudaTrain, MoreExpertsThanTheCudaRouterHoldsAreRefusedBeforeTraining) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const testing::CommandResult r = train("too-many-experts", " --set runtime.device=cuda --set moe.num_experts=7000");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("moe.num_experts = 7000 (num_groups 1, top_k 2) on cuda:0: the CUDA router keeps"),
            std::string::npos)
      << r.output;
}

// A head_dim past what the CUDA attention's shared memory holds
// (kernels/attention.h: 290 on Hopper) is the config's doing too: refused
// before training; the largest that fits trains, in fp32 within 1e-4 of the
// CPU's losses (the op tests stop at head_dim 128, so this is the one
// numerical check of the widest tiles).
TEST_F(CudaTrain, AHeadDimPastTheAttentionsSharedMemoryIsRefusedAndTheLargestTrains) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string heads = " --set runtime.device=cuda --set model.num_heads=2 --set model.num_kv_heads=2";
  testing::CommandResult r = train("head-dim-320", heads + " --set model.hidden_size=640 --set training.steps=2");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("head_dim = model.hidden_size / model.num_heads = 640 / 2 = 320 on cuda:0"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("head_dim <= "), std::string::npos) << r.output;
  const int64_t largest = attention_cuda_max_head_dim(cuda_device_shared_memory_per_block(0));
  const std::string widest = " --set model.num_heads=2 --set model.num_kv_heads=2 --set model.hidden_size=" +
                             std::to_string(2 * largest) + " --set training.steps=2 --set runtime.precision=fp32";
  r = train("head-dim-largest", widest + " --set runtime.device=cuda");
  ASSERT_EQ(r.status, 0) << "head_dim " << largest << ":\n" << r.output;
  r = train("head-dim-largest-cpu", widest + " --set runtime.device=cpu");
  ASSERT_EQ(r.status, 0) << "head_dim " << largest << " on the CPU:\n" << r.output;
  const auto gpu = read_jsonl(*dir_ / "head-dim-largest/metrics.jsonl");
  const auto cpu = read_jsonl(*dir_ / "head-dim-largest-cpu/metrics.jsonl");
  ASSERT_EQ(gpu.size(), 2u);
  ASSERT_EQ(cpu.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(gpu[s].at("mem").at("device").get<std::string>(), "cuda:0");
    const double b = cpu[s].at("lm_loss").get<double>(), x = gpu[s].at("lm_loss").get<double>();
    EXPECT_LE(std::abs(x - b), 1e-4 * std::abs(b)) << "head_dim " << largest << ", step " << s + 1;
  }
}

// `origami bench kernels --device cuda` beyond gpu_check's run (bf16 at the
// model's shapes): the tiny shapes in f32 and in bf16 time every op the CPU
// times at those shapes, each op's data read back right, with consistent
// figures (tests/cli_checks.h).
TEST(CudaBench, KernelsAtTinyShapesInEitherDtypeTimeEveryOpTheCpuTimes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const auto report = [](const std::string& args) {
    const testing::CommandResult r =
        run_command(std::string(ORIGAMI_BINARY) + " bench kernels --shapes tiny --samples 3 --json " + args);
    EXPECT_EQ(r.status, 0) << r.output;
    return nlohmann::json::parse(r.output.substr(r.output.find('{')));
  };
  const std::set<std::string> cpu = testing::expect_bench_kernels_report(report("--device cpu"));
  for (const char* dtype : {"f32", "bf16"}) {
    SCOPED_TRACE(dtype);
    EXPECT_EQ(testing::expect_bench_kernels_report(report(std::string("--device cuda --dtype ") + dtype)), cpu);
  }
}

TEST(DevicePeak, TwoGpuMeasurementsInARowAgree) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const ExecContext ctx = ExecContext::cuda(0);
  const GemmPeak first = measure_gemm_peak(ctx, nullptr);
  const GemmPeak second = measure_gemm_peak(ctx, nullptr);
  EXPECT_EQ(first.n, 8192);
  EXPECT_EQ(first.dtype, DType::bf16);
  std::printf("[ measured ] start-up GEMM peak, bf16 %lld^3: %.1f then %.1f TFLOP/s\n", static_cast<long long>(first.n),
              first.flops_per_s / 1e12, second.flops_per_s / 1e12);
  // A tensor-core bf16 GEMM of this size runs at hundreds of TFLOP/s on any
  // data-centre GPU since Volta; 10 is a floor that only a broken timing fails.
  EXPECT_GT(first.flops_per_s, 10e12);
  EXPECT_NEAR(first.flops_per_s / second.flops_per_s, 1.0, 0.1)
      << "the first measurement started on idle clocks: its warm-up did not reach the load clock";
}

TEST(DevicePeak, HostMeasuresSgemmOnItsThreads) {
  const GemmPeak peak = measure_gemm_peak(ExecContext::cpu(1), nullptr);
  EXPECT_EQ(peak.n, 1024);
  EXPECT_EQ(peak.dtype, DType::f32);
  EXPECT_GT(peak.flops_per_s, 1e8) << "a 1024^3 sgemm taking over 20 s is a broken timing, not a slow core";
  EXPECT_TRUE(std::isfinite(peak.flops_per_s));
}

}  // namespace
}  // namespace origami
