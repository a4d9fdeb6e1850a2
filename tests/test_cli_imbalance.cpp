// `origami imbalance` end to end on synthetic metrics.jsonl files: the
// statistics against an independent numpy computation
// (tests/reference/imbalance_reference.py), the alerts and exit statuses,
// bad input, the placement advice against brute force, and the HTML page
// rendered by Debian's headless chromium (tools/setup.sh installs it).
//
// Synthetic runs draw each token's top-k experts from per-layer weights
// (a fresh seed each run, printed), so loads are realistic multinomials; a
// layer can be made dead (an expert never chosen), collapsed (one expert in
// nearly every token's top-k) or drifting (weights sharpening over steps).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <regex>
#include <toml++/toml.h>

#include "tests/cli_util.h"

namespace {

using nlohmann::json;
using namespace origami::testing;

const std::string kBinary = ORIGAMI_BINARY;
const std::string kPython = "/usr/bin/python3";
const std::string kReference = std::string(ORIGAMI_SOURCE_DIR) + "/tests/reference/imbalance_reference.py";
// Sums of integers and a few divisions: the two computations agree far
// below this; 1e-9 is the bar.
constexpr double kTol = 1e-9;

struct Synthetic {
  int64_t steps = 60, layers = 4, experts = 16, top_k = 2, tokens = 512, ep = 4;
  double skew = 0.6;                       // weights ∝ exp(skew · N(0,1)) per expert and layer
  int64_t dead_layer = -1, dead_expert = -1;  // an expert never chosen in that layer
  int64_t collapsed_layer = -1;             // expert 0 in (almost) every token's top-k there
  bool rising = false;                      // skew grows from 0 to 4·skew over the steps
  int64_t capacity = 0;                     // > 0: kept = min(routed, capacity) in layer 0
};

uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Writes <dir>/metrics.jsonl (and config.toml); returns the seed used.
uint64_t write_run(const std::string& dir, const Synthetic& s, uint64_t seed = fresh_seed()) {
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<std::vector<double>> base(s.layers, std::vector<double>(s.experts));
  for (auto& layer : base)
    for (double& z : layer) z = normal(rng);
  std::string text;
  for (int64_t step = 1; step <= s.steps; ++step) {
    json rec = {{"step", step},         {"lm_loss", 5.0 / std::sqrt(step)}, {"tokens", s.tokens},
                {"step_time_s", 0.2 + 0.01 * (step % 3)}, {"gflops", 40.0 + step % 5},
                {"comm_bytes", {{"ep", 400000 + 1000 * (step % 7)}}}, {"comm_a2a_s", {{"ep", 0.01 + 0.001 * (step % 4)}}},
                {"aux_loss", 0.01 * step}};
    rec["moe"] = json::array();
    for (int64_t l = 0; l < s.layers; ++l) {
      const double skew = s.rising ? 4 * s.skew * static_cast<double>(step) / static_cast<double>(s.steps) : s.skew;
      std::vector<double> w(s.experts);
      for (int64_t e = 0; e < s.experts; ++e) w[e] = std::exp(skew * base[l][e]);
      if (l == s.dead_layer) w[s.dead_expert] = 0;
      if (l == s.collapsed_layer) w[0] = 1e6 * std::accumulate(w.begin(), w.end(), 0.0);
      std::vector<int64_t> routed(s.experts, 0);
      for (int64_t t = 0; t < s.tokens; ++t) {
        std::vector<double> left = w;  // top-k distinct experts, sampled without replacement
        for (int64_t j = 0; j < s.top_k; ++j) {
          std::discrete_distribution<int64_t> pick(left.begin(), left.end());
          const int64_t e = pick(rng);
          ++routed[e];
          left[e] = 0;
        }
      }
      std::vector<int64_t> kept = routed;
      if (l == 0 && s.capacity > 0)
        for (int64_t& k : kept) k = std::min(k, s.capacity);
      std::vector<int64_t> per_rank(s.ep, 0);
      for (int64_t e = 0; e < s.experts; ++e) per_rank[e / (s.experts / s.ep)] += kept[e];
      rec["moe"].push_back({{"layer", l + 1},
                            {"tokens_per_expert", routed},
                            {"kept_per_expert", kept},
                            {"tokens_per_ep_rank", per_rank},
                            {"dropped_fraction", 0.0},
                            {"max_over_mean", 0.0}});
    }
    text += rec.dump() + "\n";
  }
  write_file(dir + "/metrics.jsonl", text);
  write_file(dir + "/config.toml",
             "[model]\nhidden_size = 64\nffn_hidden_size = 128\nnum_layers = " + std::to_string(s.layers + 1) +
                 "\n[moe]\nfirst_dense_layers = 1\nnum_experts = " + std::to_string(s.experts) +
                 "\ntop_k = " + std::to_string(s.top_k) + "\nffn_hidden_size = 32\nload_balancing = \"aux_loss\"\n" +
                 "[parallel]\nep = " + std::to_string(s.ep) + "\netp = 1\n" +
                 "[data]\npath = \"corpus\"\n");  // as every run's: train needs data (the file is never read)
  return seed;
}

json run_json(const std::string& args, int expected_status) {
  const CommandResult r = run_command(kBinary + " imbalance " + args + " --json");
  EXPECT_EQ(r.status, expected_status) << args << "\n" << r.output;
  try {
    return json::parse(r.output);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << e.what() << "\n" << r.output;
    return json();
  }
}

// Every number of `want` equals `got`'s at the same key to kTol (relative
// above 1); arrays and objects recursively; `got` may have more keys.
void expect_close(const json& want, const json& got, const std::string& where) {
  if (want.is_object()) {
    for (auto it = want.begin(); it != want.end(); ++it) {
      ASSERT_TRUE(got.contains(it.key())) << where << "." << it.key() << " missing";
      expect_close(it.value(), got[it.key()], where + "." + it.key());
    }
  } else if (want.is_array()) {
    ASSERT_TRUE(got.is_array() && got.size() == want.size()) << where << ": " << want.dump() << " vs " << got.dump();
    for (size_t i = 0; i < want.size(); ++i) expect_close(want[i], got[i], where + "[" + std::to_string(i) + "]");
  } else if (want.is_number()) {
    ASSERT_TRUE(got.is_number()) << where;
    const double a = want.get<double>(), b = got.get<double>();
    EXPECT_LE(std::abs(a - b), kTol * std::max(1.0, std::abs(a))) << where << ": numpy " << a << ", origami " << b;
  } else {
    EXPECT_EQ(want, got) << where;
  }
}

std::vector<std::string> alert_kinds(const json& run) {
  std::vector<std::string> kinds;
  for (const json& a : run["alerts"]) kinds.push_back(a["kind"]);
  return kinds;
}

TEST(Imbalance, StatisticsEqualAnIndependentNumpyComputation) {
  ScratchDir dir("imbalance-stats");
  Synthetic s;
  s.capacity = 70;  // layer 0 drops
  const uint64_t seed = write_run(dir / "run", s);
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Alerts are the next test's subject. At skew 0.6 a draw can put one
  // expert above the default 50% collapse share (seed 15237264149467688256:
  // 56.7% of layer 4's tokens, exit 1); top-2 over 16 experts at this skew
  // stays far below 90%.
  const std::string args = " --steps 5:50 --ep 8 --window 7 --collapse-share 0.9";
  const json got = run_json(dir / "run" + args, 0);
  const CommandResult ref =
      run_command(kPython + " " + kReference + " " + (dir / "run/metrics.jsonl") + " --steps 5:50 --ep 8 --window 7");
  ASSERT_EQ(ref.status, 0) << ref.output;
  const json want = json::parse(ref.output);
  ASSERT_EQ(got["runs"].size(), 1u);
  const json& run = got["runs"][0];
  expect_close(want, run, "run");
  EXPECT_EQ(run["steps"]["count"], 46);
  EXPECT_GT(run["layers"][0]["dropped_fraction"].get<double>(), 0.0);
  EXPECT_TRUE(run["cost"].contains("compute_s") && run["cost"].contains("a2a_s")) << run["cost"].dump();

  // The terminal report prints the same numbers, rounded.
  const CommandResult text = run_command(kBinary + " imbalance " + (dir / "run") + args);
  ASSERT_EQ(text.status, 0) << text.output;
  char max_vio[32];
  std::snprintf(max_vio, sizeof max_vio, "%.3f", want["layers"][2]["max_vio"].get<double>());
  EXPECT_NE(text.output.find(max_vio), std::string::npos) << max_vio << "\n" << text.output;
  EXPECT_NE(text.output.find("healthy: no alerts"), std::string::npos) << text.output;
}

TEST(Imbalance, AlertsFireForDeadCollapsedAndRisingLayersAndNotForABalancedRun) {
  ScratchDir dir("imbalance-alerts");
  Synthetic balanced;
  balanced.skew = 0.2;
  Synthetic dead = balanced;
  dead.dead_layer = 2, dead.dead_expert = 5;
  Synthetic collapsed = balanced;
  collapsed.collapsed_layer = 1;
  Synthetic rising = balanced;
  rising.rising = true;
  struct Case {
    std::string name;
    Synthetic s;
    std::vector<std::string> kinds;
  };
  for (const Case& c : {Case{"balanced", balanced, {}}, Case{"dead", dead, {"dead_experts"}},
                        Case{"collapsed", collapsed, {"collapse"}}, Case{"rising", rising, {"rising_imbalance"}}}) {
    const uint64_t seed = write_run(dir / c.name, c.s);
    SCOPED_TRACE(c.name + " seed " + std::to_string(seed));
    const json got = run_json(dir / c.name, c.kinds.empty() ? 0 : 1);
    ASSERT_TRUE(got.contains("runs"));
    EXPECT_EQ(alert_kinds(got["runs"][0]), c.kinds) << got["runs"][0]["alerts"].dump(2);
    EXPECT_EQ(got["runs"][0]["healthy"], c.kinds.empty());
    if (c.name == "dead") {
      EXPECT_EQ(got["runs"][0]["alerts"][0]["layer"], 3);
      EXPECT_EQ(got["runs"][0]["layers"][2]["dead_experts"], json::array({5}));
    }
    if (c.name == "collapsed") {
      EXPECT_EQ(got["runs"][0]["alerts"][0]["layer"], 2);
    }
  }
}

TEST(Imbalance, BadInputExitsTwoNamingTheFileAndLine) {
  ScratchDir dir("imbalance-bad");
  Synthetic s;
  s.steps = 6;
  write_run(dir / "good", s);
  const std::string good = read_file(dir / "good/metrics.jsonl");
  std::vector<std::string> lines;
  for (size_t at = 0, nl; (nl = good.find('\n', at)) != std::string::npos; at = nl + 1)
    lines.push_back(good.substr(at, nl - at));

  auto expect_error = [&](const std::string& name, const std::string& text, const std::string& needle) {
    std::filesystem::create_directories(dir / name);
    write_file(dir / name + "/metrics.jsonl", text);
    const CommandResult r = run_command(kBinary + " imbalance " + (dir / name));
    EXPECT_EQ(r.status, 2) << name << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << name << ": wanted '" << needle << "' in\n" << r.output;
  };
  const std::string file = "/metrics.jsonl";
  expect_error("malformed", lines[0] + "\n" + lines[1] + "\n" + lines[2].substr(0, 40) + "\n" + lines[3] + "\n",
               "malformed" + file + ":3: malformed JSON");
  expect_error("dense", "{\"step\":1,\"lm_loss\":3.0}\n{\"step\":2,\"lm_loss\":2.9}\n", "dense" + file + ": no MoE records");
  expect_error("backwards", lines[0] + "\n" + lines[2] + "\n" + lines[1] + "\n", "backwards" + file + ":3: step 2 after step 3");
  expect_error("nostep", lines[0] + "\n{\"lm_loss\":1}\n", "nostep" + file + ":2: a record without \"step\"");
  expect_error("trailing", lines[0] + " x\n", "trailing" + file + ":1: ");
  auto replaced = [](std::string text, const std::string& from, const std::string& to) {
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? text : text.replace(at, from.size(), to);
  };
  expect_error("negstep", replaced(lines[0], "\"step\":1", "\"step\":-3") + "\n",
               "negstep" + file + ":1: \"step\" is -3 (rule: >= 0)");
  expect_error("neglayer", replaced(lines[0], "\"layer\":1", "\"layer\":-2") + "\n",
               "neglayer" + file + ":1: a moe entry's \"layer\" is -2 (rule: >= 0)");
  // 2^62 tokens twice: a sum past int64 if it were summed unchecked.
  expect_error("overflow",
               "{\"step\":1,\"moe\":[{\"layer\":1,\"tokens_per_expert\":[4611686018427387904,4611686018427387904]}]}\n",
               "overflow" + file + ":1: moe layer 1: tokens_per_expert sums past 2^40 at expert 0");
  expect_error("missing", "", "missing" + file + ": no step records");
  // Valid JSON with a value of the wrong type names the field and its rule.
  expect_error("stepstring", replaced(lines[0], "\"step\":1", "\"step\":\"1\"") + "\n",
               "stepstring" + file + ":1: \"step\" must be an integer, as origami train writes it");
  expect_error("stepfloat", replaced(lines[0], "\"step\":1", "\"step\":1.5") + "\n",
               "stepfloat" + file + ":1: \"step\" must be an integer");
  expect_error("countfloat", replaced(lines[0], "\"tokens_per_expert\":[", "\"tokens_per_expert\":[1e30,") + "\n",
               "countfloat" + file + ":1: a moe entry's \"tokens_per_expert\" must be an array of integers");
  expect_error("moeobject", "{\"step\":1,\"moe\":{\"layer\":1}}\n",
               "moeobject" + file + ":1: \"moe\" must be an array of objects");
  expect_error("notobject", "[1, 2]\n", "notobject" + file + ":1: the record must be a JSON object");
  {  // A resume under another EP size: each part reads alone, and the error says how.
    json changed = json::parse(lines[2]);
    for (json& entry : changed["moe"]) {
      const auto q = entry["tokens_per_ep_rank"].get<std::vector<int64_t>>();
      std::vector<int64_t> pairs(q.size() / 2, 0);
      for (size_t p = 0; p < q.size(); ++p) pairs[p / 2] += q[p];
      entry["tokens_per_ep_rank"] = pairs;
    }
    expect_error("ep-change", lines[0] + "\n" + lines[1] + "\n" + changed.dump() + "\n",
                 "ep-change" + file + ":3: moe entry 0 is layer 1 with 16 experts over 2 EP ranks; earlier records "
                 "have layer 1 with 16 over 4 (the run changed its EP size at step 3, a resume under another layout?: "
                 "read each part alone, --steps 1:2 and --steps 3:)");
  }
  const CommandResult steps = run_command(kBinary + " imbalance " + (dir / "good") + " --steps 9:x");
  EXPECT_EQ(steps.status, 2) << steps.output;
  EXPECT_NE(steps.output.find("--steps 9:x"), std::string::npos) << steps.output;

  // A last line cut short (a run still writing) is skipped, not an error.
  std::filesystem::create_directories(dir / "live");
  write_file(dir / "live/metrics.jsonl", lines[0] + "\n" + lines[1] + "\n" + lines[2].substr(0, 100));
  // Two random steps may well raise an alert (exit 1, a verdict on the data:
  // 60% on one expert was seen); what matters is that it is no input error.
  const CommandResult r = run_command(kBinary + " imbalance " + (dir / "live") + " --json");
  EXPECT_TRUE(r.status == 0 || r.status == 1) << r.output;
  const json live = json::parse(r.output, nullptr, false);
  ASSERT_FALSE(live.is_discarded()) << r.output;
  EXPECT_EQ(live["runs"][0]["steps"]["count"], 2);
}

// The best placement of 8 experts on 4 ranks (2 each) by brute force.
double best_max_over_mean(const std::vector<int64_t>& load) {
  double best = 1e300, total = std::accumulate(load.begin(), load.end(), 0.0);
  std::vector<int> perm(load.size());
  std::iota(perm.begin(), perm.end(), 0);
  do {
    double mx = 0;
    for (size_t p = 0; p < perm.size(); p += 2) mx = std::max(mx, static_cast<double>(load[perm[p]] + load[perm[p + 1]]));
    best = std::min(best, mx / (total / 4));
  } while (std::next_permutation(perm.begin(), perm.end()));
  return best;
}

// Max over mean of the ranks' kept tokens under `placement` (one expert list per rank).
double placed_max_over_mean(const std::vector<int64_t>& kept, const json& placement) {
  double mx = 0, total = 0;
  for (const json& r : placement) {
    double sum = 0;
    for (int64_t e : r) sum += static_cast<double>(kept[e]);
    mx = std::max(mx, sum), total += sum;
  }
  return mx / (total / static_cast<double>(placement.size()));
}

TEST(Imbalance, PlacementIsNearTheBestPackingAndWritesTheConfigEntry) {
  ScratchDir dir("imbalance-place");
  Synthetic s;
  s.experts = 8, s.skew = 1.2, s.steps = 20;
  const uint64_t seed = write_run(dir / "run", s);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const json got = run_json(dir / "run" + " --place --ep 4 --out " + (dir / "placement.toml"), 1);  // skewed: alerts
  ASSERT_TRUE(got.contains("placement")) << got.dump();
  EXPECT_EQ(got["placement"]["run"], dir / "run/metrics.jsonl");  // whose loads it placed
  const toml::table t = toml::parse_file(dir / "placement.toml");
  EXPECT_EQ(t["moe"]["expert_placement"]["ep"].value_or(0), 4);
  for (const json& lp : got["placement"]["layers"]) {
    const int64_t layer = lp["layer"];
    std::vector<int64_t> kept;
    for (const json& L : got["runs"][0]["layers"])
      if (L["layer"] == layer) kept = L["kept_per_expert"].get<std::vector<int64_t>>();
    // Each rank 2 experts, each expert once, the TOML equal to the JSON.
    std::vector<int64_t> seen;
    const toml::array* ranks = t["moe"]["expert_placement"]["layers"][std::to_string(layer)].as_array();
    ASSERT_TRUE(ranks && ranks->size() == 4) << "layer " << layer;
    for (size_t p = 0; p < 4; ++p) {
      const std::vector<int64_t> json_rank = lp["after"][p];
      ASSERT_EQ(json_rank.size(), 2u);
      for (size_t i = 0; i < 2; ++i) EXPECT_EQ((*ranks)[p].as_array()->at(i).value_or(-1), json_rank[i]);
      seen.insert(seen.end(), json_rank.begin(), json_rank.end());
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, std::vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7}));
    // Predicted figures recomputed from the window's kept loads.
    auto mom = [&](const json& placement) { return placed_max_over_mean(kept, placement); };
    EXPECT_NEAR(lp["after_max_over_mean"].get<double>(), mom(lp["after"]), 1e-12);
    EXPECT_NEAR(lp["before_max_over_mean"].get<double>(), mom(json::array({{0, 1}, {2, 3}, {4, 5}, {6, 7}})), 1e-12);
    const double best = best_max_over_mean(kept);
    EXPECT_GE(lp["after_max_over_mean"].get<double>(), best - 1e-12);
    EXPECT_LE(lp["after_max_over_mean"].get<double>(), best * 1.02) << "layer " << layer << " best " << best;
    EXPECT_LE(lp["after_max_over_mean"].get<double>(), lp["before_max_over_mean"].get<double>() + 1e-12);
  }
  const CommandResult bad = run_command(kBinary + " imbalance " + (dir / "run") + " --place --ep 3");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("--ep 3 does not divide layer 1's 8 experts"), std::string::npos) << bad.output;
}

