// moe.expert_placement (engine/config_placement.cpp, moe/placement.h,
// engine/units.h): both ways of giving it (a placement file's path, also
// through --set as a bare word, and the table inline), each rule refused
// naming the file, the key and the rule, the canonical text carrying the
// resolved table (not the path) and reading back to the same placement, and
// the unit table giving each EP rank exactly its placed experts of a placed
// layer (contiguous blocks for the other layers and for layouts of another
// EP size).
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_util.h"
#include "config_test_util.h"
#include "engine/config.h"
#include "engine/units.h"
#include "moe/placement.h"

namespace origami {
namespace {

using testing::expect_error;
using testing::kFile;

// tiny-moe's shape: 4 layers, layer 0 dense, 8 experts; EP 4.
const std::string kMoe = R"([model]
num_layers = 4
[moe]
num_experts = 8
first_dense_layers = 1
[parallel]
ep = 4
[data]
path = "data/x"
)";

// The format `origami imbalance --place` writes.
const std::string kPlacementFile = R"(# written by origami imbalance --place
[moe.expert_placement]
ep = 4
[moe.expert_placement.layers]
1 = [[0, 5], [1, 2], [3, 4], [6, 7]]
2 = [[7, 1], [0, 6], [2, 3], [4, 5]]
)";

std::string inline_table(const std::string& layers, const std::string& ep = "4") {
  return kMoe + "[moe.expert_placement]\nep = " + ep + "\n[moe.expert_placement.layers]\n" + layers;
}

TEST(Placement, ExpertPlacementTables) {
  const moe::ExpertPlacement c = moe::ExpertPlacement::contiguous(8, 4);
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.owner(5), 2);
  EXPECT_EQ(c.local_index(5), 1);
  EXPECT_EQ(c.local_experts(3), (std::vector<int64_t>{6, 7}));
  const moe::ExpertPlacement p = moe::ExpertPlacement::from_ranks({{5, 0}, {2, 1}, {4, 3}, {7, 6}});
  EXPECT_FALSE(p.is_contiguous());
  EXPECT_EQ(p.local_experts(0), (std::vector<int64_t>{0, 5})) << "local order is ascending id";
  for (int64_t e = 0; e < 8; ++e) {
    EXPECT_EQ(p.expert_at(p.slot(e)), e);
    EXPECT_EQ(p.local_experts(p.owner(e))[static_cast<size_t>(p.local_index(e))], e);
  }
  // Contiguous blocks written out are the contiguous placement, in any order.
  EXPECT_EQ(moe::ExpertPlacement::from_ranks({{1, 0}, {2, 3}, {5, 4}, {6, 7}}), c);
}

TEST(Placement, FileAndInlineTableGiveTheSamePlacement) {
  testing::ScratchDir dir("placement");
  const std::string path = dir / "placement.toml";
  testing::write_file(path, kPlacementFile);
  const Config by_set = parse_config(kMoe, kFile, {"moe.expert_placement=" + path});  // a bare word: the path
  const Config by_key = parse_config(kMoe, kFile, {"moe.expert_placement=\"" + path + "\""});  // a TOML string
  const Config in_file =
      parse_config(inline_table("1 = [[0, 5], [1, 2], [3, 4], [6, 7]]\n2 = [[7, 1], [0, 6], [2, 3], [4, 5]]\n"), kFile);
  const moe::ExpertPlacements& p = by_set.moe.expert_placement;
  EXPECT_EQ(p.ep, 4);
  ASSERT_EQ(p.layers.size(), 2u);
  EXPECT_EQ(p.layers.at(2).local_experts(0), (std::vector<int64_t>{1, 7}));
  EXPECT_EQ(p.layers.at(2).owner(6), 1);
  EXPECT_EQ(by_key.moe.expert_placement, p);
  EXPECT_EQ(in_file.moe.expert_placement, p);
  EXPECT_EQ(p.find(3, 4), nullptr) << "a layer not listed stays contiguous";
  EXPECT_EQ(p.find(1, 2), nullptr) << "another EP size: contiguous";
  EXPECT_TRUE(p.of_layer(3, 8, 4).is_contiguous());

  // The canonical text carries the table, never the path, and reads back.
  const std::string t = canonical_text(by_set);
  EXPECT_NE(t.find("moe.expert_placement = { ep = 4, layers = { 1 = [[0, 5], [1, 2], [3, 4], [6, 7]], "
                   "2 = [[1, 7], [0, 6], [2, 3], [4, 5]] } }\n"),
            std::string::npos)
      << t;
  EXPECT_EQ(t.find(path), std::string::npos) << t;
  EXPECT_EQ(canonical_text(in_file), t);
  EXPECT_EQ(parse_config(t, "metadata.json (config)").moe.expert_placement, p);
  EXPECT_EQ(canonical_text(parse_config(kMoe, kFile)).find("expert_placement"), std::string::npos)
      << "no placement, no line";
}

