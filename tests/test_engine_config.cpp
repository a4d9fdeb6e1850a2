// Config loader: defaults, every key of every section, each error class (the
// message must name the source, the key and the rule) and --set overrides.
// The layout rules against a world size, the pipeline keys and the shipped
// configs are tests/test_engine_config_layout.cpp, the [moe] section
// tests/test_engine_config_moe.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "cli_util.h"
#include "config_test_util.h"
#include "engine/config.h"
#include "engine/preflight.h"
#include "kernels/check.h"

namespace origami {
namespace {

using testing::expect_error;
using testing::kFile;
using testing::kMinimal;

// validate_for_training(c) throws a UserError holding every fragment.
void expect_training_error(const Config& c, std::initializer_list<std::string> fragments) {
  try {
    validate_for_training(c);
    ADD_FAILURE() << "no UserError";
  } catch (const UserError& e) {
    for (const std::string& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

TEST(Config, DefaultsLoad) {
  const Config c = parse_config(kMinimal, kFile);
  const Config d;
  EXPECT_EQ(c.source, kFile);
  EXPECT_EQ(c.model.vocab_size, d.model.vocab_size);
  EXPECT_EQ(c.model.hidden_size, d.model.hidden_size);
  EXPECT_EQ(c.model.num_kv_heads, d.model.num_kv_heads);
  EXPECT_EQ(c.model.rope_theta, d.model.rope_theta);
  EXPECT_EQ(c.moe.router.num_experts, 0);
  EXPECT_FALSE(c.moe.is_moe_layer(0));
  EXPECT_EQ(c.moe.router.score_function, moe::ScoreFunction::softmax);
  EXPECT_FALSE(c.moe.router.normalize_topk);
  EXPECT_EQ(c.moe.router.topk_scaling, 1.0);
  EXPECT_EQ(c.moe.router.num_groups, 1);
  EXPECT_EQ(c.moe.router.group_topk, 1);
  EXPECT_EQ(c.moe.router.load_balancing, moe::LoadBalancing::aux_loss);
  EXPECT_EQ(c.moe.router.aux_loss_coeff, d.moe.router.aux_loss_coeff);
  EXPECT_EQ(c.moe.router.z_loss_coeff, 0.0);
  EXPECT_FALSE(c.moe.expert_bias);
  EXPECT_EQ(c.moe.bias_update_rate, d.moe.bias_update_rate);
  EXPECT_FALSE(c.moe.capacity.capacity_factor.has_value());  // dropless
  EXPECT_EQ(c.moe.capacity.drop_policy, moe::DropPolicy::probs);
  EXPECT_FALSE(c.moe.capacity.pad_to_capacity);
  EXPECT_EQ(c.moe.shared_expert_hidden_size, 0);
  EXPECT_EQ(c.parallel.order, "tp-cp-ep-dp-pp");
  EXPECT_EQ(c.parallel.zero_stage, 3);
  EXPECT_TRUE(c.parallel.pp_layers.empty());  // even split
  EXPECT_TRUE(c.parallel.reshard_after_forward);
  EXPECT_FALSE(c.parallel.overlap_grad_reduce);
  EXPECT_EQ(c.runtime.device, RuntimeDevice::cpu);
  EXPECT_EQ(c.runtime.precision, Precision::auto_);
  EXPECT_EQ(c.training.steps, d.training.steps);
  EXPECT_EQ(c.training.seed, d.training.seed);
  EXPECT_EQ(c.optimizer.lr, d.optimizer.lr);
  EXPECT_EQ(c.optimizer.beta2, d.optimizer.beta2);
  EXPECT_EQ(c.lr_schedule.min_lr, d.lr_schedule.min_lr);
  EXPECT_EQ(c.data.path, "data/x");
  EXPECT_TRUE(c.data.shuffle);
  EXPECT_EQ(c.checkpoint.interval, 0);
  EXPECT_EQ(c.exp.dir, "");
  EXPECT_EQ(c.logging.interval, 1);
  EXPECT_EQ(c.runtime.collective_timeout_s, d.runtime.collective_timeout_s);
  // With nothing to train, not even data.path is needed.
  EXPECT_NO_THROW(parse_config("", kFile, {"training.steps=0"}));
}

TEST(Config, EverySectionsKeysParse) {
  const Config c = parse_config(R"(
[model]
vocab_size = 300
hidden_size = 96
num_layers = 3
num_heads = 6
num_kv_heads = 3
ffn_hidden_size = 200
rope_theta = 500000
norm_eps = 1e-6
init_std = 0.01
[moe]
num_experts = 8
top_k = 2
ffn_hidden_size = 64
first_dense_layers = 1
layer_freq = 2
shared_expert_hidden_size = 48
score_function = "sigmoid"
normalize_topk = true
topk_scaling = 2.5
num_groups = 4
group_topk = 2
load_balancing = "seq_aux_loss"
aux_loss_coeff = 1e-3
z_loss_coeff = 1e-4
expert_bias = true
bias_update_rate = 2e-3
capacity_factor = 1.25
drop_policy = "position"
pad_to_capacity = true
[parallel]
tp = 1
cp = 1
pp = 1
ep = 1
etp = 1
order = "tp-cp-dp-ep-pp"
zero_stage = 1
pp_layers = [3]
reshard_after_forward = false
overlap_grad_reduce = true
[training]
steps = 7
seq_len = 32
global_batch = 12
micro_batch = 4
seed = 99
[optimizer]
lr = 1e-3
beta1 = 0.8
beta2 = 0.99
eps = 1e-6
weight_decay = 0.0
clip_grad = 0.5
[lr_schedule]
warmup_steps = 3
decay_steps = 6
min_lr = 1e-5
[data]
path = "some/prefix"
shuffle = false
[checkpoint]
dir = "ck"
interval = 0
[export]
dir = "ex"
[logging]
dir = "lg"
interval = 5
[runtime]
threads = 2
collective_timeout_s = 30
io_timeout_s = 7200
device = "auto"
precision = "fp32"
)",
                                kFile);
  EXPECT_EQ(c.model.vocab_size, 300);
  EXPECT_EQ(c.model.hidden_size, 96);
  EXPECT_EQ(c.model.num_layers, 3);
  EXPECT_EQ(c.model.num_heads, 6);
  EXPECT_EQ(c.model.num_kv_heads, 3);
  EXPECT_EQ(c.model.ffn_hidden_size, 200);
  EXPECT_EQ(c.model.rope_theta, 500000.0);  // an integer where a float is expected
  EXPECT_EQ(c.model.norm_eps, 1e-6);
  EXPECT_EQ(c.model.init_std, 0.01);
  EXPECT_EQ(c.model.head_dim(), 16);
  EXPECT_EQ(c.moe.router.num_experts, 8);
  EXPECT_EQ(c.moe.router.top_k, 2);
  EXPECT_EQ(c.moe.ffn_hidden_size, 64);
  EXPECT_EQ(c.moe.first_dense_layers, 1);
  EXPECT_EQ(c.moe.layer_freq, 2);
  EXPECT_EQ(c.moe.shared_expert_hidden_size, 48);
  EXPECT_EQ(c.moe.router.score_function, moe::ScoreFunction::sigmoid);
  EXPECT_TRUE(c.moe.router.normalize_topk);
  EXPECT_EQ(c.moe.router.topk_scaling, 2.5);
  EXPECT_EQ(c.moe.router.num_groups, 4);
  EXPECT_EQ(c.moe.router.group_topk, 2);
  EXPECT_EQ(c.moe.router.load_balancing, moe::LoadBalancing::seq_aux_loss);
  EXPECT_EQ(c.moe.router.aux_loss_coeff, 1e-3);
  EXPECT_EQ(c.moe.router.z_loss_coeff, 1e-4);
  EXPECT_TRUE(c.moe.expert_bias);
  EXPECT_EQ(c.moe.bias_update_rate, 2e-3);
  ASSERT_TRUE(c.moe.capacity.capacity_factor.has_value());
  EXPECT_EQ(*c.moe.capacity.capacity_factor, 1.25);
  EXPECT_EQ(c.moe.capacity.drop_policy, moe::DropPolicy::position);
  EXPECT_TRUE(c.moe.capacity.pad_to_capacity);
  // Layers 1 and 3 of 3 are MoE (first_dense_layers 1, layer_freq 2).
  EXPECT_FALSE(c.moe.is_moe_layer(0));
  EXPECT_TRUE(c.moe.is_moe_layer(1));
  EXPECT_FALSE(c.moe.is_moe_layer(2));
  EXPECT_EQ(c.moe.expert_ffn(c.model.ffn_hidden_size), 64);
  EXPECT_EQ(c.parallel.order, "tp-cp-dp-ep-pp");
  EXPECT_EQ(c.parallel.zero_stage, 1);
  EXPECT_EQ(c.parallel.pp_layers, (std::vector<int64_t>{3}));
  EXPECT_FALSE(c.parallel.reshard_after_forward);
  EXPECT_TRUE(c.parallel.overlap_grad_reduce);
  EXPECT_EQ(c.training.steps, 7);
  EXPECT_EQ(c.training.seq_len, 32);
  EXPECT_EQ(c.training.global_batch, 12);
  EXPECT_EQ(c.training.micro_batch, 4);
  EXPECT_EQ(c.training.seed, 99u);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.beta2, 0.99);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.optimizer.clip_grad, 0.5);
  EXPECT_EQ(c.lr_schedule.warmup_steps, 3);
  EXPECT_EQ(c.lr_schedule.decay_steps, 6);
  EXPECT_EQ(c.lr_schedule.min_lr, 1e-5);
  EXPECT_EQ(c.data.path, "some/prefix");
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_EQ(c.checkpoint.dir, "ck");
  EXPECT_EQ(c.exp.dir, "ex");
  EXPECT_EQ(c.logging.dir, "lg");
  EXPECT_EQ(c.logging.interval, 5);
  EXPECT_EQ(c.runtime.threads, 2);
  EXPECT_EQ(c.runtime.collective_timeout_s, 30.0);
  EXPECT_EQ(c.runtime.io_timeout_s, 7200.0);
  EXPECT_EQ(c.runtime.device, RuntimeDevice::auto_);
  EXPECT_EQ(c.runtime.precision, Precision::fp32);
}

TEST(Config, DottedKeysAndInlineTablesAreTheSameKeys) {
  const Config c = parse_config("training.steps = 0\nmodel = { hidden_size = 64, num_heads = 2, num_kv_heads = 2 }\n",
                                kFile);
  EXPECT_EQ(c.training.steps, 0);
  EXPECT_EQ(c.model.hidden_size, 64);
}

TEST(Config, UnknownKeySuggestsTheClosest) {
  expect_error("[training]\nseqlen = 64\n",
               {kFile, "unknown key 'training.seqlen'", "(did you mean 'training.seq_len'?)"});
  expect_error("[model]\nlayers = 2\n", {kFile, "'model.layers'", "did you mean 'model.num_layers'"});
  // A key in the wrong section points at its home.
  expect_error("[training]\nlr = 0.1\n", {kFile, "'training.lr'", "did you mean 'optimizer.lr'"});
  expect_error("[parallel]\ndp = 2\n", {kFile, "'parallel.dp'", "derived"});
  // Megatron-LM's and Hugging Face's names, far in spelling from origami's.
  expect_error("[optimizer]\nlearning_rate = 1e-3\n",
               {kFile, "'optimizer.learning_rate'", "origami's key is 'optimizer.lr'"});
  expect_error("[parallel]\ntensor-model-parallel-size = 2\n", {kFile, "origami's key is 'parallel.tp'"});
  expect_error("[moe]\nnum_local_experts = 8\n", {kFile, "origami's key is 'moe.num_experts'"});
  expect_error("[training]\nglobal_batch_size = 8\n", {kFile, "origami's key is 'training.global_batch'"});
}

TEST(Config, UnknownKeyFarFromAnyHasNoSuggestion) {
  try {
    parse_config("[training]\nbanana = 1\n", kFile);
    FAIL() << "no UserError";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("test.toml: unknown key 'training.banana'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
  }
}

TEST(Config, UnknownSection) {
  expect_error("[trainng]\nsteps = 1\n", {kFile, "unknown section 'trainng'", "(did you mean 'training'?)"});
  expect_error("[bogus]\nx = 1\n", {kFile, "unknown section 'bogus'", "sections: model"});
  expect_error("steps = 1\n", {kFile, "unknown top-level key 'steps'", "did you mean 'training.steps'"});
  expect_error("model = 3\n", {kFile, "'model' must be a section", "got an integer"});
}

TEST(Config, WrongTypeStringForInt) {
  expect_error("[training]\nsteps = \"ten\"\n",
               {kFile, "training.steps = \"ten\"", "expected an integer, got a string"});
}

TEST(Config, WrongTypeFloatForInt) {
  expect_error("[model]\nhidden_size = 128.0\n", {kFile, "model.hidden_size", "expected an integer, got a float"});
}

TEST(Config, WrongTypeIntForBool) {
  expect_error("[data]\npath = \"d\"\nshuffle = 1\n", {kFile, "data.shuffle", "expected a boolean", "got an integer"});
}

TEST(Config, WrongTypeOthers) {
  expect_error("[optimizer]\nlr = \"fast\"\n", {kFile, "optimizer.lr", "expected a number, got a string"});
  expect_error("[data]\npath = 3\n", {kFile, "data.path", "expected a string, got an integer"});
  expect_error("[parallel]\norder = [\"tp\"]\n", {kFile, "parallel.order", "got an array"});
  expect_error("[model]\nhidden_size = { a = 1 }\n", {kFile, "model.hidden_size", "got a table"});
}

TEST(Config, OutOfRange) {
  struct Case {
    const char* toml;
    const char* key_and_value;
    const char* rule;
  };
  const Case cases[] = {
      {"[model]\nnum_heads = 0", "model.num_heads = 0", "must be >= 1"},
      {"[model]\nvocab_size = 1", "model.vocab_size = 1", "must be >= 2"},
      {"[model]\nhidden_size = -8", "model.hidden_size = -8", "must be >= 1"},
      {"[model]\nnorm_eps = 0", "model.norm_eps = 0", "must be > 0"},
      {"[model]\nrope_theta = -1.5", "model.rope_theta = -1.5", "must be > 0"},
      {"[model]\ninit_std = nan", "model.init_std = nan", "must be a finite number"},
      {"[moe]\nlayer_freq = 0", "moe.layer_freq = 0", "must be >= 1"},
      {"[moe]\nnum_experts = -1", "moe.num_experts = -1", "must be >= 0"},
      {"[moe]\nnum_experts = 4\ntop_k = 5", "moe.top_k = 5", "must be in 1..4"},
      {"[moe]\nnum_experts = 4\ntop_k = 0", "moe.top_k = 0", "must be in 1..4"},
      {"[moe]\nffn_hidden_size = -1", "moe.ffn_hidden_size = -1", "must be >= 0"},
      {"[moe]\nfirst_dense_layers = -1", "moe.first_dense_layers = -1", "must be >= 0"},
      {"[moe]\nshared_expert_hidden_size = -4", "moe.shared_expert_hidden_size = -4", "must be >= 0"},
      {"[moe]\ntopk_scaling = 0", "moe.topk_scaling = 0", "must be > 0"},
      {"[moe]\ntopk_scaling = -2.0", "moe.topk_scaling = -2", "must be > 0"},
      {"[moe]\ntopk_scaling = inf", "moe.topk_scaling = inf", "must be a finite number"},
      {"[moe]\nnum_groups = 0", "moe.num_groups = 0", "must be >= 1"},
      {"[moe]\nnum_groups = 2\ngroup_topk = 3", "moe.group_topk = 3", "must be in 1..2"},
      {"[moe]\ngroup_topk = 0", "moe.group_topk = 0", "must be in 1..1"},
      {"[moe]\naux_loss_coeff = -0.01", "moe.aux_loss_coeff = -0.01", "must be >= 0"},
      {"[moe]\nz_loss_coeff = -1e-3", "moe.z_loss_coeff = -0.001", "must be >= 0"},
      {"[moe]\nz_loss_coeff = nan", "moe.z_loss_coeff = nan", "must be a finite number"},
      {"[moe]\nbias_update_rate = -1e-3", "moe.bias_update_rate = -0.001", "must be >= 0"},
      {"[moe]\ncapacity_factor = 0", "moe.capacity_factor = 0", "must be > 0"},
      {"[moe]\ncapacity_factor = -1.5", "moe.capacity_factor = -1.5", "must be > 0"},
      {"[moe]\ncapacity_factor = inf", "moe.capacity_factor = inf", "must be a finite number"},
      {"[parallel]\ntp = 0", "parallel.tp = 0", "must be >= 1"},
      {"[parallel]\nzero_stage = 4", "parallel.zero_stage = 4", "must be in 0..3"},
      {"[training]\nsteps = -1", "training.steps = -1", "must be >= 0"},
      {"[training]\nseq_len = 0", "training.seq_len = 0", "must be >= 1"},
      {"[training]\nmicro_batch = 0", "training.micro_batch = 0", "must be >= 1"},
      {"[training]\nseed = -3", "training.seed = -3", "must be >= 0"},
      {"[optimizer]\nlr = 0", "optimizer.lr = 0", "must be > 0"},
      {"[optimizer]\nlr = inf", "optimizer.lr = inf", "must be a finite number"},
      {"[optimizer]\nbeta2 = 1.0", "optimizer.beta2 = 1", "must be in [0, 1)"},
      {"[optimizer]\nbeta1 = -0.1", "optimizer.beta1 = -0.1", "must be in [0, 1)"},
      {"[optimizer]\neps = 0", "optimizer.eps = 0", "must be > 0"},
      {"[optimizer]\nweight_decay = -0.1", "optimizer.weight_decay = -0.1", "must be >= 0"},
      {"[optimizer]\nclip_grad = -1", "optimizer.clip_grad = -1", "must be >= 0"},
      {"[lr_schedule]\nwarmup_steps = -5", "lr_schedule.warmup_steps = -5", "must be >= 0"},
      {"[lr_schedule]\ndecay_steps = -1", "lr_schedule.decay_steps = -1", "must be >= 0"},
      {"[lr_schedule]\nmin_lr = -0.5", "lr_schedule.min_lr = -0.5", "must be >= 0"},
      {"[checkpoint]\ninterval = -1", "checkpoint.interval = -1", "must be >= 0"},
      {"[checkpoint]\nkeep = -1", "checkpoint.keep = -1", "must be >= 0"},
      {"[logging]\ninterval = 0", "logging.interval = 0", "must be >= 1"},
      {"[runtime]\nthreads = -2", "runtime.threads = -2", "must be >= 0"},
      {"[runtime]\ncollective_timeout_s = 0", "runtime.collective_timeout_s = 0", "must be > 0"},
      {"[runtime]\nio_timeout_s = -5", "runtime.io_timeout_s = -5", "must be > 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.toml);
    expect_error(std::string(kMinimal) + c.toml + "\n", {kFile, c.key_and_value, c.rule});
  }
}

TEST(Config, MinLrAboveLr) {
  expect_error(std::string(kMinimal) + "[optimizer]\nlr = 1e-3\n[lr_schedule]\nmin_lr = 1e-2\n",
               {kFile, "lr_schedule.min_lr = 0.01", "must be <= optimizer.lr = 0.001"});
}

// Unset, the cosine's floor is a tenth of the peak (as written: 3e-4 from
// 3e-3), so lowering optimizer.lr alone is not refused; a given one is kept.
TEST(Config, MinLrDefaultsToATenthOfTheLr) {
  EXPECT_EQ(parse_config(kMinimal, kFile).lr_schedule.min_lr, 3e-4);
  EXPECT_EQ(parse_config(kMinimal, kFile, {"optimizer.lr=1e-4"}).lr_schedule.min_lr, 1e-5);
  EXPECT_EQ(parse_config(std::string(kMinimal) + "[optimizer]\nlr = 7e-4\n", kFile).lr_schedule.min_lr, 7e-5);
  EXPECT_EQ(parse_config(kMinimal, kFile, {"optimizer.lr=1e-4", "lr_schedule.min_lr=0"}).lr_schedule.min_lr, 0.0);
  EXPECT_EQ(parse_config(std::string(kMinimal) + "[lr_schedule]\nmin_lr = 2e-5\n", kFile, {"optimizer.lr=1e-4"})
                .lr_schedule.min_lr,
            2e-5);
}

// Megatron's rule: the cosine starts after the warmup. decay_steps = 0
// (training.steps) stays free, so a short run of a long schedule runs.
// A run's rule (validate_for_training), not a parse's: a config read back
// from an older checkpoint is not held to it.
TEST(Config, DecayStepsMustFollowTheWarmup) {
  for (const char* decay : {"5", "10"}) {
    SCOPED_TRACE(decay);
    const std::string text = std::string(kMinimal) + "[lr_schedule]\nwarmup_steps = 10\ndecay_steps = " + decay + "\n";
    expect_training_error(parse_config(text, kFile),
                          {kFile, std::string("lr_schedule.decay_steps = ") + decay + " must be > lr_schedule.warmup_steps = 10"});
  }
  EXPECT_NO_THROW(validate_for_training(
      parse_config(std::string(kMinimal) + "[lr_schedule]\nwarmup_steps = 10\ndecay_steps = 11\n", kFile)));
  EXPECT_NO_THROW(validate_for_training(
      parse_config(std::string(kMinimal) + "[lr_schedule]\nwarmup_steps = 10\n", kFile, {"training.steps=3"})));
}

// A layout rule (layout_problem), so plan and groups refuse what train does.
TEST(Config, ExpertParallelismNeedsExperts) {
  EXPECT_EQ(layout_problem(parse_config(kMinimal, kFile, {"parallel.ep=2"}), 2),
            "parallel.ep = 2 needs moe.num_experts > 0 (a dense model has no experts to spread)");
  EXPECT_EQ(layout_problem(parse_config(kMinimal, kFile, {"parallel.ep=2", "moe.num_experts=4", "training.micro_batch=4"}), 2),
            "");
  // Experts configured, but every layer dense: nothing to spread either.
  const Config all_dense = parse_config(kMinimal, kFile, {"parallel.ep=2", "moe.num_experts=4", "training.micro_batch=4",
                                                          "moe.first_dense_layers=99"});
  EXPECT_NE(layout_problem(all_dense, 2).find("parallel.ep = 2 needs a MoE layer, but moe.first_dense_layers = 99"),
            std::string::npos)
      << layout_problem(all_dense, 2);
}

TEST(Config, HeadsMustDivideHidden) {
  expect_error(std::string(kMinimal) + "[model]\nhidden_size = 100\nnum_heads = 3\nnum_kv_heads = 3\n",
               {kFile, "model.hidden_size = 100 must be divisible by model.num_heads = 3"});
}

TEST(Config, KvHeadsMustDivideHeads) {
  expect_error(std::string(kMinimal) + "[model]\nnum_heads = 4\nnum_kv_heads = 3\n",
               {kFile, "model.num_heads = 4 must be divisible by model.num_kv_heads = 3"});
}

TEST(Config, HeadDimMustBeEvenForRope) {
  expect_error(std::string(kMinimal) + "[model]\nhidden_size = 36\nnum_heads = 4\nnum_kv_heads = 4\n",
               {kFile, "model.hidden_size / model.num_heads", "= 9 must be even"});
}

TEST(Config, GlobalBatchMustBeMultipleOfMicroBatch) {
  expect_error(std::string(kMinimal) + "[training]\nglobal_batch = 10\nmicro_batch = 4\n",
               {kFile, "training.global_batch = 10 must be a multiple of training.micro_batch = 4"});
}

TEST(Config, BadOrderString) {
  const char* bad[][2] = {
      {"tp-cp-dp-pp", "axis 'ep' is missing"},
      {"tp-cp-ep-dp-xx", "unknown axis 'xx'"},
      {"tp-tp-ep-dp-pp", "axis 'tp' appears twice"},
      {"tp,cp,ep,dp,pp", "unknown axis"},
      {"tp-cp-ep-dp-pp-", "unknown axis ''"},
      {"", "axis 'tp' is missing"},
  };
  for (const auto& b : bad) {
    SCOPED_TRACE(b[0]);
    expect_error(std::string(kMinimal) + "[parallel]\norder = \"" + b[0] + "\"\n",
                 {kFile, "parallel.order = \"", "must be a permutation of tp, cp, ep, dp, pp", b[1]});
  }
}

TEST(Config, CheckpointKeysNeedADirectory) {
  expect_error(std::string(kMinimal) + "[checkpoint]\ninterval = 100\n",
               {kFile, "checkpoint.interval = 100", "checkpoint.dir must name where"});
  expect_error(std::string(kMinimal) + "[checkpoint]\nload = \"latest\"\n",
               {kFile, "checkpoint.load = \"latest\" reads <checkpoint.dir>/latest"});
  const Config c = parse_config(std::string(kMinimal) + "[checkpoint]\ndir = \"ck\"\ninterval = 5\nkeep = 2\nload = \"latest\"\n", kFile);
  EXPECT_EQ(c.checkpoint.interval, 5);
  EXPECT_EQ(c.checkpoint.keep, 2);
  EXPECT_EQ(c.checkpoint.load, "latest");
}

// Training's rule, not the config's: eval (--data), plan and groups take a
// config without data.path.
TEST(Config, DataPathRequiredToTrain) {
  expect_training_error(parse_config("[training]\nsteps = 5\n", kFile),
                        {kFile, ": data.path is required to train", "training.steps = 5"});
  expect_training_error(parse_config("", kFile, {"data.path="}), {"--set data.path=", "data.path is required to train"});
  expect_training_error(parse_config("", kFile, {"training.steps=3"}), {"--set training.steps=3", "training.steps = 3"});
  EXPECT_NO_THROW(validate_for_training(parse_config("[training]\nsteps = 0\n", kFile)));
  EXPECT_NO_THROW(validate_for_training(parse_config(kMinimal, kFile)));
}

TEST(Config, SetOverridesTakePrecedence) {
  const std::string text = std::string(kMinimal) + "[training]\nsteps = 10\n[optimizer]\nlr = 1e-3\n";
  const Config c = parse_config(text, kFile, {"training.steps=20", "optimizer.lr=5e-4", "logging.interval = 7"});
  EXPECT_EQ(c.training.steps, 20);
  EXPECT_EQ(c.optimizer.lr, 5e-4);
  EXPECT_EQ(c.logging.interval, 7);  // section created by the override
  // The last override of a key wins.
  EXPECT_EQ(parse_config(text, kFile, {"training.steps=1", "training.steps=2"}).training.steps, 2);
  EXPECT_EQ(parse_config(text, kFile, {"optimizer.lr=1"}).optimizer.lr, 1.0);
  EXPECT_FALSE(parse_config(text, kFile, {"data.shuffle=false"}).data.shuffle);
}

TEST(Config, SetBareWordIsAString) {
  const Config c = parse_config(kMinimal, kFile,
                                {"data.path=data/other", "logging.dir=runs/x y", "export.dir=\"quoted\"",
                                 "parallel.order=tp-cp-dp-ep-pp"});
  EXPECT_EQ(c.data.path, "data/other");
  EXPECT_EQ(c.logging.dir, "runs/x y");
  EXPECT_EQ(c.exp.dir, "quoted");
  EXPECT_EQ(c.parallel.order, "tp-cp-dp-ep-pp");
  // An empty value is the empty string.
  EXPECT_EQ(parse_config(kMinimal, kFile, {"logging.dir="}).logging.dir, "");
  // A text only a TOML value starts like is not a string, but a bare word
  // starting with a digit is.
  EXPECT_EQ(parse_config(kMinimal, kFile, {"data.path=2024/corpus"}).data.path, "2024/corpus");
  EXPECT_EQ(parse_config(kMinimal, kFile, {"data.path=3rd"}).data.path, "3rd");
  EXPECT_EQ(parse_config(kMinimal, kFile, {"parallel.pp_schedule=1f1b"}).parallel.pp_schedule, PipeSchedule::one_f_one_b);
  for (const char* word : {"0001", "1_", "1__2", "007.5"})  // not numbers in TOML's grammar
    EXPECT_EQ(parse_config(kMinimal, kFile, {std::string("logging.dir=") + word}).logging.dir, word);
}

// What begins as a TOML value (a quote, bracket, brace, number) but does not
// parse is refused with the parser's reason: taken as a string, an unclosed
// quote would become part of a path, and a seed past 64 bits would be
// reported as a string where an integer belongs.
TEST(Config, SetTextThatBeginsAsATomlValueMustBeOne) {
  for (const auto& [ov, reason] : {std::pair{"data.path=\"runs/x", "string"},
                                   std::pair{"data.path='runs/x", "string"},
                                   std::pair{"parallel.pp_layers=[1, 2", "array"},
                                   std::pair{"training.seed=18446744073709551615", "64 bits"},
                                   std::pair{"optimizer.lr=1e999", "1e999"},
                                   std::pair{"training.steps=99999999999999999999", "64 bits"}}) {
    SCOPED_TRACE(ov);
    expect_error(kMinimal, {std::string("--set ") + ov + ":", "not a TOML value (", reason, "must be one whole"}, {ov});
  }
  // A string key given another TOML type: the message says how to quote it.
  expect_error(kMinimal, {"--set data.path=2024: data.path = 2024: expected a string, got an integer",
                          "(quote it as TOML: --set 'data.path=\"2024\"')"},
               {"data.path=2024"});
  expect_error(kMinimal, {"expected a string, got a float", "(quote it as TOML: --set 'data.path=\"1e5\"')"},
               {"data.path=1e5"});
  EXPECT_EQ(parse_config(kMinimal, kFile, {"data.path=\"2024\""}).data.path, "2024");
}

TEST(Config, SetMalformed) {
  for (const char* ov : {"training.steps", "steps=5", "=5", ".steps=5", "training.=5"}) {
    SCOPED_TRACE(ov);
    expect_error(kMinimal, {std::string("--set ") + ov + ":", "malformed override", "section.key=value"}, {ov});
  }
}

// Bytes that are not UTF-8 (a Latin-1 path, a stray byte): refused, as a
// TOML file with them is; metadata.json and the metrics carry the values as JSON.
TEST(Config, SetValuesMustBeUtf8) {
  for (const auto& [ov, shown] : {std::pair{"data.path=caf\xe9", "data.path=caf\\xe9"},
                                   std::pair{"logging.dir=\xff", "logging.dir=\\xff"},
                                   std::pair{"data.path=\xc3", "data.path=\\xc3"}}) {
    SCOPED_TRACE(shown);
    expect_error(kMinimal, {std::string("--set ") + shown + ": not valid UTF-8 text", "rule: config keys and values are UTF-8"},
                 {ov});
  }
  EXPECT_EQ(parse_config(kMinimal, kFile, {"data.path=caf\xc3\xa9"}).data.path, "caf\xc3\xa9");  // é
}

TEST(Config, SetUnknownKey) {
  expect_error(kMinimal, {"--set training.seqlen=64: unknown key 'training.seqlen'", "did you mean 'training.seq_len'"},
               {"training.seqlen=64"});
  expect_error(kMinimal, {"--set trainig.steps=3: unknown section 'trainig'", "did you mean 'training'"},
               {"trainig.steps=3"});
}

TEST(Config, SetWrongTypeAndRangeNameTheOverride) {
  expect_error(kMinimal, {"--set training.steps=abc", "training.steps = \"abc\"", "expected an integer, got a string"},
               {"training.steps=abc"});
  expect_error(kMinimal, {"--set model.num_heads=0", "model.num_heads = 0", "must be >= 1"}, {"model.num_heads=0"});
  expect_error(kMinimal, {"--set model.num_kv_heads=3", "must be divisible by model.num_kv_heads = 3"},
               {"model.num_kv_heads=3"});
}

TEST(Config, SyntaxErrorHasLineAndColumn) {
  expect_error("[model]\nhidden_size = 128\nnum_heads = = 4\n", {"test.toml:3:", "TOML syntax error"});
  expect_error("[model]\n[model]\n", {"test.toml:2:", "TOML syntax error"});
}

TEST(Config, LoadConfigReadsAFileAndNamesIt) {
  const testing::ScratchDir dir("config");  // removed however the test ends
  const std::string path = dir / "x.toml";
  {
    std::ofstream(path) << kMinimal << "[training]\nseqlen = 3\n";
  }
  try {
    load_config(path);
    ADD_FAILURE() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": unknown key 'training.seqlen'"), std::string::npos) << e.what();
  }
  {
    std::ofstream(path) << kMinimal << "[training]\nseq_len = 3\n";
  }
  const Config c = load_config(path, {"training.seq_len=5"});
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.training.seq_len, 5);
  EXPECT_EQ(c.data.path, "data/x");
}

TEST(Config, LoadConfigMissingFile) {
  try {
    load_config("/nonexistent/origami.toml");
    FAIL() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/origami.toml: cannot open the config file"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace origami

namespace origami {
namespace {

// runtime.device / runtime.precision as this machine resolves them.
TEST(Config, PlacementResolvesOnThisMachine) {
  const std::string text = std::string(kMinimal);
  const RunPlacement cpu = resolve_placement(parse_config(text, kFile), 0, 1);
  EXPECT_EQ(cpu.device, Device::cpu());
  EXPECT_EQ(cpu.precision, Precision::fp32);  // auto: the CPU's kernels are f32
  // bf16 asked for on the CPU runs emulated (f32 kernels, rounded writes).
  EXPECT_EQ(resolve_placement(parse_config(text + "[runtime]\nprecision = \"bf16\"\n", kFile), 0, 1).precision,
            Precision::bf16);
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: the no-device rules cannot be seen here";
  EXPECT_EQ(resolve_placement(parse_config(text + "[runtime]\ndevice = \"auto\"\n", kFile), 0, 1).device,
            Device::cpu());
  try {
    resolve_placement(parse_config(text + "[runtime]\ndevice = \"cuda\"\n", kFile), 0, 1);
    ADD_FAILURE() << "cuda without a device was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(std::string(kFile) + ": runtime.device = \"cuda\", but this"),
              std::string::npos)
        << e.what();
  }
}

// The rule check_one_rank_per_gpu applies to the UUIDs a node's ranks
// gathered (its CUDA half runs in tests/test_cli_cuda.cpp, on a GPU).
TEST(Config, RanksSharingAGpuAreNamedWithTheGpu) {
  EXPECT_EQ(shared_gpu_rule({}, {}), "");
  EXPECT_EQ(shared_gpu_rule({"GPU-a"}, {3}), "");
  // Per-rank CUDA_VISIBLE_DEVICES: every rank on its cuda:0, all distinct.
  EXPECT_EQ(shared_gpu_rule({"GPU-a", "GPU-b", "GPU-c"}, {0, 1, 2}), "");
  EXPECT_EQ(shared_gpu_rule({"GPU-a", "GPU-b", "GPU-a"}, {4, 5, 6}), "ranks 4, 6 share GPU GPU-a");
  EXPECT_EQ(shared_gpu_rule({"GPU-a", "GPU-a", "GPU-b", "GPU-b", "GPU-b"}, {0, 1, 2, 3, 7}),
            "ranks 0, 1 share GPU GPU-a; ranks 2, 3, 7 share GPU GPU-b");
}

// A pipeline or ring attention on serialised CUDA streams is refused naming
// the key that asked for the channels and the variable that serialises
// (the trainer calls this on CUDA ranks only; the rule is in kernels/device.h).
TEST(Config, PointToPointChannelsOnSerialisedStreamsAreRefused) {
  const char* saved = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string restore = saved ? saved : "";
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
  const Config pipelined = parse_config(kMinimal, kFile, {"parallel.pp=2", "model.num_layers=2"});
  try {
    check_cuda_streams_run_apart(pipelined);
    ADD_FAILURE() << "pp 2 with CUDA_DEVICE_MAX_CONNECTIONS=1 passed";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const char* f : {"--set parallel.pp=2: a pipeline (parallel.pp > 1)",
                          "CUDA_DEVICE_MAX_CONNECTIONS=1 gives the GPU one hardware queue", "unset the variable"})
      EXPECT_NE(msg.find(f), std::string::npos) << f << " not in: " << msg;
  }
  const Config ring = parse_config(kMinimal, kFile, {"parallel.cp=2", "parallel.cp_comm=ring"});
  EXPECT_THROW(check_cuda_streams_run_apart(ring), UserError);
  EXPECT_NO_THROW(check_cuda_streams_run_apart(parse_config(kMinimal, kFile, {"parallel.cp=2"})));  // all-gather
  EXPECT_NO_THROW(check_cuda_streams_run_apart(parse_config(kMinimal, kFile, {"parallel.ep=2", "moe.num_experts=4"})));
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  EXPECT_NO_THROW(check_cuda_streams_run_apart(pipelined));
  if (saved) setenv("CUDA_DEVICE_MAX_CONNECTIONS", restore.c_str(), 1);
  else unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
}

}  // namespace
}  // namespace origami
