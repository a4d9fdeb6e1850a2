// One statement of the layout rules (engine/config.h layout_problem): train
// (validate_for_world) and the planner (plan_layout, and rank_layouts'
// candidates) accept and reject exactly the same layouts, with the same
// message, over every factorization (tp, cp, pp, ep, etp) of every world size
// up to 16, for tiny-moe (GQA, top-2 of 8 experts), a GQA model with a shared
// expert and seq_aux_loss, and tiny-dense. Before they shared the function,
// the planner required seq_len % (2·cp·tp) and tp | the shared expert while
// train required micro_batch·seq_len/cp % tp, and only train knew the
// seq_aux_loss, capacity and dense-free-MLP rules.
#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <tuple>

#include "engine/config.h"
#include "engine/plan.h"
#include "kernels/check.h"

namespace origami {
namespace {

using Sizes = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // tp, cp, pp, ep, etp

Config load(const std::string& name, const std::vector<std::string>& overrides = {}) {
  return load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/" + name, overrides);
}

std::vector<Config> configs() {
  return {
      load("tiny-moe.toml"),
      // GQA 6 heads over 2 kv heads, a shared expert whose width no tp here
      // divides (it runs whole on every tp rank), per-sequence balancing
      // (refused under tp·cp > 1), and seq_len 96 (divisible by 2·cp for cp
      // 2 and 4, but not 2·cp·tp for every tp).
      load("tiny-moe.toml", {"model.hidden_size=192", "model.num_heads=6", "model.num_kv_heads=2",
                             "moe.shared_expert_hidden_size=90", "moe.load_balancing=\"seq_aux_loss\"",
                             "training.seq_len=96", "training.micro_batch=1", "training.global_batch=16"}),
      load("tiny-dense.toml"),
  };
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

TEST(LayoutRules, TrainAndPlanAcceptAndRejectTheSameLayoutsWithTheSameMessage) {
  int64_t checked = 0, accepted = 0;
  for (const Config& base : configs()) {
    SCOPED_TRACE(base.source + " moe " + std::to_string(base.moe.router.num_experts));
    const plan::PlanInput in = plan::plan_input(base);
    for (int64_t world = 1; world <= 16; ++world) {
      const std::vector<int64_t> d = divisors(world);
      std::set<Sizes> train_accepts;
      for (int64_t tp : d)
        for (int64_t cp : d)
          for (int64_t pp : d)
            for (int64_t ep : d)
              for (int64_t etp : d) {
                SCOPED_TRACE(::testing::Message() << "W " << world << " tp " << tp << " cp " << cp << " pp " << pp
                                                  << " ep " << ep << " etp " << etp);
                Config c = base;
                c.parallel.tp = tp, c.parallel.cp = cp, c.parallel.pp = pp, c.parallel.ep = ep,
                c.parallel.etp = etp;
                std::string train_error;
                try {
                  validate_for_world(c, static_cast<int>(world));
                } catch (const UserError& e) {
                  train_error = e.what();
                }
                ++checked;
                // What train says is the source, the world size and the rule.
                const std::string rule = layout_problem(c, world);
                EXPECT_EQ(train_error.empty(), rule.empty());
                if (!rule.empty()) {
                  EXPECT_EQ(train_error, base.sources() + ": on " + std::to_string(world) + " rank(s): " + rule);
                }
                // The planner, on every layout comm::Layout itself accepts.
                std::optional<comm::Layout> layout;
                try {
                  layout.emplace(world,
                                 comm::LayoutOptions{tp, cp, pp, ep, etp, c.parallel.order, c.moe.router.num_experts});
                } catch (const UserError& e) {
                  EXPECT_TRUE(rule.starts_with(std::string(e.what()) + " (TP, CP, PP, EP, ETP: parallel.tp,"))
                      << rule << "\ncomm::Layout's rule comes first, with the config keys of its axes";
                  continue;
                }
                EXPECT_EQ(plan::layout_problem(in, *layout), rule);
                std::string plan_error;
                try {
                  plan::plan_layout(in, *layout, plan::Machine{});
                } catch (const UserError& e) {
                  plan_error = e.what();
                }
                EXPECT_EQ(plan_error, rule);
                if (rule.empty()) train_accepts.insert({tp, cp, pp, ep, etp});
              }
      // The ranked candidates are exactly what train accepts (a dense
      // model's candidates leave ep = etp = 1, which changes nothing there).
      std::set<Sizes> ranked;
      for (const plan::LayoutPlan& p : plan::rank_layouts(in, world, base.parallel.order, plan::Machine{}))
        ranked.insert({p.tp, p.cp, p.pp, p.ep, p.etp});
      if (base.moe.router.num_experts == 0)
        std::erase_if(train_accepts, [](const Sizes& s) { return std::get<3>(s) > 1 || std::get<4>(s) > 1; });
      EXPECT_EQ(ranked, train_accepts) << "world " << world;
      accepted += static_cast<int64_t>(train_accepts.size());
    }
  }
  std::printf("[layout rules] %lld layouts checked, %lld accepted\n", static_cast<long long>(checked),
              static_cast<long long>(accepted));
  EXPECT_GT(accepted, 50);
  EXPECT_GT(checked - accepted, 1000);
}

// The rules that used to differ between the two, one by one.
TEST(LayoutRules, FormerDisagreementsNowFollowTheEngine) {
  const Config moe = load("tiny-moe.toml");
  auto rule = [](Config c, int64_t tp, int64_t cp, int64_t world) {
    c.parallel.tp = tp, c.parallel.cp = cp;
    return layout_problem(c, world);
  };
  // Sequence parallelism splits a micro-batch's tokens, not each sample:
  // seq_len 36 with cp 2 is 4 chunks of 9 tokens, micro_batch 1 · 36 / 2 =
  // 18 tokens per cp rank, which tp 2 splits (the planner refused: 36 % 8).
  Config seq = moe;
  seq.training.seq_len = 36;
  seq.training.micro_batch = 1;
  EXPECT_EQ(rule(seq, 2, 2, 4), "");
  // A shared expert runs whole on each tp rank: its width need not divide tp.
  Config shared = moe;
  shared.moe.shared_expert_hidden_size = 90;
  EXPECT_EQ(rule(shared, 2, 1, 2), "");
  // Without dense layers the dense ffn is not split.
  Config all_moe = moe;
  all_moe.moe.first_dense_layers = 0;
  all_moe.model.ffn_hidden_size = 129;
  all_moe.moe.ffn_hidden_size = 128;
  EXPECT_EQ(rule(all_moe, 2, 1, 2), "");
  all_moe.moe.first_dense_layers = 1;
  EXPECT_NE(rule(all_moe, 2, 1, 2).find("must divide model.ffn_hidden_size = 129"), std::string::npos);
  // Explicit stages may be empty, so pp may exceed the layer count.
  Config stages = moe;
  stages.parallel.pp = 8;
  stages.parallel.pp_layers = {1, 1, 0, 1, 0, 1, 0, 0};
  EXPECT_EQ(layout_problem(stages, 8), "");
  const plan::PlanInput in = plan::plan_input(stages);
  const comm::Layout layout(8, comm::LayoutOptions{1, 1, 8, 1, 1, stages.parallel.order, 8});
  EXPECT_EQ(plan::layout_problem(in, layout), "");
}

}  // namespace
}  // namespace origami