TEST(Placement, EveryRuleNamesTheFileTheKeyAndTheRule) {
  testing::ScratchDir dir("placement-rules");
  // ep = parallel.ep, naming where parallel.ep came from.
  expect_error(inline_table("", "2"),
               {"test.toml: moe.expert_placement.ep = 2: must equal parallel.ep = 4", "EP rank"});
  testing::write_file(dir / "placement.toml", kPlacementFile);
  expect_error(kMoe,
               {"placement.toml (moe.expert_placement of --set moe.expert_placement=", "must equal parallel.ep = 2",
                "(--set parallel.ep=2)"},
               {"parallel.ep=2", "moe.expert_placement=" + dir / "placement.toml"});
  expect_error(inline_table("", "3"), {"moe.expert_placement.ep = 3: must divide moe.num_experts = 8"},
               {"parallel.ep=3"});
  expect_error(inline_table("", "0"), {"moe.expert_placement.ep = 0: must be >= 1"});
  expect_error(kMoe + "[moe.expert_placement]\n", {"test.toml: moe.expert_placement.ep: missing"});
  expect_error(kMoe + "[moe.expert_placement]\nep = \"4\"\n", {"moe.expert_placement.ep = \"4\": expected an integer"});
  // Only MoE layers, each once.
  expect_error(inline_table("0 = [[0, 1], [2, 3], [4, 5], [6, 7]]\n"),
               {"test.toml: moe.expert_placement.layers.0: layer 0 is not a MoE layer", "the MoE layers are 1, 2, 3"});
  expect_error(inline_table("4 = [[0, 1], [2, 3], [4, 5], [6, 7]]\n"),
               {"moe.expert_placement.layers.4: layer 4 is not a MoE layer"});
  expect_error(inline_table("1 = [[0, 1], [2, 3], [4, 5], [6, 7]]\n01 = [[0, 1], [2, 3], [4, 5], [6, 7]]\n"),
               {"moe.expert_placement.layers.", "layer 1 is listed twice"});
  expect_error(inline_table("one = [[0, 1], [2, 3], [4, 5], [6, 7]]\n"),
               {"moe.expert_placement.layers.one: keys of the layers table are MoE layer indices"});
  // Exactly ep lists, E/ep experts each, ids in range, each expert once.
  expect_error(inline_table("1 = [[0, 1], [2, 3], [4, 5, 6, 7]]\n"),
               {"moe.expert_placement.layers.1: lists 3 EP rank(s); must list exactly ep = 4"});
  expect_error(inline_table("1 = [[0, 1, 2], [3], [4, 5], [6, 7]]\n"),
               {"moe.expert_placement.layers.1: EP rank 0 lists 3 expert(s), [0, 1, 2]",
                "moe.num_experts / ep = 8 / 4 = 2"});
  expect_error(inline_table("1 = [[0, 1], [2, 3], [4, 5], [6, 8]]\n"),
               {"moe.expert_placement.layers.1: EP rank 3 lists expert 8, outside 0..7"});
  expect_error(inline_table("1 = [[0, 1], [2, -1], [4, 5], [6, 7]]\n"), {"lists expert -1, outside 0..7"});
  expect_error(inline_table("1 = [[0, 1], [2, 3], [4, 5], [6, 1]]\n"),
               {"moe.expert_placement.layers.1: expert 1 is listed by EP ranks 0 and 3",
                "every expert 0..7 appears exactly once per layer"});
  expect_error(inline_table("1 = [[0, 0], [2, 3], [4, 5], [6, 7]]\n"), {"expert 0 is listed twice by EP rank 0"});
  expect_error(inline_table("1 = [[0, 1], [2, 3], [4, \"5\"], [6, 7]]\n"),
               {"moe.expert_placement.layers.1 = ", "expected an array of one expert list per EP rank",
                "a string at EP rank 2, index 1"});
  expect_error(inline_table("1 = [0, 1, 2, 3]\n"), {"got an integer for EP rank 0"});
  // Unknown keys, refused like the rest of the config.
  expect_error(kMoe + "[moe.expert_placement]\nep = 4\nlayer = {}\n",
               {"test.toml: unknown key 'moe.expert_placement.layer'", "ep and layers"});
  expect_error(kMoe, {"unknown key 'moe.expert_placment'", "did you mean 'moe.expert_placement'"},
               {"moe.expert_placment=p.toml"});
  expect_error(kMoe, {"--set moe.expert_placement=3: moe.expert_placement = 3: expected a path"},
               {"moe.expert_placement=3"});
  expect_error("[data]\npath = \"x\"\n[moe.expert_placement]\nep = 1\n",
               {"moe.expert_placement: the model has no MoE layers (moe.num_experts = 0)"});
  // The placement file: missing, not TOML, holding more than the table, or not it.
  const std::string missing = dir / "missing.toml";
  expect_error(kMoe, {"--set moe.expert_placement=", ": moe.expert_placement = \"" + missing + "\": " + missing,
                      "cannot open the expert placement file"},
               {"moe.expert_placement=" + missing});
  expect_error(kMoe, {"--set moe.expert_placement=: moe.expert_placement = \"\": an empty path names no placement file"},
               {"moe.expert_placement="});
  const std::vector<std::pair<std::string, std::string>> files = {
      {"[moe.expert_placement\nep = 4\n", "TOML syntax error"},
      {kPlacementFile + "[training]\nsteps = 3\n", "unknown key 'training': a placement file holds only"},
      {"[moe]\ntop_k = 2\n", "unknown key 'moe.top_k': a placement file holds only"},
      {"# empty\n", "no [moe.expert_placement] table"},
      {"[moe.expert_placement]\nep = 4\n[moe.expert_placement.layers]\n1 = [[0, 1], [2, 3], [4, 5], [6, 9]]\n",
       "moe.expert_placement.layers.1: EP rank 3 lists expert 9"},
  };
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string path = dir / ("bad" + std::to_string(i) + ".toml");
    testing::write_file(path, files[i].first);
    SCOPED_TRACE(files[i].first);
    expect_error(kMoe, {path, files[i].second}, {"moe.expert_placement=" + path});
  }
}

