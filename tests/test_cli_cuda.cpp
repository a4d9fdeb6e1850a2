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
//     The distance to the CPU's emulated bf16 run is printed: same rule per
//     element, other summation order.
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
//   - a diverged run (infinite initial weights, NaN through every kernel
//     of the step; a learning rate of 1e30) exits 3 as on the CPU.
//   - one rank more than the node's GPUs (two ranks on one GPU) is refused
//     before any step, exit 2, naming the ranks, the GPU's UUID and
//     runtime.device; each rank's GPU is cuda:(local rank mod devices).
// Each figure is printed on a line of its own beginning "[ measured ]",
// which tools/gpu_check.sh copies from CTest's JUnit file into its summary.
// Without a device every test skips (runtime.device = "cuda" refused there:
// tests/test_cli_errors.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_checks.h"
#include "engine/config.h"
#include "engine/device_peak.h"
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
    auto r = testing::preprocess_fortunes(*dir_ / "fortunes");
    ASSERT_EQ(r.status, 0) << r.output;
  }
  static void TearDownTestSuite() { delete dir_; }

  // One rank of tiny-moe, logging into tag/.
  static testing::CommandResult train(const std::string& tag, const std::string& extra) {
    return run_command(std::string(ORIGAMI_BINARY) + " train " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml" +
                       " --set data.path=" + (*dir_ / "fortunes") + " --set logging.dir=" + (*dir_ / tag) +
                       " --set export.dir= " + extra);
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
  EXPECT_LT(gpu.back().at("lm_loss").get<double>(), 0.9 * gpu.front().at("lm_loss").get<double>());
  r = run_command(std::string(ORIGAMI_BINARY) + " plan " + ORIGAMI_SOURCE_DIR +
                  "/configs/tiny-moe.toml --world 1 --json --set runtime.device=cuda");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json plan = nlohmann::json::parse(r.output);
  EXPECT_EQ(plan.at("recipe"), "bf16");
  const nlohmann::json& planned = plan.at("ledger").at("stages").at(0);
  for (const auto& rec : gpu) {
    EXPECT_EQ(rec.at("mem").at("device").get<std::string>(), "cuda:0");
    for (const char* key : {"param", "grad", "optim"})
      EXPECT_EQ(rec.at("mem").at("persistent").at(key).get<int64_t>(), planned.at(key).get<int64_t>())
          << key << " bytes at step " << rec.at("step");
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

// A diverged GPU run ends as a CPU run does (tests/test_cli_faults.cpp):
// exit 3 naming the step, the losses and the setting to change, before the
// optimizer applies the step, with no device fault on the way. init_std =
// 1e38 gives infinite weights, so NaN flows from the first norm through
// the router's top-k on NaN logits (valid experts, NaN weights:
// kernels/moe_ops.h), the dispatch, the grouped GEMMs and the backward;
// lr = 1e30 breaks the second step. Both precisions.
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
