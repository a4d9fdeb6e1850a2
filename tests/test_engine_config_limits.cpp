// Config limits and the rules added for hardening: etp's Megatron default,
// upper bounds of sizes (i32 kernel indices, 32-bit GEMM dimensions, 64-bit
// counts), fp32-representable floats, padded capacity rows, the machine's
// threads and memory, and the canonical text ranks compare.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>

#include <string>
#include <vector>

#include "config_test_util.h"
#include "engine/config.h"
#include "engine/plan.h"
#include "kernels/check.h"

namespace origami {
namespace {

using testing::expect_error;
using testing::kFile;
using testing::kMinimal;

}  // namespace
}  // namespace origami

namespace origami {
namespace {

// Megatron's default: expert_tensor_parallel_size = tensor_model_parallel_size
// when unset; an explicit value (file or --set) is kept.
TEST(Config, EtpDefaultsToTpLikeMegatron) {
  EXPECT_EQ(parse_config(kMinimal, kFile).parallel.etp, 1);
  EXPECT_EQ(parse_config(std::string(kMinimal) + "[parallel]\ntp = 2\n", kFile).parallel.etp, 2);
  EXPECT_EQ(parse_config(kMinimal, kFile, {"parallel.tp=2"}).parallel.etp, 2);
  EXPECT_EQ(parse_config(std::string(kMinimal) + "[parallel]\ntp = 2\netp = 1\n", kFile).parallel.etp, 1);
  EXPECT_EQ(parse_config(kMinimal, kFile, {"parallel.tp=2", "parallel.etp=1"}).parallel.etp, 1);
}

// Sizes are bounded by what the kernels index (i32) and what 64-bit counts
// hold; floats the kernels use must be fp32 numbers.
TEST(Config, SizeAndFloatLimitsNameKeyAndLimit) {
  const std::string moe = std::string(kMinimal) + "[moe]\nnum_experts = 8\n";
  const struct {
    std::string text;
    std::vector<std::string> fragments;
  } cases[] = {
      {"[model]\nffn_hidden_size = 576460752303423489", {"model.ffn_hidden_size = 576460752303423489", "<= 2147483647"}},
      {"[model]\nvocab_size = 2147483648", {"model.vocab_size = 2147483648", "token ids are i32"}},
      {"[model]\nhidden_size = 4294967296\nnum_heads = 1\nnum_kv_heads = 1", {"model.hidden_size", "GEMM"}},
      {"[model]\nnum_kv_heads = 9223372036854775807", {"model.num_kv_heads", "<= 2147483647"}},
      {"[training]\nseq_len = 2147483647", {"training.seq_len", "<= 2147483646"}},
      {"[training]\nmicro_batch = 65536\nglobal_batch = 65536\nseq_len = 65536",
       {"training.micro_batch · seq_len = 65536 · 65536", "i32 rows"}},
      {"[training]\nsteps = 9223372036854775807\nglobal_batch = 2\nmicro_batch = 2",
       {"training.global_batch = 2", "64-bit counts"}},
      {"[model]\nrope_theta = 1e-300", {"model.rope_theta = 1e-300", "fp32"}},
      {"[model]\ninit_std = 1e39", {"model.init_std = 1e+39", "fp32"}},
      {"[optimizer]\nlr = 1e-50", {"optimizer.lr = 1e-50", "fp32"}},
      {"[optimizer]\nweight_decay = 1e-45", {"optimizer.weight_decay = 1e-45", "0 or magnitude"}},
      {"[runtime]\ncollective_timeout_s = 1e300", {"runtime.collective_timeout_s", "<= 1e6"}},
      {"[runtime]\nio_timeout_s = 1e7", {"runtime.io_timeout_s", "<= 1e6"}},
      {"[parallel]\npp = 2\npp_layers = [9223372036854775807, 2]", {"parallel.pp_layers", "0..model.num_layers"}},
      {"[model]\nhidden_size = 2147483646\nnum_heads = 1\nnum_kv_heads = 1\nnum_layers = 2147483647\n"
       "ffn_hidden_size = 2147483647",
       {"parameters: their training state (16 bytes each) does not fit in 64-bit sizes"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    try {
      parse_config(std::string(kMinimal) + c.text + "\n", kFile);
      ADD_FAILURE() << "accepted";
    } catch (const UserError& e) {
      for (const std::string& f : c.fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  }
  expect_error(moe + "[training]\nmicro_batch = 32768\nglobal_batch = 32768\nseq_len = 65536",
               {"training.micro_batch · seq_len · moe.top_k = 32768 · 65536 · 2"});
  expect_error(moe + "capacity_factor = 9.0\n", {"moe.capacity_factor = 9", "<= moe.num_experts = 8"});
  expect_error(moe + "topk_scaling = 1e300\n", {"moe.topk_scaling = 1e+300", "fp32"});
  // At the limits themselves the config loads.
  EXPECT_NO_THROW(parse_config(moe + "capacity_factor = 8.0\n", kFile));
  EXPECT_NO_THROW(parse_config(std::string(kMinimal) + "[optimizer]\nweight_decay = 0.0\n", kFile));
}

// With pad_to_capacity, every expert gets ceil(T·k/E·cf) rows of the permuted
// buffer, whose i32 row indices must address E of them.
TEST(Config, PaddedCapacityRowsMustFitI32) {
  Config c = parse_config(std::string(kMinimal) +
                              "[moe]\nnum_experts = 8\ncapacity_factor = 8.0\npad_to_capacity = true\n"
                              "[training]\nmicro_batch = 4096\nglobal_batch = 4096\nseq_len = 65536\n",
                          kFile);
  try {
    validate_for_world(c, 1);
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("permuted rows, more than the 2147483647"), std::string::npos) << e.what();
  }
  c.moe.capacity.capacity_factor = 1.0;  // 8 · ceil(2^28 · 2 / 8) = 2^29 rows
  EXPECT_NO_THROW(validate_for_world(c, 1));
}

TEST(Config, MachineLimits) {
  Config c = parse_config(kMinimal, kFile, {"runtime.threads=100000"});
  try {
    validate_for_machine(c, 1, 1);
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--set runtime.threads=100000: runtime.threads = 100000: must be <= "),
              std::string::npos)
        << e.what();
  }
  // A model whose state alone exceeds any machine: the bytes it needs, named.
  c = parse_config(kMinimal, kFile, {"model.num_layers=100000000"});
  try {
    validate_for_machine(c, 1, 1);
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("needs at least 3."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TB) per rank"), std::string::npos) << e.what();
  }
  // A model that fits is accepted.
  c = parse_config(kMinimal, kFile, {"model.num_layers=100"});
  EXPECT_NO_THROW(validate_for_machine(c, 1, 1));
}

// Past the state's lower bound, training is held to the plan's count of the
// worst stage's state and activations (equal to the measured ledger): ranks
// sharing the node are set so that the plan's figure just fits, then just
// does not. With recompute = "full" a layer keeps only its input, so the same
// batch fits; evaluation keeps no activations for backward.
TEST(Config, MachineLimitsCountThePlansActivations) {
  const std::vector<std::string> big_batch = {"training.micro_batch=64", "training.global_batch=64"};
  const Config c = parse_config(kMinimal, kFile, big_batch);
  const plan::LayoutPlan lp =
      plan::plan_layout(plan::plan_input(c), comm::Layout(1, comm::LayoutOptions{}), plan::Machine{});
  ASSERT_EQ(lp.stages.size(), 1u);
  const long double need = static_cast<long double>(lp.stages[0].total());
  const long double memory = static_cast<long double>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  ASSERT_GT(lp.stages[0].activations, 2 * lp.stages[0].state.total()) << "the case is about activations";
  const int fits = static_cast<int>(memory / need);
  ASSERT_GE(fits, 1);
  std::printf("[machine limits] plan %.0Lf B per rank, %d ranks fit in %.3Lg B\n", need, fits, memory);
  EXPECT_NO_THROW(validate_for_machine(c, 1, fits));
  try {
    validate_for_machine(c, 1, fits + 1);
    ADD_FAILURE() << "accepted at " << fits + 1 << " ranks per node";
  } catch (const UserError& e) {
    for (const char* needle : {"training needs ", "activations held for backward", "as `origami plan` counts them",
                               "training.recompute = \"full\""})
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << needle << " in " << e.what();
  }
  std::vector<std::string> recompute = big_batch;
  recompute.push_back("training.recompute=full");
  EXPECT_NO_THROW(validate_for_machine(parse_config(kMinimal, kFile, recompute), 1, fits + 1));
  EXPECT_NO_THROW(validate_for_machine(c, 1, fits + 1, /*trains=*/false));
}

// The canonical text lists every key once with its resolved value, so two
// ranks with the same config produce the same bytes, and any change shows.
TEST(Config, CanonicalTextHasEveryResolvedKey) {
  const Config a = parse_config(kMinimal, kFile);
  const std::string t = canonical_text(a);
  EXPECT_NE(t.find("model.vocab_size = 257\n"), std::string::npos) << t;
  EXPECT_NE(t.find("optimizer.lr = 0.003\n"), std::string::npos) << t;
  EXPECT_NE(t.find("moe.score_function = \"softmax\"\n"), std::string::npos) << t;
  EXPECT_NE(t.find("data.path = \"data/x\"\n"), std::string::npos) << t;
  EXPECT_EQ(t.find("moe.capacity_factor"), std::string::npos) << "absent optional key:\n" << t;
  EXPECT_EQ(canonical_text(parse_config(kMinimal, "other.toml")), t) << "the file name is not part of it";
  EXPECT_NE(canonical_text(parse_config(kMinimal, kFile, {"optimizer.lr=1e-3"})), t);
  EXPECT_NE(canonical_text(parse_config(kMinimal, kFile, {"moe.capacity_factor=1.5"})).find("moe.capacity_factor = 1.5"),
            std::string::npos);
}

TEST(Config, OriginNamesTheOverride) {
  const Config c = parse_config(kMinimal, kFile, {"optimizer.lr=1e-3"});
  EXPECT_EQ(c.origin("optimizer.lr"), "--set optimizer.lr=1e-3");
  EXPECT_EQ(c.origin("model.vocab_size"), kFile);
}

}  // namespace
}  // namespace origami
