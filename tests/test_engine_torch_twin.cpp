// tools/train_torch.py, the PyTorch eager twin the GPU check times origami
// against (README, "The GPU check"): it has to be the same model, and it has
// to run, and on a lent GPU its step of the check gets one try. So both are
// checked here, on the CPU:
//  - the same model, for every shipped config: the twin's parameter count,
//    built on torch's meta device (no memory), equals plan::param_counts,
//    which equals Model(...)'s units on one rank. A missing norm, a tied
//    head, a wrong expert or shared-expert width, or a dense layer where
//    origami has a MoE one all change it (that it computes the same
//    function is test_cli_reference_moe.cpp's TheTorchTwinComputesTheSameModel:
//    origami's weights loaded into the twin give origami's loss);
//  - it runs: a few steps of tiny-moe on the CPU in fp32 and in bf16
//    autocast (torch 1.x here, with the twin's written-out attention in
//    place of scaled_dot_product_attention), reporting a finite loss near
//    ln V (random tokens on a fresh model) and its shape;
//  - when it fails, it still leaves a result: the check reads a JSON error
//    (and retries with fewer layers under --fit when the error is running
//    out of memory, whichever way PyTorch or a library reports that).
// Needs /usr/bin/python3 with torch (tools/setup.sh installs python3-torch).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
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
  std::vector<std::string> paths;
  for (const fs::directory_entry& e : fs::directory_iterator(kConfigs))
    if (e.path().extension() == ".toml") paths.push_back(e.path().string());
  std::sort(paths.begin(), paths.end());
  ASSERT_GE(paths.size(), 8u) << "fewer shipped configs than expected under " << kConfigs;
  // The first through the command line (--device meta), the rest through
  // the same functions in one interpreter: importing torch is most of a
  // run's time (~2 s), and the count is the model's, not the CLI's.
  const nlohmann::json first = twin(paths[0], "--device meta", dir);
  std::string script = "import json, sys; sys.path.insert(0, '" + std::string(ORIGAMI_SOURCE_DIR) +
                       "/tools'); import torch, train_torch as t\n"
                       "for c in sys.argv[1:]:\n"
                       "    s = t.shape_of(t.read_toml(c))\n"
                       "    m = t.build(torch, s, torch.device('meta'))\n"
                       "    print(json.dumps({'config': c, 'params': sum(p.numel() for p in m.parameters()), "
                       "'layers': s['L']}))\n";
  testing::write_file(dir / "count.py", script);
  std::string args;
  for (size_t i = 1; i < paths.size(); ++i) args += " " + paths[i];
  const testing::CommandResult r = run_command(kPython + " " + (dir / "count.py") + args);
  ASSERT_EQ(r.status, 0) << r.output;
  std::map<std::string, nlohmann::json> got = {{paths[0], first}};
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] == '{') {
      const nlohmann::json j = nlohmann::json::parse(line);
      got[j["config"].get<std::string>()] = j;
    }
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    const Config cfg = load_config(path);
    ASSERT_TRUE(got.count(path) && got[path].contains("params")) << r.output;
    EXPECT_EQ(got[path]["params"].get<int64_t>(), plan::param_counts(cfg.model, cfg.moe).total);
    EXPECT_EQ(got[path]["layers"].get<int64_t>(), cfg.model.num_layers);
  }
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

TEST(TorchTwin, AFailureStillLeavesAJsonErrorAndExitOne) {
  const ScratchDir dir("twin-fail");
  // 4 query heads over 3 kv heads: the model builds, its attention's shapes
  // disagree at the first forward (a RuntimeError that is not memory).
  std::ifstream in(kConfigs + "/tiny-moe.toml");
  std::stringstream text;
  text << in.rdbuf();
  std::string config = text.str();
  const std::string kv = "num_kv_heads = 2";
  ASSERT_NE(config.find(kv), std::string::npos);
  config.replace(config.find(kv), kv.size(), "num_kv_heads = 3");
  testing::write_file(dir / "bad.toml", config);
  const std::string out = dir / "twin.json";
  const testing::CommandResult r = run_command(kPython + " " + kTwin + " " + (dir / "bad.toml") +
                                               " --device cpu --steps 1 --warmup 0 --global-batch 2 --fit --json " + out);
  EXPECT_EQ(r.status, 1) << r.output;
  std::ifstream result(out);
  ASSERT_TRUE(result) << "no JSON from the twin:\n" << r.output;
  const nlohmann::json j = nlohmann::json::parse(result);
  ASSERT_TRUE(j.contains("error")) << j.dump();
  EXPECT_EQ(j["error"].get<std::string>().rfind("RuntimeError: ", 0), 0u) << j.dump();
  EXPECT_FALSE(j.contains("oom_layers")) << "a shape error is not out of memory: " << j.dump();
}

TEST(TorchTwin, OutOfMemoryIsRecognizedHoweverItIsReported) {
  // PyTorch's allocator raises torch.cuda.OutOfMemoryError; cuBLAS and
  // kernel launches that run out surface as RuntimeErrors with the CUDA or
  // cuBLAS status in the message. All three make --fit try fewer layers.
  const std::string script =
      "import sys; sys.path.insert(0, '" + std::string(ORIGAMI_SOURCE_DIR) + "/tools'); import torch, train_torch as t\n"
      "cases = [torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'),\n"
      "         RuntimeError('CUDA error: out of memory\\nCUDA kernel errors might be reported later'),\n"
      "         RuntimeError('CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`'),\n"
      "         RuntimeError('The size of tensor a (4) must match the size of tensor b (3)'),\n"
      "         ValueError('out of memory')]\n"
      "print(''.join('1' if t.is_out_of_memory(torch, e) else '0' for e in cases))\n";
  const ScratchDir dir("twin-oom");
  testing::write_file(dir / "oom.py", script);
  const testing::CommandResult r = run_command(kPython + " " + (dir / "oom.py"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("11100"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace origami
