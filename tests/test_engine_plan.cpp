// The planner (engine/plan.h): parameter counts against the Model itself,
// the §6 state formulas (the 7B example of the documents exactly, fp32 at
// N = 4, the padding rule), saved activations against the measured ledger
// of a real forward, communication volumes on hand-worked layouts, the
// shipped Mixtral / DeepSeek configs, and the layout enumeration.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <map>
#include <memory>
#include <random>

#include "engine/model.h"
#include "engine/plan.h"
#include "grad_check.h"
#include "kernels/allocator.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using comm::GroupKind;

Config load(const std::string& name, const std::vector<std::string>& overrides = {}) {
  return load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/" + name, overrides);
}

comm::Layout layout_of(const Config& cfg, int64_t world) {
  const ParallelConfig& p = cfg.parallel;
  return comm::Layout(world,
                      comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, cfg.moe.router.num_experts});
}

// tiny-dense, tiny-moe, and tiny-moe with a shared expert.
std::vector<Config> tiny_configs() {
  return {load("tiny-dense.toml"), load("tiny-moe.toml"), load("tiny-moe.toml", {"moe.shared_expert_hidden_size=96"})};
}

// One model per config for the whole binary (initialization is the slow part).
Model& model_of(const Config& cfg) {
  static TrackedAllocator& allocator = TrackedAllocator::host();  // first built, so destroyed after the models
  static std::map<std::string, std::unique_ptr<Model>> models;
  (void)allocator;
  const std::string key = cfg.source + "/" + std::to_string(cfg.moe.shared_expert_hidden_size) + "/" +
                          std::to_string(cfg.moe.capacity.capacity_factor.value_or(0)) + "/" +
                          std::to_string(cfg.moe.capacity.pad_to_capacity);
  auto& m = models[key];
  if (!m) m = std::make_unique<Model>(ctx, cfg.model, 3, cfg.moe);
  return *m;
}

TEST(Plan, UnitCountsEqualTheModelsOnOneRank) {
  for (const Config& cfg : tiny_configs()) {
    SCOPED_TRACE(cfg.source + (cfg.moe.shared_expert_hidden_size ? " + shared expert" : ""));
    const Model& model = model_of(cfg);
    const std::vector<ParamUnit>& units = model.params().units();
    const std::vector<plan::UnitPlan> planned = plan::plan_units(plan::plan_input(cfg), layout_of(cfg, 1));
    ASSERT_EQ(planned.size(), units.size());
    for (size_t i = 0; i < units.size(); ++i) {
      EXPECT_EQ(planned[i].name, units[i].name);
      EXPECT_EQ(planned[i].expert, units[i].expert) << units[i].name;
      EXPECT_EQ(planned[i].numel, units[i].numel) << units[i].name;
      EXPECT_EQ(planned[i].local, units[i].numel) << units[i].name;  // one rank holds everything
    }
    const plan::ParamCounts c = plan::param_counts(cfg.model, cfg.moe);
    EXPECT_EQ(c.total, model.params().total_params());
    EXPECT_EQ(c.matmul_active, model.active_matmul_params());
    const plan::LayoutPlan lp = plan::plan_layout(plan::plan_input(cfg), layout_of(cfg, 1), plan::Machine{});
    EXPECT_DOUBLE_EQ(lp.flops, model.training_flops(cfg.training.global_batch, cfg.training.seq_len).total());
  }
}

TEST(Plan, SevenBillionDenseExampleExactly) {
  // ARCHITECTURE.md §6: 16 bytes/param; stages 0-3 on 8 ranks with bf16.
  const int64_t P = 7'000'000'000;
  const int64_t expected[4] = {112'000'000'000, 38'500'000'000, 26'250'000'000, 14'000'000'000};
  for (int s = 0; s < 4; ++s) EXPECT_EQ(plan::zero_state_bytes(P, 8, s, plan::Recipe::bf16).total(), expected[s]) << s;
  // bf16 by category at stage 2: 2 param whole, 2 grad + 12 optim sharded.
  const plan::StateBytes s2 = plan::zero_state_bytes(P, 8, 2, plan::Recipe::bf16);
  EXPECT_EQ(s2.param, 2 * P);
  EXPECT_EQ(s2.grad, 2 * P / 8);
  EXPECT_EQ(s2.optim, 12 * P / 8);
}

TEST(Plan, Fp32StageFormulasAtFourRanksWithPadding) {
  const int64_t n = 1001, padded = 1004;  // ceil(1001/4)·4
  auto total = [&](int s) { return plan::zero_state_bytes(n, 4, s, plan::Recipe::fp32).total(); };
  EXPECT_EQ(total(0), 16 * n);  // stage 0 shards nothing, so nothing is padded
  EXPECT_EQ(total(1), 8 * padded + 8 * padded / 4);
  EXPECT_EQ(total(2), 4 * padded + 12 * padded / 4);
  EXPECT_EQ(total(3), 16 * padded / 4);
  const plan::StateBytes s1 = plan::zero_state_bytes(n, 4, 1, plan::Recipe::fp32);
  EXPECT_EQ(s1.param, 4 * padded);
  EXPECT_EQ(s1.grad, 4 * padded);
  EXPECT_EQ(s1.optim, 8 * padded / 4);
  // One rank: whole at every stage.
  for (int s = 0; s < 4; ++s) EXPECT_EQ(plan::zero_state_bytes(n, 1, s, plan::Recipe::fp32).total(), 16 * n);
}

