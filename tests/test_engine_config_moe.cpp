// Config loader, the [moe] section: its keys and defaults, its enums (a bad
// value names the allowed ones) and the routing rules that tie its keys
// together (groups divide the experts, top_k against the kept groups,
// pad_to_capacity needs a capacity). The other sections are
// tests/test_engine_config.cpp.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "config_test_util.h"
#include "engine/config.h"
#include "kernels/check.h"

namespace origami {
namespace {

using testing::expect_error;
using testing::kFile;
using testing::kMinimal;

TEST(Config, MoeLayersAreAvailable) {
  const Config c = parse_config(std::string(kMinimal) + "[moe]\nnum_experts = 8\ntop_k = 2\n", kFile);
  EXPECT_EQ(c.moe.router.num_experts, 8);
  EXPECT_TRUE(c.moe.is_moe_layer(0));
  EXPECT_EQ(c.moe.expert_ffn(c.model.ffn_hidden_size), c.model.ffn_hidden_size);  // 0: the dense width
  EXPECT_NO_THROW(validate_for_world(c, 1));
  // Every enum value is accepted.
  for (const char* v : {"softmax", "sigmoid"})
    EXPECT_NO_THROW(parse_config(std::string(kMinimal) + "[moe]\nscore_function = \"" + v + "\"\n", kFile)) << v;
  const std::pair<const char*, moe::LoadBalancing> lbs[] = {{"aux_loss", moe::LoadBalancing::aux_loss},
                                                            {"seq_aux_loss", moe::LoadBalancing::seq_aux_loss},
                                                            {"global_aux_loss", moe::LoadBalancing::global_aux_loss},
                                                            {"none", moe::LoadBalancing::none}};
  for (const auto& [name, value] : lbs)
    EXPECT_EQ(parse_config(kMinimal, kFile, {std::string("moe.load_balancing=") + name}).moe.router.load_balancing,
              value)
        << name;
  EXPECT_EQ(parse_config(kMinimal, kFile, {"moe.drop_policy=probs"}).moe.capacity.drop_policy, moe::DropPolicy::probs);
  EXPECT_EQ(parse_config(kMinimal, kFile, {"moe.drop_policy=position"}).moe.capacity.drop_policy,
            moe::DropPolicy::position);
  // An integer capacity factor is a number; a capacity without padding is fine.
  const Config cap = parse_config(kMinimal, kFile, {"moe.capacity_factor=2"});
  ASSERT_TRUE(cap.moe.capacity.capacity_factor.has_value());
  EXPECT_EQ(*cap.moe.capacity.capacity_factor, 2.0);
  EXPECT_FALSE(cap.moe.capacity.pad_to_capacity);
  // The load balancing coefficients may be 0.
  EXPECT_NO_THROW(parse_config(kMinimal, kFile, {"moe.aux_loss_coeff=0", "moe.z_loss_coeff=0",
                                                 "moe.bias_update_rate=0"}));
}

TEST(Config, MoeBadEnumNamesValueAndAllowed) {
  expect_error(std::string(kMinimal) + "[moe]\nscore_function = \"softmx\"\n",
               {kFile, "moe.score_function = \"softmx\"", "must be one of \"softmax\", \"sigmoid\"",
                "did you mean \"softmax\""});
  expect_error(std::string(kMinimal) + "[moe]\nscore_function = \"relu\"\n",
               {kFile, "moe.score_function = \"relu\"", "must be one of \"softmax\", \"sigmoid\""});
  expect_error(std::string(kMinimal) + "[moe]\nload_balancing = \"sinkhorn\"\n",
               {kFile, "moe.load_balancing = \"sinkhorn\"",
                "must be one of \"aux_loss\", \"seq_aux_loss\", \"global_aux_loss\", \"none\""});
  expect_error(std::string(kMinimal) + "[moe]\ndrop_policy = \"random\"\n",
               {kFile, "moe.drop_policy = \"random\"", "must be one of \"probs\", \"position\""});
  expect_error(std::string(kMinimal) + "[runtime]\ndevice = \"gpu\"\n",
               {kFile, "runtime.device = \"gpu\"", "must be one of \"cpu\", \"cuda\", \"auto\""});
  expect_error(std::string(kMinimal) + "[runtime]\nprecision = \"fp16\"\n",
               {kFile, "runtime.precision = \"fp16\"", "must be one of \"auto\", \"fp32\", \"bf16\""});
  // Exact spelling only.
  expect_error(std::string(kMinimal) + "[moe]\nscore_function = \"Softmax\"\n",
               {kFile, "moe.score_function = \"Softmax\"", "must be one of", "did you mean \"softmax\""});
  // Wrong types name the allowed values too.
  expect_error(std::string(kMinimal) + "[moe]\nscore_function = 1\n",
               {kFile, "moe.score_function = 1", "expected a string, one of \"softmax\", \"sigmoid\"",
                "got an integer"});
  expect_error(std::string(kMinimal) + "[moe]\nnormalize_topk = \"yes\"\n",
               {kFile, "moe.normalize_topk", "expected a boolean", "got a string"});
  expect_error(std::string(kMinimal) + "[moe]\nexpert_bias = 1\n", {kFile, "moe.expert_bias", "expected a boolean"});
  expect_error(std::string(kMinimal) + "[moe]\npad_to_capacity = 0\n",
               {kFile, "moe.pad_to_capacity", "expected a boolean"});
  expect_error(std::string(kMinimal) + "[moe]\ncapacity_factor = \"1.5\"\n",
               {kFile, "moe.capacity_factor = \"1.5\"", "expected a number, got a string"});
  expect_error(std::string(kMinimal) + "[moe]\ntopk_scaling = true\n",
               {kFile, "moe.topk_scaling = true", "expected a number, got a boolean"});
  // An override names itself.
  expect_error(kMinimal, {"--set moe.drop_policy=first", "moe.drop_policy = \"first\"", "must be one of"},
               {"moe.drop_policy=first"});
}

TEST(Config, MoeGroupsDivideExperts) {
  expect_error(std::string(kMinimal) + "[moe]\nnum_experts = 8\nnum_groups = 3\ngroup_topk = 1\n",
               {kFile, "moe.num_experts = 8 must be divisible by moe.num_groups = 3"});
  EXPECT_NO_THROW(parse_config(std::string(kMinimal) + "[moe]\nnum_experts = 8\nnum_groups = 4\ngroup_topk = 2\n",
                               kFile));
  // Without experts there is nothing to group.
  EXPECT_NO_THROW(parse_config(std::string(kMinimal) + "[moe]\nnum_groups = 3\n", kFile));
}

TEST(Config, MoeTopKDivisibleByGroupTopK) {
  expect_error(std::string(kMinimal) + "[moe]\nnum_experts = 8\ntop_k = 3\nnum_groups = 4\ngroup_topk = 2\n",
               {kFile, "moe.top_k = 3 must be divisible by moe.group_topk = 2"});
  // With one group there is no group score, so top_k is free.
  EXPECT_NO_THROW(parse_config(std::string(kMinimal) + "[moe]\nnum_experts = 8\ntop_k = 3\n", kFile));
  expect_error(kMinimal, {"--set moe.group_topk=2", "moe.top_k = 3 must be divisible by moe.group_topk = 2"},
               {"moe.num_experts=8", "moe.top_k=3", "moe.num_groups=4", "moe.group_topk=2"});
}

TEST(Config, MoeTopKReachableInKeptGroups) {
  // 8 experts in 4 groups of 2; keeping 1 group leaves 2 experts for top-4.
  expect_error(std::string(kMinimal) + "[moe]\nnum_experts = 8\ntop_k = 4\nnum_groups = 4\ngroup_topk = 1\n",
               {kFile, "moe.top_k = 4 must be <= moe.group_topk · (moe.num_experts / moe.num_groups) = 1 · (8 / 4) = 2"});
  EXPECT_NO_THROW(
      parse_config(std::string(kMinimal) + "[moe]\nnum_experts = 8\ntop_k = 4\nnum_groups = 4\ngroup_topk = 2\n",
                   kFile));
}

TEST(Config, MoePadToCapacityNeedsCapacity) {
  expect_error(std::string(kMinimal) + "[moe]\npad_to_capacity = true\n",
               {kFile, "moe.pad_to_capacity = true requires moe.capacity_factor"});
  expect_error(kMinimal, {"--set moe.pad_to_capacity=true", "requires moe.capacity_factor"},
               {"moe.pad_to_capacity=true"});
  EXPECT_TRUE(
      parse_config(std::string(kMinimal) + "[moe]\npad_to_capacity = true\ncapacity_factor = 1.0\n", kFile)
          .moe.capacity.pad_to_capacity);
}

TEST(Config, MoeUnknownKeySuggests) {
  expect_error(std::string(kMinimal) + "[moe]\nnum_expert = 8\n",
               {kFile, "unknown key 'moe.num_expert'", "did you mean 'moe.num_experts'"});
  expect_error(std::string(kMinimal) + "[moe]\ntopk = 2\n", {kFile, "unknown key 'moe.topk'", "did you mean"});
  expect_error(std::string(kMinimal) + "[model]\nnum_experts = 8\n",
               {kFile, "unknown key 'model.num_experts'", "did you mean 'moe.num_experts'"});
}

}  // namespace
}  // namespace origami
