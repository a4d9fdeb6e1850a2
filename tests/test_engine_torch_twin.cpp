// tools/train_torch.py, the PyTorch eager twin the GPU check times origami
// against (README, "The GPU check"): it has to be the same model, and it has
// to run, and on a lent GPU its step of the check gets one try. So both are
// checked here, on the CPU:
//  - the same model, for every shipped config: the twin's parameter count,
//    built on torch's meta device (no memory), equals plan::param_counts,
//    which equals Model(...)'s units on one rank. A missing norm, a tied
//    head, a wrong expert or shared-expert width, or a dense layer where
//    origami has a MoE one all change it;
//  - it runs: a few steps of tiny-moe on the CPU in fp32 and in bf16
//    autocast (torch 1.x here, with the twin's written-out attention in
//    place of scaled_dot_product_attention), reporting a finite loss near
//    ln V (random tokens on a fresh model) and its shape.
// Needs /usr/bin/python3 with torch (tools/setup.sh installs python3-torch).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_util.h"
#include "engine/config.h"
#include "engine/plan.h"

namespace origami {
namespace {

namespace fs = std::filesystem;
using testing::run_command;
using testing::ScratchDir;

const std::string kPython = "/usr/bin/python3";
const std::string kTwin = std::string(ORIGAMI_SOURCE_DIR) + "/tools/train_torch.py";
const std::string kConfigs = std::string(ORIGAMI_SOURCE_DIR) + "/configs";

// The twin's JSON result for `args`; fails the test (naming the output) when
// it exits non-zero or writes no JSON.
nlohmann::json twin(const std::string& config, const std::string& args, const ScratchDir& dir) {
  const std::string out = dir / "twin.json";
  fs::remove(out);
  const testing::CommandResult r = run_command(kPython + " " + kTwin + " " + config + " " + args + " --json " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  std::ifstream in(out);
  if (!in) {
    ADD_FAILURE() << "no JSON from the twin:\n" << r.output;
    return nlohmann::json::object();
  }
  return nlohmann::json::parse(in);
}

TEST(TorchTwin, CountsOrigamisParametersForEveryShippedConfig) {
  const ScratchDir dir("twin-count");
  int checked = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(kConfigs)) {
    if (e.path().extension() != ".toml") continue;
    const std::string path = e.path().string();
    SCOPED_TRACE(path);
    const Config cfg = load_config(path);
    const int64_t want = plan::param_counts(cfg.model, cfg.moe).total;
    const nlohmann::json got = twin(path, "--device meta", dir);
    ASSERT_TRUE(got.contains("params")) << got.dump();
    EXPECT_EQ(got["params"].get<int64_t>(), want);
    EXPECT_EQ(got["layers"].get<int64_t>(), cfg.model.num_layers);
    ++checked;
  }
  EXPECT_GE(checked, 8) << "fewer shipped configs than expected under " << kConfigs;
}

TEST(TorchTwin, TrainsTinyMoeOnTheCpuInBothPrecisions) {
  const ScratchDir dir("twin-train");
  const std::string config = kConfigs + "/tiny-moe.toml";
  const Config cfg = load_config(config);
  const double ln_v = std::log(static_cast<double>(cfg.model.vocab_size));
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const nlohmann::json r =
        twin(config, std::string("--device cpu --steps 2 --warmup 1 --global-batch 2 --precision ") + precision, dir);
    ASSERT_FALSE(r.contains("error") || r.contains("skipped")) << r.dump();
    EXPECT_EQ(r["params"].get<int64_t>(), plan::param_counts(cfg.model, cfg.moe).total);
    EXPECT_EQ(r["layers"].get<int64_t>(), cfg.model.num_layers);
    EXPECT_EQ(r["tokens_per_step"].get<int64_t>(), 2 * cfg.training.seq_len);
    EXPECT_GT(r["tokens_per_s"].get<double>(), 0.0);
    // Three AdamW steps at lr 1e-4 on uniform random tokens leave the loss
    // where a fresh model starts, ln V (5.55 here) plus the spread of its
    // small random logits: measured 5.75. A model that does not compute a
    // distribution over the vocabulary lands far from it.
    const double loss = r["final_loss"].get<double>();
    EXPECT_TRUE(std::isfinite(loss));
    EXPECT_NEAR(loss, ln_v, 0.5);
  }
}

}  // namespace
}  // namespace origami
