// Config against the run: validate_for_world's layout and batch rules on a
// world size, the pipeline keys and their rules, and every shipped config
// under configs/ loading and validating for the layout it names.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config_test_util.h"
#include "engine/config.h"
#include "kernels/check.h"

namespace origami {
namespace {

using testing::expect_error;
using testing::kFile;
using testing::kMinimal;

TEST(Config, ValidateForWorld) {
  Config c = parse_config(kMinimal, kFile);
  EXPECT_NO_THROW(validate_for_world(c, 1));
  // The batch rule needs DP: 8 samples cannot split into micro-batches of 8 over 4 ranks.
  try {
    validate_for_world(c, 4);
    FAIL() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("test.toml: on 4 rank(s): training.global_batch = 8 must be a multiple of "
                                         "training.micro_batch · DP = 8 · 4 = 32"),
              std::string::npos)
        << e.what();
  }
  // A rule of several keys names the file and every override it was read with.
  try {
    validate_for_world(parse_config(kMinimal, kFile, {"parallel.tp=2", "optimizer.lr=1e-3"}), 1);
    FAIL() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("test.toml with --set optimizer.lr=1e-3, --set parallel.tp=2: on 1 rank(s): "),
              std::string::npos)
        << e.what();
  }
  // Layout rules (comm::Layout) come before what the engine supports today.
  c.parallel.tp = 2;
  try {
    validate_for_world(c, 3);
    FAIL() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("test.toml: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("divisible"), std::string::npos) << e.what();
  }
  c.parallel.tp = 1;
  c.training.micro_batch = 2;
  EXPECT_NO_THROW(validate_for_world(c, 4));  // data parallelism: 8 samples = 2 per rank · DP 4
  // Expert tensor parallelism splits each expert's F: it must divide.
  Config moe = load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-moe.toml");
  moe.parallel.etp = 3;
  moe.training.global_batch = 6;
  try {
    validate_for_world(moe, 3);
    FAIL() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tiny-moe.toml: on 3 rank(s): parallel.etp = 3 must divide the expert ffn size 128"),
              std::string::npos)
        << e.what();
  }
  moe.parallel.etp = 2;
  moe.parallel.ep = 2;
  moe.training.global_batch = 16;
  EXPECT_NO_THROW(validate_for_world(moe, 4));
  // Tensor / context parallel rules, each naming its key and the rule.
  auto expect_error = [&](Config cfg, int world, const std::string& text) {
    try {
      validate_for_world(cfg, world);
      ADD_FAILURE() << "no UserError for: " << text;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  moe.parallel = ParallelConfig{};
  moe.exp.dir = "";
  Config tp3 = moe;
  tp3.parallel.tp = 3;
  tp3.training.global_batch = 6;
  expect_error(tp3, 3, "tiny-moe.toml: on 3 rank(s): parallel.tp = 3 must divide model.num_heads = 4 and model.num_kv_heads = 2");
  Config cp3 = moe;
  cp3.parallel.cp = 3;
  cp3.training.global_batch = 6;
  expect_error(cp3, 3, "tiny-moe.toml: on 3 rank(s): training.seq_len = 128 must be a multiple of 2·parallel.cp = 6");
  Config seq = moe;
  seq.parallel.tp = 2;
  seq.moe.router.load_balancing = moe::LoadBalancing::seq_aux_loss;
  expect_error(seq, 2, "moe.load_balancing = \"seq_aux_loss\" needs whole sequences per rank");
  // Pipeline parallelism: 2 stages x TP 2 on 4 ranks (DP 1), even or explicit split.
  Config pp = moe;
  pp.parallel.pp = 2;
  pp.parallel.tp = 2;
  EXPECT_NO_THROW(validate_for_world(pp, 4));
  pp.parallel.pp_layers = {1, 3};
  EXPECT_NO_THROW(validate_for_world(pp, 4));
  // The stage rules hold for a Config edited after loading too.
  pp.parallel.pp_layers = {1, 2};
  expect_error(pp, 4, "tiny-moe.toml: on 4 rank(s): parallel.pp_layers = [1, 2] sums to 3: must sum to model.num_layers = 4");
  Config pp8 = moe;
  pp8.parallel.pp = 8;
  expect_error(pp8, 8, "tiny-moe.toml: on 8 rank(s): model.num_layers = 4 must be >= parallel.pp = 8");
  Config folded = moe;
  folded.parallel.tp = 2;
  folded.parallel.cp = 2;
  folded.parallel.ep = 4;
  EXPECT_NO_THROW(validate_for_world(folded, 8));
}

TEST(Config, PipelineKeysParse) {
  const std::string text = std::string(kMinimal) + "[model]\nnum_layers = 6\n[parallel]\npp = 3\n";
  const Config even = parse_config(text, kFile);
  EXPECT_TRUE(even.parallel.pp_layers.empty());
  EXPECT_TRUE(even.parallel.reshard_after_forward);
  EXPECT_EQ(parse_config(text + "pp_layers = [1, 0, 5]\n", kFile).parallel.pp_layers,
            (std::vector<int64_t>{1, 0, 5}));  // an empty stage is allowed when listed
  EXPECT_TRUE(parse_config(text + "pp_layers = []\n", kFile).parallel.pp_layers.empty());  // [] = even split
  EXPECT_FALSE(parse_config(text + "reshard_after_forward = false\n", kFile).parallel.reshard_after_forward);
  EXPECT_TRUE(parse_config(text + "reshard_after_forward = true\n", kFile).parallel.reshard_after_forward);
  // --set takes the TOML array form.
  const Config set = parse_config(text, kFile, {"parallel.pp_layers=[2,3,1]", "parallel.reshard_after_forward=false"});
  EXPECT_EQ(set.parallel.pp_layers, (std::vector<int64_t>{2, 3, 1}));
  EXPECT_FALSE(set.parallel.reshard_after_forward);
}

TEST(Config, PipelineLayersRules) {
  const std::string text = std::string(kMinimal) + "[model]\nnum_layers = 6\n[parallel]\npp = 3\n";
  expect_error(text + "pp_layers = [3, 3]\n",
               {kFile, "parallel.pp_layers = [3, 3] lists 2 stages", "one layer count per pipeline stage",
                "parallel.pp = 3"});
  expect_error(text + "pp_layers = [2, 2, 1]\n",
               {kFile, "parallel.pp_layers = [2, 2, 1] sums to 5", "must sum to model.num_layers = 6"});
  expect_error(text + "pp_layers = [4, -1, 3]\n",
               {kFile, "parallel.pp_layers = [4, -1, 3]", "layer counts must be in 0..model.num_layers = "});
  expect_error(text + "pp_layers = [2, 2.5, 1.5]\n",
               {kFile, "parallel.pp_layers", "expected an array of integers, got a float at index 1"});
  expect_error(text + "pp_layers = [\"2\", 2, 2]\n",
               {kFile, "parallel.pp_layers", "expected an array of integers, got a string at index 0"});
  expect_error(text + "pp_layers = 6\n", {kFile, "parallel.pp_layers = 6", "expected an array of integers",
                                          "got an integer"});
  expect_error(text + "reshard_after_forward = 1\n",
               {kFile, "parallel.reshard_after_forward", "expected a boolean", "got an integer"});
  // Without pp_layers the even split needs a layer per stage.
  expect_error(std::string(kMinimal) + "[model]\nnum_layers = 2\n[parallel]\npp = 4\n",
               {kFile, "model.num_layers = 2 must be >= parallel.pp = 4", "parallel.pp_layers"});
  // An override is named as the source; one not parsing as an array is a string.
  expect_error(text, {"--set parallel.pp_layers=[1,2]", "lists 2 stages"}, {"parallel.pp_layers=[1,2]"});
  expect_error(text, {"--set parallel.pp_layers=1,2,3", "expected an array of integers, got a string"},
               {"parallel.pp_layers=1,2,3"});
}

// parallel.cp_comm: "all_gather" (the default) or "ring"; anything else
// names the key and both values; the canonical text records it.
TEST(Config, CpCommKey) {
  const std::string text = std::string(kMinimal) + "[parallel]\ncp = 2\n";
  EXPECT_EQ(parse_config(text, kFile).parallel.cp_comm, dense::CpComm::all_gather);
  EXPECT_EQ(parse_config(text + "cp_comm = \"ring\"\n", kFile).parallel.cp_comm, dense::CpComm::ring);
  EXPECT_EQ(parse_config(text, kFile, {"parallel.cp_comm=ring"}).parallel.cp_comm, dense::CpComm::ring);
  EXPECT_EQ(parse_config(text + "cp_comm = \"all_gather\"\n", kFile).parallel.cp_comm, dense::CpComm::all_gather);
  expect_error(text + "cp_comm = \"rings\"\n", {kFile, "parallel.cp_comm = \"rings\"",
                                                 "must be one of \"all_gather\", \"ring\"", "did you mean \"ring\""});
  expect_error(text + "cp_comm = 1\n", {kFile, "parallel.cp_comm", "expected a string, one of \"all_gather\", \"ring\""});
  expect_error(text, {"--set parallel.cp_comm=allgather", "parallel.cp_comm = \"allgather\"", "must be one of"},
               {"parallel.cp_comm=allgather"});
  EXPECT_NE(canonical_text(parse_config(text, kFile)).find("parallel.cp_comm = \"all_gather\"\n"), std::string::npos);
  EXPECT_NE(canonical_text(parse_config(text, kFile, {"parallel.cp_comm=ring"})).find("parallel.cp_comm = \"ring\"\n"),
            std::string::npos);
}

TEST(Config, ShippedConfigsLoad) {
  const std::string root = ORIGAMI_SOURCE_DIR;
  const Config tiny = load_config(root + "/configs/tiny-dense.toml");
  EXPECT_EQ(tiny.model.vocab_size, 257);
  EXPECT_EQ(tiny.model.hidden_size, 128);
  EXPECT_EQ(tiny.model.num_layers, 4);
  EXPECT_EQ(tiny.model.num_heads, 4);
  EXPECT_EQ(tiny.model.num_kv_heads, 2);
  EXPECT_EQ(tiny.model.ffn_hidden_size, 352);
  EXPECT_EQ(tiny.training.seq_len, 128);
  EXPECT_EQ(tiny.training.global_batch, 16);
  EXPECT_EQ(tiny.training.micro_batch, 8);
  EXPECT_EQ(tiny.training.steps, 300);
  EXPECT_EQ(tiny.optimizer.lr, 3e-3);
  EXPECT_EQ(tiny.lr_schedule.warmup_steps, 20);
  EXPECT_EQ(tiny.lr_schedule.min_lr, 3e-4);
  EXPECT_EQ(tiny.data.path, "data/fortunes");
  EXPECT_EQ(tiny.logging.dir, "runs/tiny-dense");
  EXPECT_EQ(tiny.exp.dir, "runs/tiny-dense/export");
  EXPECT_TRUE(tiny.parallel.pp_layers.empty());
  EXPECT_TRUE(tiny.parallel.reshard_after_forward);
  EXPECT_NO_THROW(validate_for_world(tiny, 1));

  const Config bench = load_config(root + "/configs/bench-dense.toml");
  EXPECT_EQ(bench.model.hidden_size, 512);
  EXPECT_EQ(bench.model.num_layers, 4);
  EXPECT_EQ(bench.model.num_heads, 8);
  EXPECT_EQ(bench.model.num_kv_heads, 8);
  EXPECT_EQ(bench.model.ffn_hidden_size, 1408);
  EXPECT_EQ(bench.training.seq_len, 512);
  EXPECT_EQ(bench.training.micro_batch, 8);
  EXPECT_EQ(bench.training.global_batch, 8);
  EXPECT_EQ(bench.model.vocab_size, 257);
  EXPECT_EQ(bench.data.path, "data/fortunes");
  EXPECT_NO_THROW(validate_for_world(bench, 1));
}

TEST(Config, ShippedMoeConfigsLoad) {
  const std::string root = ORIGAMI_SOURCE_DIR;
  const Config tiny = load_config(root + "/configs/tiny-moe.toml");
  EXPECT_EQ(tiny.model.vocab_size, 257);
  EXPECT_EQ(tiny.model.hidden_size, 128);
  EXPECT_EQ(tiny.model.num_layers, 4);
  EXPECT_EQ(tiny.model.num_heads, 4);
  EXPECT_EQ(tiny.model.num_kv_heads, 2);
  EXPECT_EQ(tiny.model.ffn_hidden_size, 352);
  EXPECT_EQ(tiny.moe.router.num_experts, 8);
  EXPECT_EQ(tiny.moe.router.top_k, 2);
  EXPECT_EQ(tiny.moe.ffn_hidden_size, 128);
  EXPECT_EQ(tiny.moe.first_dense_layers, 1);
  EXPECT_EQ(tiny.moe.layer_freq, 1);
  EXPECT_FALSE(tiny.moe.is_moe_layer(0));
  for (int l = 1; l < 4; ++l) EXPECT_TRUE(tiny.moe.is_moe_layer(l)) << l;
  EXPECT_EQ(tiny.moe.router.load_balancing, moe::LoadBalancing::aux_loss);
  EXPECT_EQ(tiny.moe.router.aux_loss_coeff, 1e-2);
  EXPECT_FALSE(tiny.moe.capacity.capacity_factor.has_value());
  EXPECT_EQ(tiny.training.seq_len, 128);
  EXPECT_EQ(tiny.training.global_batch, 16);
  EXPECT_EQ(tiny.training.micro_batch, 2);
  EXPECT_EQ(tiny.training.steps, 300);
  EXPECT_EQ(tiny.optimizer.lr, 3e-3);
  EXPECT_EQ(tiny.lr_schedule.warmup_steps, 20);
  EXPECT_EQ(tiny.lr_schedule.min_lr, 3e-4);
  EXPECT_EQ(tiny.data.path, "data/fortunes");
  EXPECT_EQ(tiny.logging.dir, "runs/tiny-moe");
  EXPECT_EQ(tiny.exp.dir, "runs/tiny-moe/export");
  // Room for the parity layouts: TP/CP/EP 2, DP up to 8.
  EXPECT_EQ(tiny.model.num_heads % 2, 0);
  EXPECT_EQ(tiny.model.num_kv_heads % 2, 0);
  EXPECT_GE(tiny.model.num_layers, 4);
  EXPECT_EQ(tiny.training.seq_len % 8, 0);
  EXPECT_EQ(tiny.training.global_batch % (tiny.training.micro_batch * 8), 0);
  EXPECT_NO_THROW(validate_for_world(tiny, 1));

  const Config bench = load_config(root + "/configs/bench-moe.toml");
  EXPECT_EQ(bench.model.hidden_size, 512);
  EXPECT_EQ(bench.model.num_layers, 4);
  EXPECT_EQ(bench.model.num_heads, 8);
  EXPECT_EQ(bench.model.num_kv_heads, 8);
  EXPECT_EQ(bench.moe.router.num_experts, 16);
  EXPECT_EQ(bench.moe.router.top_k, 2);
  EXPECT_EQ(bench.moe.ffn_hidden_size, 704);
  EXPECT_EQ(bench.moe.first_dense_layers, 0);
  for (int l = 0; l < 4; ++l) EXPECT_TRUE(bench.moe.is_moe_layer(l)) << l;
  EXPECT_EQ(bench.training.seq_len, 512);
  EXPECT_EQ(bench.training.micro_batch, 8);
  EXPECT_EQ(bench.training.global_batch, 8);
  EXPECT_EQ(bench.model.vocab_size, 257);
  EXPECT_EQ(bench.data.path, "data/fortunes");
  EXPECT_NO_THROW(validate_for_world(bench, 1));
}

}  // namespace
}  // namespace origami