// A placed layer's experts live on their placed owners (ascending, one block
// of the unit's buffer); unlisted layers and layouts of another EP size keep
// the contiguous blocks.
TEST(Placement, TheUnitTableHoldsEachExpertOnItsPlacedOwner) {
  const Config cfg = parse_config(inline_table("2 = [[7, 1], [0, 6], [2, 3], [4, 5]]\n"), kFile);
  const UnitTable table(cfg.model, cfg.moe);
  for (const int64_t ep : {4, 2}) {
    const comm::Layout layout(ep, comm::LayoutOptions{1, 1, 1, ep, 1, "tp-cp-ep-dp-pp", 8});
    for (int r = 0; r < ep; ++r) {
      const comm::RankCoords c = layout.coords(r);
      for (const int64_t l : {1, 2}) {
        const moe::ExpertPlacement want = cfg.moe.expert_placement.of_layer(l, 8, ep);
        EXPECT_EQ(want.is_contiguous(), !(ep == 4 && l == 2));
        const UnitSpec& u = table.units()[table.find(expert_param_name(l, 0, "w1")).first];
        const LocalUnit local = table.local_unit(u, layout, c);
        std::vector<int64_t> held;
        for (size_t i : local.tensors)
          if (u.tensors[i].name.find(".w1.") != std::string::npos) held.push_back(u.tensors[i].expert);
        EXPECT_EQ(held, want.local_experts(c.ep)) << "layer " << l << ", ep " << ep << ", rank " << r;
        EXPECT_EQ(local.tensors.size(), 3 * held.size());
      }
    }
  }
}

}  // namespace
}  // namespace origami