TEST(Plan, PaddingRule) {
  EXPECT_EQ(plan::padded_numel(10, 4, 1), 12);
  EXPECT_EQ(plan::padded_numel(12, 4, 3), 12);
  EXPECT_EQ(plan::padded_numel(10, 4, 0), 10);
  EXPECT_EQ(plan::padded_numel(10, 1, 3), 10);
  // Every unit of a TP 2 / EP 2 layout of tiny-moe (vocab 257 splits unevenly).
  const Config cfg = load("tiny-moe.toml", {"parallel.tp=2", "parallel.ep=2"});
  const comm::Layout layout = layout_of(cfg, 6);  // DP 3, EDP 3
  for (const plan::UnitPlan& u : plan::plan_units(plan::plan_input(cfg), layout)) {
    EXPECT_EQ(u.group, 3) << u.name;
    EXPECT_EQ(u.padded, (u.local + 2) / 3 * 3) << u.name;
    EXPECT_EQ(u.state.total(), 16 * u.padded / 3) << u.name;  // stage 3
  }
  const plan::UnitPlan emb = plan::plan_units(plan::plan_input(cfg), layout).front();
  EXPECT_EQ(emb.local, 129 * 128);  // ceil(257/2) vocab rows
}

// Saved activations after one forward = the plan's per-micro-batch figure,
// through the tracked allocator's activation ledger (one rank: tp = cp = 1).
TEST(Plan, ActivationsEqualTheMeasuredLedgerOfAForward) {
  std::vector<Config> configs = tiny_configs();
  configs.push_back(load("tiny-moe.toml", {"moe.capacity_factor=1.25", "moe.pad_to_capacity=true"}));
  for (Config& cfg : configs)
    for (const Recompute recompute : {Recompute::none, Recompute::moe, Recompute::full}) {
    cfg.training.micro_batch = 2;  // a small forward (the weights do not depend on it)
    cfg.training.seq_len = 64;
    cfg.training.recompute = recompute;
    SCOPED_TRACE(cfg.source + " recompute " + std::to_string(static_cast<int>(recompute)));
    Model& model = model_of(cfg);
    model.set_recompute(recompute);
    const plan::ActivationBytes a = plan::activation_bytes(plan::plan_input(cfg), layout_of(cfg, 1));
    int64_t dense = 0, moe = 0;
    for (int64_t l = 0; l < cfg.model.num_layers; ++l) (cfg.moe.is_moe_layer(l) ? moe : dense) += 1;
    const int64_t expected = dense * a.dense_layer + moe * a.moe_layer + a.every_stage + a.first_stage + a.last_stage;
    std::mt19937 rng(testing::test_seed(4));
    Tensor tokens =
        testing::random_tokens(cfg.training.micro_batch, cfg.training.seq_len + 1, cfg.model.vocab_size, rng);
    const auto act = static_cast<size_t>(MemCategory::activation);
    const int64_t before = TrackedAllocator::host().snapshot().current[act];
    {
      ModelSaved saved;
      model.forward(tokens, saved);
      EXPECT_EQ(TrackedAllocator::host().snapshot().current[act] - before, expected);
    }
    EXPECT_GT(expected, 0);
    model.set_recompute(Recompute::none);
  }
}

