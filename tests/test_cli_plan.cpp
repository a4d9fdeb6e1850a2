// `origami plan` end to end: the Mixtral config's ledger and ranked layouts
// at world 64, its JSON, the §6 table of --params, the expert placement
// stated, and exit 2 with the rule for impossible input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"

namespace origami {
namespace {

const std::string kPlan = std::string(ORIGAMI_BINARY) + " plan ";
const std::string kMixtral = std::string(ORIGAMI_SOURCE_DIR) + "/configs/mixtral-8x7b.toml";

nlohmann::json parse_json(const std::string& out) { return nlohmann::json::parse(out.substr(out.find('{'))); }

bool has(const std::string& out, const std::string& s) { return out.find(s) != std::string::npos; }

TEST(CliPlan, MixtralAtSixtyFourRanksPrintsLedgerAndRankedLayouts) {
  auto r = testing::run_command(kPlan + kMixtral + " --world 64");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "model: 46.70B params")) << r.output;
  EXPECT_TRUE(has(r.output, "layout: TP 2 x CP 1 x DP 32 x PP 1 | ETP 1 x EP 8 x EDP 8 x PP 1")) << r.output;
  EXPECT_TRUE(has(r.output, "per-rank ledger")) << r.output;
  EXPECT_TRUE(has(r.output, "layers.*.experts")) << r.output;
  EXPECT_TRUE(has(r.output, "activations")) << r.output;
  EXPECT_TRUE(has(r.output, "communication per step")) << r.output;
  EXPECT_TRUE(has(r.output, "\n  ep ")) << r.output;
  EXPECT_TRUE(has(r.output, "layouts of 64 ranks")) << r.output;
  EXPECT_TRUE(has(r.output, "\n   10 ")) << r.output;  // --top defaults to 10 rows
  EXPECT_FALSE(has(r.output, "\n   11 ")) << r.output;
}

TEST(CliPlan, JsonHasEverySection) {
  auto r = testing::run_command(kPlan + "--config " + kMixtral + " --world 64 --recipe bf16 --stage 1 --top 3 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = parse_json(r.output);
  EXPECT_EQ(j["recipe"], "bf16");
  EXPECT_EQ(j["zero_stage"], 1);
  EXPECT_EQ(j["params"]["total"].get<int64_t>(), 46'702'792'704);  // Mixtral-8x7B's published count
  EXPECT_EQ(j["params"]["units"].size(), 66u);  // embedding, 32 × (layer, experts), final
  EXPECT_EQ(j["layout"]["dp"], 32);
  EXPECT_EQ(j["layout"]["edp"], 8);
  EXPECT_GT(j["ledger"]["stages"][0]["total"].get<double>(), 0);
  EXPECT_GT(j["comm"]["stages"][0]["groups"]["ep"].get<double>(), 0);
  EXPECT_GT(j["comm"]["stages"][0]["groups"]["tp"].get<double>(), 0);
  EXPECT_EQ(j["layouts"].size(), 3u);
  EXPECT_GT(j["layouts_valid"].get<int>(), 3);
  EXPECT_LE(j["layouts"][0]["step_s"].get<double>(), j["layouts"][1]["step_s"].get<double>());
}

TEST(CliPlan, ParamsModeGivesTheDocumentedSevenBillionExample) {
  auto r = testing::run_command(kPlan + "--params 7e9 --world 8 --recipe bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "GB = 1e9 bytes")) << r.output;
  // Each stage's row ends with its total (the exact bytes are test_engine_plan's).
  for (const char* total : {" 112.000\n", " 38.500\n", " 26.250\n", " 14.000\n"})
    EXPECT_TRUE(has(r.output, total)) << total << r.output;
  EXPECT_TRUE(has(r.output, "4 + 12/N")) << r.output;
}

// moe.expert_placement: stated (text and JSON), the figures those of the
// contiguous placement (every EP rank holds E/EP experts either way).
TEST(CliPlan, StatesTheExpertPlacementAndKeepsTheFigures) {
  const std::string tiny = std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-moe.toml --world 4 --set parallel.ep=4 ";
  const std::string placed =
      "--set 'moe.expert_placement={ep = 4, layers = {2 = [[7, 1], [0, 6], [2, 3], [4, 5]]}}' ";
  auto r = testing::run_command(kPlan + tiny + placed);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "expert placement: from moe.expert_placement, ep 4")) << r.output;
  EXPECT_TRUE(has(r.output, "\n  layer 2: [[1, 7], [0, 6], [2, 3], [4, 5]]\n")) << r.output;
  const auto j = parse_json(testing::run_command(kPlan + tiny + placed + "--json").output);
  EXPECT_EQ(j["expert_placement"]["source"], "moe.expert_placement");
  EXPECT_EQ(j["expert_placement"]["ep"], 4);
  EXPECT_EQ(j["expert_placement"]["layers"]["2"], nlohmann::json::parse("[[1, 7], [0, 6], [2, 3], [4, 5]]"));
  const auto contiguous = parse_json(testing::run_command(kPlan + tiny + "--json").output);
  EXPECT_FALSE(contiguous.contains("expert_placement"));
  for (const char* key : {"params", "ledger", "comm", "checkpoint"}) EXPECT_EQ(j[key], contiguous[key]) << key;
}

TEST(CliPlan, BadInputExitsTwoWithTheRule) {
  auto world = testing::run_command(kPlan + kMixtral + " --world 63");
  EXPECT_EQ(world.status, 2) << world.output;
  EXPECT_TRUE(has(world.output, "world size 63")) << world.output;
  EXPECT_TRUE(has(world.output, "divisible")) << world.output;
  auto heads = testing::run_command(kPlan + kMixtral + " --world 48 --set parallel.tp=3");
  EXPECT_EQ(heads.status, 2) << heads.output;
  EXPECT_TRUE(has(heads.output, "parallel.tp = 3 must divide model.num_heads = 32")) << heads.output;
  auto no_world = testing::run_command(kPlan + kMixtral);
  EXPECT_EQ(no_world.status, 2) << no_world.output;
  EXPECT_TRUE(has(no_world.output, "--world")) << no_world.output;
}

}  // namespace
}  // namespace origami