// The run's own placement (its config.toml's moe.expert_placement) is the
// "before" of the advice, read through the config's loader: an entry edited
// into something the engine would refuse is refused here too, naming the
// file and key, never read out of bounds.
TEST(Imbalance, TheRunsPlacementIsTheBeforeAndObeysTheConfigsRules) {
  ScratchDir dir("imbalance-run-placement");
  Synthetic s;
  s.experts = 8, s.skew = 1.2, s.steps = 12;
  const uint64_t seed = write_run(dir / "run", s);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::string config = read_file(dir / "run/config.toml");
  auto with_placement = [&](const std::string& layers) {
    write_file(dir / "run/config.toml", config + "[moe.expert_placement]\nep = 4\n[moe.expert_placement.layers]\n" + layers);
  };
  with_placement("1 = [[7, 0], [1, 2], [3, 4], [5, 6]]\n");
  const json got = run_json(dir / "run" + " --place --ep 4", 1);  // skewed: alerts
  bool checked = false;
  for (const json& lp : got["placement"]["layers"]) {
    const bool run_placement = lp["layer"] == 1;
    EXPECT_EQ(lp["before_from_run"].get<bool>(), run_placement) << lp.dump();
    if (!run_placement) continue;
    EXPECT_EQ(lp["before"], json::parse("[[0, 7], [1, 2], [3, 4], [5, 6]]")) << lp.dump();
    std::vector<int64_t> kept;
    for (const json& L : got["runs"][0]["layers"])
      if (L["layer"] == 1) kept = L["kept_per_expert"].get<std::vector<int64_t>>();
    ASSERT_EQ(kept.size(), 8u);
    EXPECT_NEAR(lp["before_max_over_mean"].get<double>(),
                placed_max_over_mean(kept, json::parse("[[0, 7], [1, 2], [3, 4], [5, 6]]")), 1e-12);
    checked = true;
  }
  EXPECT_TRUE(checked) << got.dump();

  const std::string file = dir / "run/config.toml";
  const std::pair<std::string, std::string> bad[] = {
      {"1 = [[0, 1], [2, 3], [4, 5], [6, 100000000]]\n", "layers.1: EP rank 3 lists expert 100000000, outside 0..7"},
      {"1 = [[-5, 1], [2, 3], [4, 5], [6, 7]]\n", "lists expert -5, outside 0..7"},
      {"abc = [[0]]\n", "layers.abc: keys of the layers table are MoE layer indices"},
      {"1 = [[0]]\n", "layers.1: lists 1 EP rank(s); must list exactly ep = 4"},
      {"1 = [[\"a\", 1], [2, 3], [4, 5], [6, 7]]\n", "got a string at EP rank 0, index 0"},
  };
  for (const auto& [layers, needle] : bad) {
    with_placement(layers);
    const CommandResult r = run_command(kBinary + " imbalance " + (dir / "run") + " --place --ep 4");
    EXPECT_EQ(r.status, 2) << layers << r.output;
    EXPECT_NE(r.output.find(file + ": moe.expert_placement."), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << "wanted '" << needle << "' in\n" << r.output;
  }
  // A config of another shape than the records' (edited or copied since):
  // refused, naming the key and the records, not used for the estimates.
  for (const auto& [from, to, needle] :
       {std::tuple<std::string, std::string, std::string>{"first_dense_layers = 1", "first_dense_layers = 2",
                                                          "records MoE layer 1, which is not a MoE layer"}}) {
    std::string edited = config;
    edited.replace(edited.find(from), from.size(), to);
    write_file(file, edited);
    const CommandResult r = run_command(kBinary + " imbalance " + (dir / "run"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find(file + ": " + (needle.starts_with("records") ? (dir / "run/metrics.jsonl") + " " : "") +
                            needle),
              std::string::npos)
        << needle << "\n" << r.output;
    EXPECT_NE(r.output.find("rule: the config.toml beside metrics.jsonl is the one of the run"), std::string::npos)
        << r.output;
  }
  // A run resumed under another EP size rewrote its config: its steps are
  // read at the records' EP, the config's placement set aside, and a note
  // says so (a resume keeps the model's shape, not its layout).
  {
    std::string ep2 = config;
    ep2.replace(ep2.find("ep = 4"), 6, "ep = 2");
    write_file(file,
               ep2 + "[moe.expert_placement]\nep = 2\n[moe.expert_placement.layers]\n1 = [[0, 1, 2, 7], [3, 4, 5, 6]]\n");
    const json resumed = run_json(dir / "run --place --ep 4", 1);  // skewed: alerts
    ASSERT_TRUE(resumed.contains("runs")) << resumed.dump();
    const json& run = resumed["runs"][0];
    EXPECT_EQ(run["config"]["ep"], 4);
    EXPECT_EQ(run["config"]["placement"], false);
    ASSERT_EQ(run["notes"].size(), 1u) << run.dump();
    EXPECT_NE(run["notes"][0].get<std::string>().find("config.toml has parallel.ep = 2 (a resume under another layout)"),
              std::string::npos);
    for (const json& lp : resumed["placement"]["layers"]) EXPECT_FALSE(lp["before_from_run"].get<bool>());
  }
  // A valid placement of another run's 16 experts against these 8: the
  // config's expert count already differs from the records'.
  std::string sixteen = config;
  sixteen.replace(sixteen.find("num_experts = 8"), 15, "num_experts = 16");
  write_file(file, sixteen + "[moe.expert_placement]\nep = 4\n[moe.expert_placement.layers]\n" +
                       "1 = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]\n");
  const CommandResult r = run_command(kBinary + " imbalance " + (dir / "run") + " --place --ep 4");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(file + ": moe.num_experts = 16, but " + (dir / "run/metrics.jsonl") +
                          " records 8 experts in layer 1"),
            std::string::npos)
      << r.output;
}

// An output that is an input would replace the run's records or config
// (the next report then reads HTML, or a placement table as the config);
// two outputs on one file would keep the last. Both refused before anything
// is written. Without --out the placement is stdout's only content, so
// `> placement.toml` gives a file the config loader takes.
TEST(Imbalance, OutputsNeverReplaceInputsAndThePlacementAloneGoesToStdout) {
  ScratchDir dir("imbalance-outputs");
  Synthetic s;
  s.experts = 8, s.skew = 1.2, s.steps = 12;
  const uint64_t seed = write_run(dir / "run", s);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::string metrics = read_file(dir / "run/metrics.jsonl"), config = read_file(dir / "run/config.toml");
  std::filesystem::create_directory_symlink(dir / "run", dir / "link");
  const std::pair<std::string, std::string> refused[] = {
      {" --html " + (dir / "run/metrics.jsonl"), "--html " + (dir / "run/metrics.jsonl") + ": is the metrics of RUN"},
      {" --html " + (dir / "link/../run/metrics.jsonl"), ": is the metrics of RUN"},
      {" --place --ep 4 --out " + (dir / "link/config.toml"), ": is the config beside RUN"},
      {" --place --ep 4 --out " + (dir / "p.toml") + " --html " + (dir / "p.toml"), ": the same file"},
  };
  for (const auto& [args, needle] : refused) {
    const CommandResult r = run_command(kBinary + " imbalance " + (dir / "run") + args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
    EXPECT_NE(r.output.find("(rule: "), std::string::npos) << r.output;
  }
  EXPECT_EQ(read_file(dir / "run/metrics.jsonl"), metrics);
  EXPECT_EQ(read_file(dir / "run/config.toml"), config);
  EXPECT_FALSE(std::filesystem::exists(dir / "p.toml"));

  const CommandResult r =
      run_command("(" + kBinary + " imbalance " + (dir / "run") + " --place --ep 4 > " + (dir / "placement.toml") + ")");
  EXPECT_EQ(r.status, 1) << r.output;  // skewed: alerts
  EXPECT_NE(r.output.find("EP max/mean"), std::string::npos) << "the report, on stderr:\n" << r.output;
  const std::string placement = read_file(dir / "placement.toml");
  EXPECT_EQ(placement.find("EP max/mean"), std::string::npos) << placement;
  const toml::table t = toml::parse(placement);
  EXPECT_EQ(t["moe"]["expert_placement"]["ep"].value_or(0), 4) << placement;
}

// Records of one EP rank under a config.toml of two (a run resumed at
// another EP size; the selection before it): read at the records' EP, with
// the note, as for any other change of EP size.
TEST(Imbalance, RecordsOfOneEpRankUnderAConfigOfTwoGetTheResumeNote) {
  ScratchDir dir("imbalance-ep1");
  Synthetic s;
  s.experts = 8, s.ep = 1, s.steps = 12;
  const uint64_t seed = write_run(dir / "run", s);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::string config = read_file(dir / "run/config.toml");
  config.replace(config.find("ep = 1"), 6, "ep = 2");
  write_file(dir / "run/config.toml", config);
  const CommandResult r = run_command(kBinary + " imbalance " + (dir / "run") + " --json");
  EXPECT_LE(r.status, 1) << r.output;  // alerts or none: the draw decides
  const json got = json::parse(r.output, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(got.contains("runs")) << r.output;
  const json& run = got["runs"][0];
  EXPECT_EQ(run["config"]["ep"], 1);
  ASSERT_EQ(run["notes"].size(), 1u) << run.dump();
  EXPECT_NE(run["notes"][0].get<std::string>().find("config.toml has parallel.ep = 2 (a resume under another layout)"),
            std::string::npos)
      << run.dump();
}

// The values of data-key="..." data-value="..." cells of one element's subtree.
std::map<std::string, std::string> cells(const std::string& html) {
  std::map<std::string, std::string> out;
  static const std::regex cell("data-key=\"([^\"]+)\" data-value=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), cell); it != std::sregex_iterator(); ++it)
    out.emplace((*it)[1], (*it)[2]);
  return out;
}

// The rendered HTML of the element with id="id" (up to its matching </div>; the layer boxes do not nest).
std::string element(const std::string& dom, const std::string& id) {
  const size_t at = dom.find("id=\"" + id + "\"");
  if (at == std::string::npos) return "";
  const size_t next = dom.find("class=\"layer\"", at + 1);
  return dom.substr(at, next == std::string::npos ? std::string::npos : next - at);
}

TEST(Imbalance, HtmlPageRendersInHeadlessChromiumWithTheJsonNumbers) {
  const std::string chromium = "/usr/bin/chromium";
  ASSERT_TRUE(std::filesystem::exists(chromium)) << chromium << " missing (tools/setup.sh installs Debian's chromium)";
  ScratchDir dir("imbalance-html");
  Synthetic a, b;
  a.skew = 0.3, b.skew = 1.0, b.dead_layer = 1, b.dead_expert = 3;
  write_run(dir / "aux_loss", a);
  write_run(dir / "none", b);
  const std::string runs = (dir / "aux_loss") + " " + (dir / "none");
  const json got = run_json(runs + " --place --ep 4", 1);
  const CommandResult page = run_command(kBinary + " imbalance " + runs + " --place --ep 4 --html " + (dir / "r.html"));
  ASSERT_EQ(page.status, 1) << page.output;
  const std::string html = read_file(dir / "r.html");
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));  // the SVG namespace, nothing fetched
  EXPECT_EQ(html.find("https://"), std::string::npos);

  const std::string flags = " --headless --no-sandbox --disable-gpu --no-first-run --disable-extensions "
                            "--user-data-dir=" + (dir / "profile") + " --enable-logging=stderr --v=0 ";
  const CommandResult dom = run_command(chromium + flags + "--dump-dom file://" + (dir / "r.html") + " 2> " + (dir / "console.txt"));
  ASSERT_EQ(dom.status, 0) << dom.output;
  const std::string console = read_file(dir / "console.txt");
  for (const char* bad : {"Uncaught", "CONSOLE", "SyntaxError", "TypeError"})
    EXPECT_EQ(console.find(bad), std::string::npos) << "console shows " << bad << ":\n" << console;
  EXPECT_NE(dom.output.find("data-rendered=\"ok\""), std::string::npos) << dom.output.substr(0, 2000);
  EXPECT_EQ(dom.output.find("data-error"), std::string::npos);

  for (size_t r = 0; r < 2; ++r) {
    const json& run = got["runs"][r];
    for (const json& L : run["layers"]) {
      const std::string id = std::to_string(r) + "-" + std::to_string(L["layer"].get<int64_t>());
      SCOPED_TRACE("layer box " + id);
      const std::string box = element(dom.output, "layer-" + id);
      ASSERT_FALSE(box.empty());
      EXPECT_NE(box.find("id=\"heat-" + id + "\""), std::string::npos);
      EXPECT_NE(box.find("data-experts=\"" + std::to_string(L["experts"].get<int64_t>()) + "\""), std::string::npos);
      const auto c = cells(box);
      for (const char* key : {"utilization_min", "utilization_max", "max_vio", "cv", "max_vio_batch", "dropped_fraction"}) {
        ASSERT_TRUE(c.count(key)) << key;
        EXPECT_EQ(std::stod(c.at(key)), L[key].get<double>()) << key;  // JS prints the shortest round-trip form
      }
      EXPECT_EQ(std::stod(c.at("ep.max_over_mean")), L["ep"]["max_over_mean"].get<double>());
      EXPECT_EQ(json::parse(c.at("dead_experts")), L["dead_experts"]);
      size_t bars = 0;
      for (size_t at = 0; (at = box.find("class=\"ep-bar\"", at)) != std::string::npos; ++at) ++bars;
      EXPECT_EQ(bars, 4u);
    }
  }
  EXPECT_NE(dom.output.find("id=\"comparison-table\""), std::string::npos);
  EXPECT_NE(dom.output.find("id=\"placement-table\""), std::string::npos);
  EXPECT_NE(dom.output.find("data-kind=\"dead_experts\""), std::string::npos);

  // One screenshot, kept beside the test binary (never in the working directory, which may be the source tree).
  const std::string shot =
      (std::filesystem::canonical("/proc/self/exe").parent_path() / "imbalance-report.png").string();
  const CommandResult png = run_command(chromium + flags + "--hide-scrollbars --window-size=1400,1800 --screenshot=" + shot +
                                        " file://" + (dir / "r.html") + " 2>/dev/null");
  ASSERT_EQ(png.status, 0) << png.output;
  EXPECT_GT(std::filesystem::file_size(shot), 10000u);
  std::printf("screenshot: %s\n", shot.c_str());
}

}  // namespace