// Under recompute "full" a backward rebuilds one layer at a time: its peak
// activation ledger above the held activations is the plan's rebuilt layer
// (the largest of the model's, as "none" keeps it) plus at most the working
// set a backward without recompute has (one rank).
TEST(Plan, RecomputeFullsRebuiltLayerIsWhatItsBackwardAddsToTheWorkingSet) {
  for (Config cfg : tiny_configs()) {
    cfg.training.micro_batch = 2;
    cfg.training.seq_len = 64;
    SCOPED_TRACE(cfg.source + (cfg.moe.shared_expert_hidden_size ? " + shared expert" : ""));
    Model& model = model_of(cfg);
    std::mt19937 rng(testing::test_seed(6));
    const Tensor tokens =
        testing::random_tokens(cfg.training.micro_batch, cfg.training.seq_len + 1, cfg.model.vocab_size, rng);
    const auto act = static_cast<size_t>(MemCategory::activation);
    // Held after the forward, and the backward's peak above it.
    auto measure = [&](Recompute mode) -> std::pair<int64_t, int64_t> {
      model.set_recompute(mode);
      const int64_t before = TrackedAllocator::host().snapshot().current[act];
      ModelSaved saved;
      model.forward(tokens, saved);
      const int64_t held = TrackedAllocator::host().snapshot().current[act] - before;
      TrackedAllocator::host().reset_peaks();
      StageGradIO io;
      io.lm_grad_scale = 1.0f / 128;
      model.backward(io, saved);
      const int64_t above = TrackedAllocator::host().snapshot().peak[act] - before - held;
      model.set_recompute(Recompute::none);
      return {held, above};
    };
    const auto [held_none, working_none] = measure(Recompute::none);
    const auto [held_full, working_full] = measure(Recompute::full);
    cfg.training.recompute = Recompute::full;
    const plan::LayoutPlan lp = plan::plan_layout(plan::plan_input(cfg), layout_of(cfg, 1), plan::Machine{});
    ASSERT_EQ(lp.stages.size(), 1u);
    const int64_t rebuild = lp.stages[0].rebuild;
    EXPECT_EQ(rebuild, std::max(lp.act.rebuild_dense_layer, lp.act.rebuild_moe_layer));
    EXPECT_EQ(lp.stages[0].activations, held_full);
    EXPECT_GE(working_full, rebuild);
    EXPECT_LE(working_full - rebuild, working_none);
    EXPECT_GT(working_none, 0);
    std::printf("recompute full: held %lld B, backward peak above it %lld B = rebuilt layer %lld + %lld "
                "(without recompute: held %lld, above it %lld)\n",
                static_cast<long long>(held_full), static_cast<long long>(working_full),
                static_cast<long long>(rebuild), static_cast<long long>(working_full - rebuild),
                static_cast<long long>(held_none), static_cast<long long>(working_none));
    for (const Recompute other : {Recompute::none, Recompute::moe}) {
      cfg.training.recompute = other;
      const plan::LayoutPlan o = plan::plan_layout(plan::plan_input(cfg), layout_of(cfg, 1), plan::Machine{});
      EXPECT_EQ(o.stages[0].rebuild, 0);
      EXPECT_EQ(o.act.rebuild_dense_layer + o.act.rebuild_moe_layer, 0);
    }
  }
}

// A deferred backward (StageGradIO::defer) frees the saved activations and
// keeps only what the pending weight gradients read: the activation ledger
// then holds exactly the plan's weight_pending_* figure (one rank), in every
// recompute mode, and nothing once the W pass ran.
TEST(Plan, PendingWeightGradientsEqualTheMeasuredLedgerOfADeferredBackward) {
  std::vector<Config> configs = tiny_configs();
  configs.push_back(load("tiny-moe.toml", {"moe.capacity_factor=1.25", "moe.pad_to_capacity=true"}));
  for (Config& cfg : configs) {
    cfg.training.micro_batch = 2;
    cfg.training.seq_len = 64;
    SCOPED_TRACE(cfg.source + (cfg.moe.shared_expert_hidden_size ? " + shared expert" : ""));
    Model& model = model_of(cfg);
    const plan::ActivationBytes a = plan::activation_bytes(plan::plan_input(cfg), layout_of(cfg, 1));
    int64_t dense = 0, moe = 0;
    for (int64_t l = 0; l < cfg.model.num_layers; ++l) (cfg.moe.is_moe_layer(l) ? moe : dense) += 1;
    const int64_t saved_bytes =
        dense * a.dense_layer + moe * a.moe_layer + a.every_stage + a.first_stage + a.last_stage;
    const int64_t pending = dense * a.weight_pending_dense_layer + moe * a.weight_pending_moe_layer +
                            a.weight_pending_first_stage + a.weight_pending_last_stage;
    std::mt19937 rng(testing::test_seed(5));
    const Tensor tokens =
        testing::random_tokens(cfg.training.micro_batch, cfg.training.seq_len + 1, cfg.model.vocab_size, rng);
    const auto act = static_cast<size_t>(MemCategory::activation);
    for (Recompute mode : {Recompute::none, Recompute::moe, Recompute::full}) {
      SCOPED_TRACE("recompute " + std::to_string(static_cast<int>(mode)));
      model.set_recompute(mode);
      const int64_t before = TrackedAllocator::host().snapshot().current[act];
      ModelSaved saved;
      model.forward(tokens, saved);
      WeightPass pass;
      StageGradIO io;
      io.lm_grad_scale = 1.0f / 128;
      io.defer = &pass;
      model.backward(io, saved);
      EXPECT_EQ(TrackedAllocator::host().snapshot().current[act] - before, pending);
      model.weight_backward(pass, nullptr);
      EXPECT_EQ(TrackedAllocator::host().snapshot().current[act], before);
    }
    model.set_recompute(Recompute::none);
    EXPECT_GT(pending, 0);
    if (cfg.source.find("tiny-moe") != std::string::npos && !cfg.moe.shared_expert_hidden_size &&
        !cfg.moe.capacity.capacity_factor)
      std::printf("tiny-moe, micro-batch 2 x 64: saved activations %lld bytes (dense layer %lld, MoE layer %lld), "
                  "pending W %lld bytes (dense layer %lld, MoE layer %lld, first stage %lld, last stage %lld)\n",
                  static_cast<long long>(saved_bytes), static_cast<long long>(a.dense_layer),
                  static_cast<long long>(a.moe_layer), static_cast<long long>(pending),
                  static_cast<long long>(a.weight_pending_dense_layer),
                  static_cast<long long>(a.weight_pending_moe_layer),
                  static_cast<long long>(a.weight_pending_first_stage),
                  static_cast<long long>(a.weight_pending_last_stage));
  }
}

