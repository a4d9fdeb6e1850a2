// `origami bench step --json` runs end to end and reports consistent figures.
// No timing is asserted (the machine is shared); the figures' relations are.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "cli_checks.h"
#include "cli_util.h"
#include "kernels/device.h"

namespace origami {
namespace {

TEST(CliBench, StepReportsRatesBesideTheSgemmBaseline) {
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench step --config " + ORIGAMI_SOURCE_DIR +
                                "/configs/tiny-dense.toml --steps 2 --warmup 1 --json --set training.seq_len=64");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  for (const char* key : {"step_time_s", "tokens_per_s", "step_gflops", "sgemm_gflops", "ratio_to_sgemm"})
    EXPECT_GT(j.at(key).get<double>(), 0.0) << key;
  EXPECT_NEAR(j["ratio_to_sgemm"].get<double>(), j["step_gflops"].get<double>() / j["sgemm_gflops"].get<double>(),
              1e-9);
  EXPECT_NEAR(j["tokens_per_s"].get<double>() * j["step_time_s"].get<double>(),
              j["tokens_per_step"].get<double>(), 1e-6 * j["tokens_per_step"].get<double>());
  EXPECT_GT(j["attention_flops_per_step"].get<double>(), 0.0);
  // A layout of several ranks is refused, not timed as one rank's.
  r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench step --config " + ORIGAMI_SOURCE_DIR +
                           "/configs/tiny-moe.toml --steps 1 --warmup 0 --set parallel.pp=2");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("bench step times one rank's whole model"), std::string::npos) << r.output;
}

// bench checkpoint: one repeat of tiny-moe; the byte counts agree with the
// checkpoint it wrote, the ratios with the reported rates.
TEST(CliBench, CheckpointReportsRatesBesideTheDisk) {
  testing::ScratchDir dir("bench-ckpt");
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench checkpoint --config " + ORIGAMI_SOURCE_DIR +
                                "/configs/tiny-moe.toml --repeat 1 --json --dir " + dir.str());
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  for (const char* key : {"save_gb_s", "disk_write_gb_s", "load_gb_s", "disk_read_gb_s", "async_blocked_s"})
    EXPECT_GT(j.at(key).get<double>(), 0.0) << key;
  EXPECT_NEAR(j["save_over_disk"].get<double>(), j["save_gb_s"].get<double>() / j["disk_write_gb_s"].get<double>(), 1e-9);
  EXPECT_EQ(j["bytes_total"], j["bytes_per_rank"]) << "one rank";
  EXPECT_GT(j["bytes_total"].get<int64_t>(), 12 * 1500000) << "tiny-moe's 1.58M parameters, 12 bytes each";
}

// bench kernels at tiny shapes on the CPU: every op of the table, each with
// a finite positive time and rate, its fraction the rate over the ceiling it
// is measured against, and the routing line's share of the expert GEMMs.
TEST(CliBench, KernelsReportsEveryOpAgainstTheCeilings) {
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) +
                                " bench kernels --device cpu --shapes tiny --samples 3 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  const std::set<std::string> keys = testing::expect_bench_kernels_report(j);
  for (const char* key :
       {"gemm/q.fwd", "gemm/q.dgrad", "gemm/q.wgrad", "gemm/kv.fwd", "gemm/out.fwd", "gemm/mlp_up.fwd",
        "gemm/mlp_down.wgrad", "grouped_gemm/gate_up.fwd", "grouped_gemm/down.fwd", "grouped_gemm/down.dgrad",
        "grouped_gemm/gate_up.dgrad", "grouped_gemm_wgrad/gate_up", "grouped_gemm_wgrad/down",
        "grouped_gemm/coarse.fwd", "grouped_gemm/coarse.grouped", "attention_forward", "attention_backward",
        "rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward",
        "swiglu_forward", "swiglu_backward", "embedding_forward", "embedding_backward", "cross_entropy_forward",
        "cross_entropy_backward", "adamw_update", "adamw_unit", "adamw_unit.calls", "moe_routing_permute"})
    EXPECT_EQ(keys.count(key), 1u) << key;
  for (const auto& op : j["ops"])
    if (op["key"] == "moe_routing_permute") {
      EXPECT_GT(op.at("fraction_of_expert_gemm").get<double>(), 0.0);
      EXPECT_EQ(op["target"]["max"].get<double>(), 0.10);
    }
}

// Without a CUDA device (or a CUDA build) --device cuda is a usage error
// that says why.
TEST(CliBench, KernelsOnCudaWithoutADeviceIsAUserError) {
  if (built_with_cuda() && cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench kernels --device cuda --shapes tiny");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("bench kernels --device cuda"), std::string::npos) << r.output;
}

// bench moe-layer sizes its own buffers: an expert layer this machine cannot
// hold is refused before it allocates, naming the parts (under Linux's
// overcommit the allocations would succeed and the OOM killer end the run).
TEST(CliBench, MoeLayerRefusesALayerThisMachineCannotHold) {
  const std::string src = ORIGAMI_SOURCE_DIR;
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench moe-layer --config " + src +
                                "/configs/deepseek-v3.toml --set parallel.pp=1 --set parallel.ep=1 --set "
                                "moe.ffn_hidden_size=1048576 --steps 1 --warmup 0");
  EXPECT_EQ(r.status, 2) << r.output;
  for (const std::string needle :
       {"deepseek-v3.toml with --set moe.ffn_hidden_size=1048576, --set parallel.ep=1, --set parallel.pp=1: bench "
        "moe-layer: needs at least",
        "this rank's 256 experts of 3 x 1048576 x 7168",
        "one micro-batch's 4096 tokens and 32768 routed rows", "rank(s) share this machine's", "(--ep)"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
}

// The host-engine benchmarks time the CPU engine: a config asking for CUDA
// is refused (exit 2, naming where the setting came from and what measures
// a GPU) rather than timed on the CPU under a GPU config's name.
TEST(CliBench, HostEngineBenchmarksRefuseACudaConfig) {
  const std::string src = ORIGAMI_SOURCE_DIR;
  for (const std::string& cmd : {"step --config " + src + "/configs/bench-dense.toml",
                                "moe-layer --config " + src + "/configs/bench-moe.toml",
                                "checkpoint --config " + src + "/configs/tiny-moe.toml --dir /nonexistent"}) {
    SCOPED_TRACE(cmd);
    auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench " + cmd + " --set runtime.device=cuda");
    EXPECT_EQ(r.status, 2) << r.output;
    const std::string name = cmd.substr(0, cmd.find(' '));
    EXPECT_NE(r.output.find("--set runtime.device=cuda: runtime.device = \"cuda\": bench " + name +
                            " times the CPU engine, not the GPU's"),
              std::string::npos)
        << r.output;
  }
}

TEST(CliBench, UnknownBenchIsAUsageError) {
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench nosuch");
  EXPECT_EQ(r.status, 2) << r.output;
}

}  // namespace
}  // namespace origami
