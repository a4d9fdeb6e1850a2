// `origami groups` and `origami bench comm` end to end: Megatron's documented
// rank map through the CLI, JSON shape, config input, exit 2 with the numbers
// for impossible layouts, and the comm benchmark's figures and data check.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"

namespace origami {
namespace {

const std::string kBin = ORIGAMI_BINARY;
const std::string kMpirun = std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe -n ";

// Ordered: the key order is part of the output (dense kinds, then expert kinds, as printed).
nlohmann::ordered_json parse_json(const std::string& out) {
  return nlohmann::ordered_json::parse(out.substr(out.find('{')));
}

// initialize_model_parallel's docstring example (16 GPUs, TP 2, PP 4; ETP defaults to TP there).
TEST(CliGroups, JsonReproducesMegatronExample) {
  auto r = testing::run_command(kBin + " groups --world 16 --tp 2 --pp 4 --etp 2 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = parse_json(r.output);
  using G = std::vector<std::vector<int>>;
  EXPECT_EQ(j["dense"]["tp"].get<G>(), (G{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(j["dense"]["pp"].get<G>(), (G{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(j["dense"]["dp"].get<G>(), (G{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(j["dense"]["embedding"].get<G>(), (G{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  std::vector<std::string> dense, expert;
  for (auto& [k, v] : j["dense"].items()) dense.push_back(k);
  for (auto& [k, v] : j["expert"].items()) expert.push_back(k);
  EXPECT_EQ(dense,
            (std::vector<std::string>{"tp", "cp", "dp", "dp-cp", "tp-cp", "tp-dp-cp", "pp", "tp-pp", "embedding"}));
  EXPECT_EQ(expert, (std::vector<std::string>{"ep", "etp", "edp", "tp-ep", "tp-ep-pp"}));
}

TEST(CliGroups, TextListsEveryGroupAndTheRank) {
  auto r = testing::run_command(kBin + " groups --world 8 --tp 2 --pp 2 --ep 2 --etp 1 --rank 6");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("dense tp (4 groups of 2): [0,1] [2,3] [4,5] [6,7]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("expert edp (4 groups of 2): [0,2] [1,3] [4,6] [5,7]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 6: dense tp 0 cp 0 dp 1 pp 1; expert etp 0 ep 0 edp 1"), std::string::npos) << r.output;
}

TEST(CliGroups, ConfigSectionAndExpertCount) {
  // tiny-dense with 8 experts: the layout comes from [parallel] and moe.num_experts.
  const std::string cfg =
      " groups --config " + std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-dense.toml --set moe.num_experts=8";
  auto r = testing::run_command(kBin + cfg +
                                " --world 8 --set parallel.tp=2 --set parallel.pp=2 --set parallel.ep=2 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = parse_json(r.output);
  EXPECT_EQ(j["sizes"]["edp"].get<int>(), 2);
  EXPECT_EQ(j["expert"]["tp-ep-pp"].get<std::vector<std::vector<int>>>(),
            (std::vector<std::vector<int>>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  // EP = 3 cannot split 8 experts (W = 6 itself divides by ETP·EP·PP = 3).
  auto bad = testing::run_command(kBin + cfg + " --world 6 --set parallel.ep=3");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("tiny-dense.toml"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("num_experts = 8 is not divisible by EP = 3"), std::string::npos) << bad.output;
}

TEST(CliGroups, InvalidLayoutsExit2WithTheNumbers) {
  const struct {
    std::string args, message;
  } cases[] = {
      {"--world 12 --tp 8", "world size 12 is not divisible by TP·CP·PP = 8·1·1 = 8"},
      {"--world 8 --ep 16", "world size 8 is not divisible by ETP·EP·PP = 1·16·1 = 16"},
      {"--world 8 --ep 2 --order tp-dp-pp", "omits axis 'ep' but EP = 2"},
      {"--world 8 --pp 2 --ep 2 --order tp-cp-ep-pp-dp", "EDP = W/(ETP·EP·PP) = 8/(1·2·2) = 2"},
      {"--world 8 --tp 2 --pp 2 --ep 2 --etp 1 --order tp-pp-cp-ep-dp",
       "dense pp group 0 is [0,2], expert pp group 0 is [0,1]"},
      {"--world 4 --order tp-qp-dp", "unknown axis 'qp'"},
  };
  for (const auto& c : cases) {
    auto r = testing::run_command(kBin + " groups " + c.args);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(CliGroups, WorldDefaultsToTheMpiJob) {
  auto r = testing::run_command(kMpirun + "3 " + kBin + " groups --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = parse_json(r.output);  // rank 0 alone prints
  EXPECT_EQ(j["world"].get<int>(), 3);
  EXPECT_EQ(r.output.find('{'), r.output.rfind("{\"world\""));
}

TEST(CliBenchComm, EveryOpReportsCheckedBandwidthBesideMpi) {
  for (const std::string op : {"all_to_all_v", "all_gather", "reduce_scatter", "all_reduce"}) {
    auto r = testing::run_command(kMpirun + "2 " + kBin + " bench comm --op " + op +
                                  " --min-bytes 1K --max-bytes 16K --iters 3 --warmup 1 --json");
    ASSERT_EQ(r.status, 0) << op << "\n" << r.output;
    const auto j = parse_json(r.output);
    EXPECT_EQ(j["wrong"].get<int64_t>(), 0) << op;
    EXPECT_TRUE(j["checked"].get<bool>());
    ASSERT_EQ(j["rows"].size(), 3u) << op;  // 1K, 4K, 16K
    for (const auto& row : j["rows"]) {
      const double alg = row["algbw_gbs"].get<double>(), bus = row["busbw_gbs"].get<double>();
      EXPECT_GT(alg, 0) << op;
      EXPECT_GT(row["mpi_busbw_gbs"].get<double>(), 0) << op;
      // Two ranks: bus factor 2·1/2 = 1 for all_reduce, 1/2 otherwise.
      EXPECT_NEAR(bus, alg * (op == "all_reduce" ? 1.0 : 0.5), 1e-9 * alg) << op;
      EXPECT_NEAR(row["ratio_to_mpi"].get<double>(), bus / row["mpi_busbw_gbs"].get<double>(), 1e-9) << op;
      // Measured volume per call = the ring volume: S/2 for the one peer, or S for all_reduce.
      EXPECT_EQ(row["sent_bytes_per_rank"].get<int64_t>(), row["bytes"].get<int64_t>() / (op == "all_reduce" ? 1 : 2))
          << op;
    }
  }
}

// Sizes are rounded to whole floats per rank: every row is distinct, ascending
// and within [unit, --max-bytes], even where the sweep starts below one
// float per rank; a range under that unit is refused naming it.
TEST(CliBenchComm, SweptSizesAreDistinctAndWithinTheRange) {
  auto r = testing::run_command(kMpirun + "3 " + kBin +
                                " bench comm --op reduce_scatter --min-bytes 1 --max-bytes 100 --factor 2 --iters 1 "
                                "--warmup 0 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<int64_t> sizes;
  const auto swept = parse_json(r.output);
  for (const auto& row : swept["rows"]) sizes.push_back(row["bytes"].get<int64_t>());
  EXPECT_EQ(sizes, (std::vector<int64_t>{12, 24, 60})) << r.output;  // 1..16 -> 12 (a float each of 3); 32 -> 24, 64 -> 60
  r = testing::run_command(kMpirun + "3 " + kBin + " bench comm --op reduce_scatter --min-bytes 1 --max-bytes 10");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("error: bench comm: --max-bytes 10 is under the smallest reduce_scatter message over 3 "
                          "rank(s): 12 bytes (one float per rank)"),
            std::string::npos)
      << r.output;
  // One rank: no bus traffic, and the ratio is still the baseline's time over ours.
  r = testing::run_command(kBin + " bench comm --op all_to_all_v --min-bytes 1K --max-bytes 1K --iters 2 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto one_rank = parse_json(r.output);
  const auto& row = one_rank["rows"].at(0);
  EXPECT_EQ(row["busbw_gbs"].get<double>(), 0.0);
  EXPECT_TRUE(row["ratio_to_mpi"].is_number()) << row.dump();
  EXPECT_NEAR(row["ratio_to_mpi"].get<double>(), row["mpi_time_us"].get<double>() / row["time_us"].get<double>(),
              1e-9 * row["ratio_to_mpi"].get<double>());
  EXPECT_EQ(r.output.find("nan"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace origami