double group_bytes(const plan::LayoutPlan& p, int64_t stage, GroupKind g) { return p.comm[stage].bytes(g); }

// An explicit parallel.pp_layers that spells out the even split is the even
// split, for 1F1B (pp counts) and the interleaved schedule (pp · v counts,
// in virtual-stage order; it was refused as a list of pp counts).
TEST(Plan, ExplicitStageLayersEqualToTheEvenSplitPlanTheSame) {
  for (const auto& [sets, layers] :
       {std::pair{std::vector<std::string>{"parallel.pp=2"}, "parallel.pp_layers=[2, 2]"},
        std::pair{std::vector<std::string>{"parallel.pp=2", "parallel.pp_schedule=interleaved",
                                           "parallel.virtual_stages=2", "training.global_batch=32"},
                  "parallel.pp_layers=[1, 1, 1, 1]"}}) {
    SCOPED_TRACE(layers);
    std::vector<std::string> explicit_sets = sets;
    explicit_sets.push_back(layers);
    const Config even = load("tiny-moe.toml", sets), spelled = load("tiny-moe.toml", explicit_sets);
    ASSERT_FALSE(spelled.parallel.pp_layers.empty());
    const plan::LayoutPlan a = plan::plan_layout(plan::plan_input(even), layout_of(even, 2), plan::Machine{});
    const plan::LayoutPlan b = plan::plan_layout(plan::plan_input(spelled), layout_of(spelled, 2), plan::Machine{});
    ASSERT_EQ(a.stages.size(), b.stages.size());
    for (size_t s = 0; s < a.stages.size(); ++s) {
      EXPECT_EQ(a.stages[s].chunk_layers, b.stages[s].chunk_layers) << "stage " << s;
      EXPECT_EQ(a.stages[s].total(), b.stages[s].total()) << "stage " << s;
    }
    EXPECT_EQ(a.kv.peak_all_gather, b.kv.peak_all_gather);
    EXPECT_EQ(a.comm_bytes, b.comm_bytes);
  }
}

// tiny-moe on 4 ranks, EP 2, ZeRO-3: DP 4, EDP 2, m = 16 / (2·4) = 2.
TEST(Plan, CommOfAnExpertParallelLayoutByHand) {
  const Config cfg = load("tiny-moe.toml", {"parallel.ep=2"});
  const plan::LayoutPlan p = plan::plan_layout(plan::plan_input(cfg), layout_of(cfg, 4), plan::Machine{});
  ASSERT_EQ(p.micro_batches, 2);
  ASSERT_EQ(p.comm.size(), 1u);
  // edp: expert units of 4 experts · 3 · 128 · 128 = 196608 elements, N = 2:
  // 2m all-gathers + m reduce-scatters of (N−1)·98304·4 bytes, 3 MoE layers.
  EXPECT_EQ(group_bytes(p, 0, GroupKind::edp), 3.0 * 3 * 2 * 98304 * 4);
  // ep: R = 2·128·2 = 512 rows of 128 floats, half leave: 4 directions · m · 3 layers;
  // counts: 4 int64 to the one peer per dispatch.
  EXPECT_EQ(group_bytes(p, 0, GroupKind::ep), 4.0 * 2 * 3 * 512 * 128 * 4 / 2 + 2 * 3 * 4 * 8);
  // dp-cp, N = 4: dense units 32896 (embedding), 184576 (dense layer),
  // 50432 ×3 (MoE layers' attention + router), 33024 (final); shards of a
  // quarter; 3m passes of (N−1)·shard·4. The loss all-reduce sends nothing from rank 0.
  const double shards = (32896 + 184576 + 3 * 50432 + 33024) / 4.0;
  EXPECT_EQ(group_bytes(p, 0, GroupKind::dp_cp), 3.0 * 2 * 3 * shards * 4);
  // Bookkeeping, every MoE layer's records packed: routing counts over
  // tp-dp-cp (n = 4), one all_reduce of 3 layers × (8 + 8 + 2) = 54 i64 (rank
  // 0 owns 14); aux/z over dp (n = 4), one all_reduce of 3 × 2 f64 (owns 2).
  EXPECT_EQ(group_bytes(p, 0, GroupKind::tp_dp_cp), 2.0 * (54 - 14) * 8);
  EXPECT_EQ(group_bytes(p, 0, GroupKind::dp), 2.0 * (6 - 2) * 8);
  EXPECT_EQ(group_bytes(p, 0, GroupKind::tp), 0.0);
  EXPECT_EQ(group_bytes(p, 0, GroupKind::pp), 0.0);
}

