// Training on the GPU through the binary (runtime.device = "cuda"), against
// the CPU engine. With a CUDA build and a device:
//   - 20 steps of configs/tiny-moe.toml on cuda:0 in fp32 give the one-rank
//     CPU run's per-step LM and aux losses within 1e-4 relative, and its
//     grad norms within 1e-3. Why 1e-4 holds: both runs compute the same
//     fp32 math in another summation order (cuBLAS against oneDNN GEMMs, the
//     tiled attention against the CPU's, CUB against the CPU's reductions),
//     ~1e-6 relative per op; measured CPU layouts differ by ~1e-7 over 10
//     steps. A flipped near-tie in routing would show as a jump above it.
//   - a checkpoint written by the GPU run loads on the CPU and one written
//     on the CPU loads on the GPU: loaded and saved again at once, the
//     consolidated parameters and AdamW moments are bitwise those saved.
// Without a device every test skips (runtime.device = "cuda" refused there:
// tests/test_cli_errors.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_util.h"
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
  static std::string step_dir(const std::string& tag, int step) {
    char name[32];
    std::snprintf(name, sizeof name, "/step-%08d", step);
    return *dir_ / (tag + "-ckpt") + name;
  }
  // The checkpoint's consolidated parameters and moments, as file bytes.
  static std::pair<std::string, std::string> consolidated(const std::string& step, const std::string& out) {
    auto r = run_command(std::string(ORIGAMI_BINARY) + " export --optimizer --checkpoint " + step + " --out " + out);
    EXPECT_EQ(r.status, 0) << r.output;
    return {testing::read_file(out + "/model.safetensors"), testing::read_file(out + "/optimizer.safetensors")};
  }

  static testing::ScratchDir* dir_;
};

testing::ScratchDir* CudaTrain::dir_ = nullptr;

TEST_F(CudaTrain, Fp32StepsMatchTheCpuRun) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string steps = " --set training.steps=20";
  auto r = train("cpu", steps + " --set runtime.device=cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("gpu", steps + " --set runtime.device=cuda --set runtime.precision=fp32");
  ASSERT_EQ(r.status, 0) << r.output;
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
  std::printf("fp32 on cuda:0 against the CPU: worst lm loss difference %.3g relative over 20 steps\n", worst);
  EXPECT_LT(gpu.back().at("lm_loss").get<double>(), gpu.front().at("lm_loss").get<double>());
}

TEST_F(CudaTrain, CheckpointsMoveBetweenGpuAndCpuBitExact) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const std::string save = " --set training.steps=3 --set checkpoint.interval=3";
  const struct {
    const char* from;
    const char* to;
  } moves[] = {{"cuda", "cpu"}, {"cpu", "cuda"}};
  for (const auto& m : moves) {
    SCOPED_TRACE(std::string(m.from) + " -> " + m.to);
    const std::string saved = std::string("saved-on-") + m.from, moved = std::string("loaded-on-") + m.to;
    auto r = train(saved, save + " --set runtime.device=" + m.from + " --set checkpoint.dir=" + (*dir_ / (saved + "-ckpt")));
    ASSERT_EQ(r.status, 0) << r.output;
    // Loaded and saved again at once (no step).
    r = train(moved, save + " --set runtime.device=" + m.to + " --set checkpoint.load=" + step_dir(saved, 3) +
                         " --set checkpoint.dir=" + (*dir_ / (moved + "-ckpt")));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto want = consolidated(step_dir(saved, 3), *dir_ / (saved + "-export"));
    const auto got = consolidated(step_dir(moved, 3), *dir_ / (moved + "-export"));
    ASSERT_FALSE(want.first.empty());
    EXPECT_TRUE(got.first == want.first) << "consolidated parameters differ after the move";
    EXPECT_TRUE(got.second == want.second) << "consolidated AdamW moments differ after the move";
  }
}

}  // namespace
}  // namespace origami
