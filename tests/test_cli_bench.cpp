// `origami bench step --json` runs end to end and reports consistent figures.
// No timing is asserted (the machine is shared); the figures' relations are.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"

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

TEST(CliBench, UnknownBenchIsAUsageError) {
  auto r = testing::run_command(std::string(ORIGAMI_BINARY) + " bench nosuch");
  EXPECT_EQ(r.status, 2) << r.output;
}

}  // namespace
}  // namespace origami