// tiny-dense on 8 ranks as TP 2 × CP 2 × PP 2 (DP 1), ZeRO-3: m = 16 / 8 = 2,
// T = 8·128/2 = 512 tokens per cp rank, t = 256 per tp rank.
TEST(Plan, CommOfATensorContextPipelineLayoutByHand) {
  const Config cfg = load("tiny-dense.toml", {"parallel.tp=2", "parallel.cp=2", "parallel.pp=2"});
  const comm::Layout layout = layout_of(cfg, 8);
  const plan::LayoutPlan p = plan::plan_layout(plan::plan_input(cfg), layout, plan::Machine{});
  ASSERT_EQ(p.comm.size(), 2u);
  EXPECT_EQ(p.comm[1].rank, 4);  // the first rank of stage 1
  const comm::RankCoords c = layout.coords(4);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.tp + c.cp + c.dp, 0);
  const double ag = 256 * 128 * 4;  // (tp−1)·t·D·4 per all-gather or reduce-scatter
  // Stage 0 (layers 0-1): 4 sublayers · 2m each of AG and RS; embedding RS + AG per
  // micro-batch; replicated norm grads all_reduce(256) (rank 0 sends 2·128·4) per unit and micro-batch.
  EXPECT_EQ(group_bytes(p, 0, GroupKind::tp), 2 * 4 * 2 * 2 * ag + 2 * 2 * ag + 2 * 2 * 1024);
  // Stage 1 (layers 2-3, final): the same sublayers; head AG + RS; cross-entropy
  // all_reduce(512) and all_reduce(1024); replicated grads 2·all_reduce(256) + all_reduce(128).
  EXPECT_EQ(group_bytes(p, 1, GroupKind::tp),
            2 * 4 * 2 * 2 * ag + 2 * 2 * ag + 2 * (2 * 256 * 4 + 2 * 512 * 4) + 2 * (2 * 1024 + 2 * 64 * 4));
  // CP: K and V [512, 1 kv head · 32] all-gathered and reduce-scattered, per layer and micro-batch.
  const double kv = 2 * 512 * 32 * 4;
  EXPECT_EQ(group_bytes(p, 0, GroupKind::cp), 2 * 2 * 2 * kv);
  // PP: [8, 128/(2·2), 128] per micro-batch, forward from stage 0, backward from
  // stage 1; plus the step's bookkeeping over pp (2 ranks, ring all-reduce sends
  // 2·(count − own)·8): the loss (1 double: pp rank 0 owns it, rank 1 sends 16),
  // the grad norm's 2 partial sums (16 each) and the stages' busy/idle all-gather
  // (2 doubles: 16). No MoE layers, so no routing statistics.
  EXPECT_EQ(group_bytes(p, 0, GroupKind::pp), 2 * ag + 0 + 16 + 16);
  EXPECT_EQ(group_bytes(p, 1, GroupKind::pp), 2 * ag + 16 + 16 + 16);
  // dp-cp = cp (DP 1), N = 2: embedding 129·128, layers 256 + 49152/2 + 135168/2 each.
  EXPECT_EQ(group_bytes(p, 0, GroupKind::dp_cp), 3.0 * 2 * (129 * 128 + 2 * 92416) / 2 * 4);
  // 1F1B: stage 0 holds 2 micro-batches, stage 1 one.
  EXPECT_EQ(p.stages[0].in_flight, 2);
  EXPECT_EQ(p.stages[1].in_flight, 1);
}

// The same layout under ring attention (parallel.cp_comm = "ring"): per layer
// and micro-batch cp − 1 = 1 K, V block sent forward, 1 K, V and cp = 2 dK, dV
// blocks backward, of U = 2·512·32·4 bytes; the other groups are unchanged.
// K/V memory (plan::kv_memory): saved all_gather 2U + the gathered keys'
// positions (128 i32), ring U; transient all_gather (2cp + 1)U = 5U, ring
// (min(2, cp − 1) + 3)U = 4U; peak over stage 0's 2 layers × 2 micro-batches
// in flight.
TEST(Plan, RingAttentionCommAndKvMemoryByHand) {
  const Config cfg = load("tiny-dense.toml", {"parallel.tp=2", "parallel.cp=2", "parallel.pp=2"});
  const comm::Layout layout = layout_of(cfg, 8);
  plan::PlanInput in = plan::plan_input(cfg);
  ASSERT_EQ(in.cp_comm, dense::CpComm::all_gather);
  const plan::LayoutPlan gather = plan::plan_layout(in, layout, plan::Machine{});
  in.cp_comm = dense::CpComm::ring;
  const plan::LayoutPlan ring = plan::plan_layout(in, layout, plan::Machine{});
  const double U = 2 * 512 * 32 * 4;
  for (int64_t st = 0; st < 2; ++st) {
    EXPECT_EQ(group_bytes(ring, st, GroupKind::cp), 2 * 2 * (1 + 1 + 2) * U) << "stage " << st;
    EXPECT_EQ(group_bytes(gather, st, GroupKind::cp), 2 * 2 * 2 * U) << "stage " << st;
    for (GroupKind g : {GroupKind::tp, GroupKind::pp, GroupKind::dp_cp})
      EXPECT_EQ(group_bytes(ring, st, g), group_bytes(gather, st, g)) << "stage " << st;
    for (const plan::CommItem& i : ring.comm[st].items)
      if (i.group == GroupKind::cp) {
        EXPECT_EQ(i.op, comm::CommOp::send) << i.what;
      }
  }
  const plan::KvMemory& kv = ring.kv;
  EXPECT_EQ(kv.block, U);
  EXPECT_EQ(kv.saved_all_gather, 2 * U + 128 * 4);
  EXPECT_EQ(kv.saved_ring, U);
  EXPECT_EQ(kv.transient_all_gather, 5 * U);
  EXPECT_EQ(kv.wire_all_gather, 3 * U);
  EXPECT_EQ(kv.transient_ring, 4 * U);
  EXPECT_EQ(kv.peak_all_gather, 4 * (2 * U + 512) + 5 * U);
  EXPECT_EQ(kv.peak_ring, 4 * U + 4 * U);
  EXPECT_EQ(kv.step_comm_ring, group_bytes(ring, 0, GroupKind::cp));
  EXPECT_EQ(kv.step_comm_all_gather, group_bytes(gather, 0, GroupKind::cp));
  // The saved K, V are the only activation difference.
  EXPECT_EQ(gather.act.dense_layer - ring.act.dense_layer, kv.saved_all_gather - kv.saved_ring);
  EXPECT_EQ(gather.kv.peak_ring, kv.peak_ring) << "both methods are reported whichever is configured";
  // At cp = 1 the methods are the same module.
  const Config one = load("tiny-dense.toml", {"parallel.cp_comm=ring"});
  const plan::KvMemory k1 = plan::kv_memory(plan::plan_input(one), layout_of(one, 1));
  EXPECT_EQ(k1.saved_ring, k1.saved_all_gather);
  EXPECT_EQ(k1.peak_ring, k1.peak_all_gather);
  EXPECT_EQ(k1.step_comm_ring, 0);
}

TEST(Plan, ZeroStagesMoveTheSameBytesExceptStageThree) {
  // One micro-batch per step: stages 0-2 move 2·(N−1)/N, stage 3 1.5× that.
  Config cfg = load("tiny-dense.toml", {"training.micro_batch=4", "training.global_batch=16"});
  double bytes[4];
  for (int s = 0; s < 4; ++s) {
    plan::PlanInput in = plan::plan_input(cfg);
    in.zero_stage = s;
    bytes[s] = plan::plan_layout(in, layout_of(cfg, 4), plan::Machine{}).comm[0].bytes(GroupKind::dp_cp);
  }
  EXPECT_NEAR(bytes[1], bytes[0], 64);  // stage 0 all-reduces the unpadded unit
  EXPECT_EQ(bytes[2], bytes[1]);
  EXPECT_EQ(bytes[3], 1.5 * bytes[1]);
}

// Counts from the architectures' shapes, written out here rather than taken
// from the planner: Mixtral-8x7B's is the published 46,702,792,704 (untied
// embedding and head, per layer q/o 4096², k/v 4096·1024, two norms, a
// router of 8 and 8 SwiGLU experts of 14336, the final norm); the
// DeepSeek-V3 stand-in's per its config header (3 dense layers of ffn
// 18432, 58 MoE layers of 256 routed experts and one shared of 2048, a
// 256-way router, attention 4·7168²): 672,149,632,000. Exact: a missing
// head, shared expert or layer is off by 0.3% or less of these totals.
TEST(Plan, ShippedLargeConfigsLoadAndCountAsPublished) {
  const Config mixtral = load("mixtral-8x7b.toml");
  {
    const int64_t V = 32000, H = 4096, L = 32;
    const int64_t layer = 2 * H * H + 2 * H * 1024 + 2 * H + 8 * H + 8 * 3 * H * 14336;
    EXPECT_EQ(2 * V * H + H + L * layer, 46'702'792'704);
    EXPECT_EQ(plan::param_counts(mixtral.model, mixtral.moe).total, 46'702'792'704);
  }
  const Config ds = load("deepseek-v3.toml");
  {
    const int64_t V = 129280, H = 7168;
    const int64_t attention = 4 * H * H + 2 * H, dense_mlp = 3 * H * 18432, moe = 256 * H + 257 * 3 * H * 2048;
    EXPECT_EQ(plan::param_counts(ds.model, ds.moe).total, 2 * V * H + H + 61 * attention + 3 * dense_mlp + 58 * moe);
  }
  // Both configured layouts are valid for the world sizes their headers name.
  EXPECT_NO_THROW(plan::plan_layout(plan::plan_input(mixtral), layout_of(mixtral, 64), plan::Machine{}));
  const plan::LayoutPlan p = plan::plan_layout(plan::plan_input(ds), layout_of(ds, 2048), plan::Machine{});
  EXPECT_EQ(p.stages.size(), 16u);
  EXPECT_EQ(p.stages[0].num_layers, 4);  // 61 = 13·4 + 3·3
  EXPECT_EQ(p.stages[15].num_layers, 3);
}

// The GPU configs fill one H200 (141 GB) on one rank, in either recipe (16
// persistent bytes per parameter at ZeRO 0), without overflowing it; the
// Mixtral-like one holds as many layers as fit (a sixth would not).
TEST(Plan, GpuConfigsFitOneH200) {
  plan::Machine h200;
  h200.memory_gb = 141;
  for (const char* name : {"gpu-mixtral-h200.toml", "gpu-deepseek-h200.toml"})
    for (plan::Recipe recipe : {plan::Recipe::fp32, plan::Recipe::bf16}) {
      SCOPED_TRACE(name);
      const Config cfg = load(name);
      EXPECT_EQ(cfg.runtime.device, RuntimeDevice::cuda);
      plan::PlanInput in = plan::plan_input(cfg);
      in.recipe = recipe;
      const plan::LayoutPlan p = plan::plan_layout(in, layout_of(cfg, 1), h200);
      EXPECT_LT(static_cast<double>(p.peak_bytes()), 141e9);
      EXPECT_GT(static_cast<double>(p.peak_bytes()), 100e9) << "the config should fill most of the GPU";
    }
  const Config six = load("gpu-mixtral-h200.toml", {"model.num_layers=6"});
  EXPECT_GT(static_cast<double>(plan::plan_layout(plan::plan_input(six), layout_of(six, 1), h200).peak_bytes()), 141e9);
}

// ZeRO's working buffers, replayed (engine/plan_timeline.cpp), on tiny-moe
// at DP 4. A MoE layer's backward holds both its units' whole gradients (the
// layer's and its experts'), which outweigh the dense layer 0's alone. With
// overlap_grad_reduce the unit reduced last stays in flight until the next
// unit's reduce-scatter: the layer unit of the layer above, still whole
// while the next MoE layer's two gradients are allocated. So the gradient
// peak grows by one MoE layer unit, not by the second-largest unit (the
// bound the plan used before the replay). At stage 3 a MoE layer's backward
// also holds both its units' parameters whole (the experts' and the layer's,
// which the expert unit's prefetch gathers), at most two units.
TEST(Plan, ZeroWorkingBuffersFollowTheHooks) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const Config cfg = load("tiny-moe.toml", {"parallel.zero_stage=" + std::to_string(stage)});
    plan::PlanInput in = plan::plan_input(cfg);
    const plan::LayoutPlan plain = plan::plan_layout(in, layout_of(cfg, 4), plan::Machine{});
    in.overlap_grad_reduce = true;
    const plan::LayoutPlan overlapped = plan::plan_layout(in, layout_of(cfg, 4), plan::Machine{});
    auto whole = [&](const std::string& name) {
      for (const plan::UnitPlan& u : plain.units)
        if (u.name == name) return u.padded * 4;
      ADD_FAILURE() << "no unit " << name;
      return int64_t{0};
    };
    const int64_t layer = whole("layers.1"), experts = whole("layers.1.experts");
    ASSERT_GT(whole("layers.0"), layer) << "the dense layer's unit is the larger one";
    ASSERT_LT(whole("layers.0"), layer + experts);
    EXPECT_EQ(plain.stages[0].zero.grad, layer + experts);
    EXPECT_EQ(overlapped.stages[0].zero.grad, 2 * layer + experts);
    EXPECT_EQ(plain.stages[0].zero.param, stage == 3 ? layer + experts : 0);
    // The reduce-scatter's receive buffer: the shard of the unit reduced
    // (experts: the largest), one at a time even with overlap (the one in
    // flight lands before the next is allocated).
    EXPECT_EQ(plain.stages[0].zero.comm, experts / 4);
    EXPECT_EQ(overlapped.stages[0].zero.comm, experts / 4);
  }
}

// Placed experts and the expert bias count only on the stages they are on.
// tiny-moe at PP 2 × EP 2 (4 ranks, padded routing, experts narrow enough
// that the way back is a MoE backward's busiest moment): stage 0 holds
// layers 0-1 (MoE layer 1), stage 1 layers 2-3. A placement of layer 3
// alone adds one [R, D] copy to stage 1's backward and nothing to stage
// 0's; the bias adds f32 [E] per MoE layer to each stage's params.
TEST(Plan, PlacedLayersAndExpertBiasCountOnTheirOwnStage) {
  const Config cfg = load("tiny-moe.toml", {"parallel.pp=2", "parallel.ep=2", "moe.ffn_hidden_size=32",
                                            "moe.capacity_factor=1.0", "moe.pad_to_capacity=true"});
  const plan::PlanInput plain_in = plan::plan_input(cfg);
  const comm::Layout layout = layout_of(cfg, 4);
  const plan::LayoutPlan plain = plan::plan_layout(plain_in, layout, plan::Machine{});
  ASSERT_EQ(plain.stages.size(), 2u);
  ASSERT_EQ(plain.stages[0].num_moe_layers, 1);
  ASSERT_EQ(plain.stages[1].num_moe_layers, 2);

  plan::PlanInput placed_in = plain_in;
  placed_in.moe.expert_placement.ep = 2;
  placed_in.moe.expert_placement.layers[3] = moe::ExpertPlacement::from_ranks({{0, 5, 2, 7}, {1, 3, 4, 6}});
  const plan::LayoutPlan placed = plan::plan_layout(placed_in, layout, plan::Machine{});
  EXPECT_EQ(placed.act.placed_moe_layers, std::vector<int64_t>{3});
  // The copy [R, D] joins the way back, which then passes the router's
  // moment (the busiest unplaced).
  const int64_t copy = placed.act.rows * cfg.model.hidden_size * 4;
  const int64_t more = placed.act.backward_placed_moe_layer - placed.act.backward_moe_layer;
  EXPECT_GT(more, 0);
  EXPECT_LE(more, copy);
  EXPECT_EQ(placed.act.backward_moe_layer, plain.act.backward_moe_layer);
  EXPECT_EQ(placed.stages[0].live, plain.stages[0].live) << "no placed layer on stage 0";
  EXPECT_EQ(placed.stages[1].live, plain.stages[1].live + more) << "layer 3's backward is stage 1's busiest moment";
  // Under another EP size the placement does not apply.
  const Config ep1 = load("tiny-moe.toml", {"parallel.pp=2"});
  plan::PlanInput other = plan::plan_input(ep1);
  other.moe.expert_placement = placed_in.moe.expert_placement;
  EXPECT_TRUE(plan::plan_layout(other, layout_of(ep1, 4), plan::Machine{}).act.placed_moe_layers.empty());

  plan::PlanInput bias_in = plain_in;
  bias_in.moe.expert_bias = true;
  const plan::LayoutPlan bias = plan::plan_layout(bias_in, layout, plan::Machine{});
  for (size_t s = 0; s < 2; ++s) {
    const int64_t bytes = plain.stages[s].num_moe_layers * cfg.moe.router.num_experts * 4;
    EXPECT_EQ(bias.stages[s].expert_bias, bytes) << "stage " << s;
    EXPECT_EQ(bias.stages[s].state.param, plain.stages[s].state.param + bytes) << "stage " << s;
    EXPECT_EQ(bias.stages[s].state.grad, plain.stages[s].state.grad) << "stage " << s;
    EXPECT_EQ(bias.stages[s].state.optim, plain.stages[s].state.optim) << "stage " << s;
  }
}

TEST(Plan, StageLayers) {
  EXPECT_EQ(plan::stage_layers(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(plan::stage_layers(10, 2, {7, 3}), (std::vector<int64_t>{7, 3}));
  EXPECT_THROW(plan::stage_layers(10, 2, {7, 2}), UserError);
  EXPECT_THROW(plan::stage_layers(10, 3, {5, 5}), UserError);
}

TEST(Plan, LayoutProblemsNameTheKeyAndRule) {
  const Config cfg = load("tiny-moe.toml", {"parallel.tp=4"});
  const std::string p = plan::layout_problem(plan::plan_input(cfg), layout_of(cfg, 4));
  EXPECT_NE(p.find("parallel.tp = 4 must divide model.num_heads = 4 and model.num_kv_heads = 2"), std::string::npos)
      << p;
  EXPECT_THROW(plan::plan_layout(plan::plan_input(cfg), layout_of(cfg, 4), plan::Machine{}), UserError);
}

TEST(Plan, RankedLayoutsAreValidAndSorted) {
  const Config cfg = load("tiny-moe.toml");
  plan::Machine m;
  // A memory limit between the smallest and the largest peak, so some layouts do not fit.
  int64_t lo = INT64_MAX, hi = 0;
  for (const plan::LayoutPlan& p : plan::rank_layouts(plan::plan_input(cfg), 8, cfg.parallel.order, m))
    lo = std::min(lo, p.peak_bytes()), hi = std::max(hi, p.peak_bytes());
  ASSERT_LT(lo, hi);
  m.memory_gb = static_cast<double>(lo + hi) / 2 / 1e9;
  const std::vector<plan::LayoutPlan> ranked = plan::rank_layouts(plan::plan_input(cfg), 8, cfg.parallel.order, m);
  ASSERT_FALSE(ranked.empty());
  bool seen_unfit = false, has_ep8 = false;
  for (size_t i = 0; i < ranked.size(); ++i) {
    const plan::LayoutPlan& p = ranked[i];
    SCOPED_TRACE(::testing::Message() << "tp " << p.tp << " cp " << p.cp << " pp " << p.pp << " ep " << p.ep << " etp "
                                      << p.etp);
    const comm::Layout layout(8,
                              comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, cfg.moe.router.num_experts});
    EXPECT_EQ(plan::layout_problem(plan::plan_input(cfg), layout), "");
    EXPECT_LE(p.tp, 2);  // 2 kv heads
    EXPECT_LE(p.etp, 8);
    if (i > 0 && ranked[i - 1].fits == p.fits) {
      EXPECT_LE(ranked[i - 1].step_s, p.step_s);
    }
    if (!p.fits) seen_unfit = true;
    EXPECT_FALSE(seen_unfit && p.fits);  // every fitting layout first
    EXPECT_EQ(p.fits, static_cast<double>(p.peak_bytes()) <= m.memory_gb * 1e9);
    has_ep8 = has_ep8 || (p.ep == 8 && p.tp == 1 && p.cp == 1 && p.pp == 1);
  }
  EXPECT_TRUE(has_ep8);
  EXPECT_TRUE(seen_unfit);
}

}  // namespace
}  // namespace origami
