// ZeRO stages 0-3 at dp-cp = 4 (run under `mpirun -np 4`), on a 4-layer
// model with one dense and three MoE layers (EP = 1, so expert units shard
// over edp = 4 too):
//  - the measured persistent param / grad / optim bytes per rank equal
//    ARCHITECTURE.md §6's CPU fp32 formula per stage (16; 8 + 8/N; 4 + 12/N;
//    16/N bytes per parameter) exactly, counting each unit padded to a
//    multiple of N = 4 (padding < N elements per unit), at construction and
//    again at a step boundary;
//  - one step moves exactly 1.5× the bytes at stage 3 of stages 1 and 2 on
//    both shard groups (with one micro-batch), and stage 0 the same as 1 and 2
//    up to the padding;
//  - at stage 3 no more than two units are ever whole at once;
//  - every stage gives the same losses and parameters after two steps
//    (fp32 sums in another order: relative 1e-6);
//  - the bf16 recipe's store (bf16 params and grads, fp32 master weights
//    beside the moments) holds exactly `origami plan --recipe bf16`'s bytes
//    per unit and stage (2 + 2 + 4 + 8 bytes per parameter, sharded as §6
//    says: 16; 4 + 12/N; 2 + 14/N; 16/N), its master weights bitwise the fp32
//    store's parameters and its params those rounded to bf16 (the cast op);
//  - overlap_grad_reduce (stages 2-3: one unit's reduce-scatter in flight
//    during the next unit's backward) gives bitwise the same losses and
//    parameters as waiting for each, at a grad-ledger peak above it by at
//    most one unit's whole gradient.
// Every group communicates by NCCL's rules (the host stand-in's): under the
// in-flight check (comm/in_flight_check.h), where a buffer touched between
// an op's launch and its wait fails these tests, and with point-to-point
// messages paired by order alone (CommOptions::p2p_by_order).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/plan.h"
#include "kernels/elementwise.h"
#include "engine/zero.h"
#include "grad_check.h"
#include "kernels/threads.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using testing::world_rank;

constexpr int64_t kN = 4;  // dp-cp = edp = 4

ModelConfig model_config() {
  ModelConfig m;
  m.vocab_size = 67;  // odd sizes, so units need padding
  m.hidden_size = 24;
  m.num_layers = 4;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden_size = 40;
  m.init_std = 0.1;
  return m;
}

MoeConfig moe_config() {
  MoeConfig m;
  m.router.num_experts = 4;
  m.router.top_k = 2;
  m.ffn_hidden_size = 18;
  m.first_dense_layers = 1;
  m.router.aux_loss_coeff = 0.01;
  return m;
}

std::unique_ptr<comm::Groups>& groups_holder() {
  static std::unique_ptr<comm::Groups> g;
  return g;
}

comm::Groups& groups() {
  std::unique_ptr<comm::Groups>& g = groups_holder();
  if (!g) {
    comm::LayoutOptions o;
    o.num_experts = moe_config().router.num_experts;
    g = std::make_unique<comm::Groups>(
        comm::Groups::create(comm::Layout(kN, o), MPI_COMM_WORLD, comm::Backend::mpi,
                             comm::CommOptions{.timeout_s = 60.0, .check_in_flight = true, .p2p_by_order = true}));
  }
  return *g;
}

struct Ledger {
  int64_t param = 0, grad = 0, optim = 0;
};
Ledger ledger_now() {
  const LedgerSnapshot s = TrackedAllocator::host().snapshot();
  return {s.current[static_cast<int>(MemCategory::param)], s.current[static_cast<int>(MemCategory::grad)],
          s.current[static_cast<int>(MemCategory::optim)]};
}

// §6 per stage, in bytes, for a unit of n elements padded to p (p = n at stage 0).
Ledger expected(const ParamStore& params, int stage) {
  Ledger e;
  for (const ParamUnit& u : params.units()) {
    const int64_t n = u.numel, p = (n + kN - 1) / kN * kN;
    switch (stage) {
      case 0: e.param += 4 * n, e.grad += 4 * n, e.optim += 8 * n; break;
      case 1: e.param += 4 * p, e.grad += 4 * p, e.optim += 8 * p / kN; break;
      case 2: e.param += 4 * p, e.grad += 4 * p / kN, e.optim += 8 * p / kN; break;
      default: e.param += 4 * p / kN, e.grad += 4 * p / kN, e.optim += 8 * p / kN; break;
    }
  }
  return e;
}

// One training step on this rank's random micro-batch; returns the loss and,
// through *bytes, what the step moved on dp-cp and edp before the optimizer.
struct StepResult {
  double loss = 0;
  int64_t dense_bytes = 0, expert_bytes = 0;
};
StepResult train_step(Model& model, ZeroStore& zero, AdamW& opt, uint32_t seed) {
  comm::Communicator& dense = groups()[comm::GroupKind::dp_cp];
  comm::Communicator& expert = groups()[comm::GroupKind::edp];
  const int64_t d0 = dense.total_bytes(), e0 = expert.total_bytes();
  std::mt19937 rng(testing::test_seed(seed * 131 + static_cast<uint32_t>(world_rank())));
  const Tensor tokens = testing::random_tokens(2, 17, model.config().vocab_size, rng);
  zero.begin_step();
  ModelSaved saved;
  StepResult r;
  StageIO io{tokens, Tensor(), nullptr, &zero};
  model.forward(io, saved);
  r.loss = ctx.read_later(io.loss_sum).scalar_f64();
  StageGradIO grad_io{1.0f / (2 * 16 * kN), 1.0f / kN, &zero};
  model.backward(grad_io, saved);
  zero.finish_gradients();
  const int64_t d1 = dense.total_bytes(), e1 = expert.total_bytes();
  opt.step(ctx, model.params(), {&dense, &expert, nullptr});
  const int64_t d2 = dense.total_bytes(), e2 = expert.total_bytes();
  zero.finish_step();
  // The optimizer's own grad-norm reduction (one double) is not ZeRO traffic.
  r.dense_bytes = (d1 - d0) + (dense.total_bytes() - d2);
  r.expert_bytes = (e1 - e0) + (expert.total_bytes() - e2);
  dense.all_reduce(std::span<double>(&r.loss, 1));
  return r;
}

OptimizerConfig optimizer_config() {
  OptimizerConfig o;
  o.clip_grad = 0.05;  // small enough to clip: the norm must count every element once
  return o;
}

TEST(ZeroMpi, PersistentBytesFollowTheStageFormulas) {
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const Ledger before = ledger_now();
    Model model(ctx, model_config(), 7, moe_config(), {.groups = &groups(), .zero_stage = stage});
    ZeroStore zero(ctx, model.params(), groups());
    const Ledger e = expected(model.params(), stage);
    auto check = [&](const char* when) {
      const Ledger now = ledger_now();
      EXPECT_EQ(now.param - before.param, e.param) << when;
      EXPECT_EQ(now.grad - before.grad, e.grad) << when;
      EXPECT_EQ(now.optim - before.optim, e.optim) << when;
    };
    check("after construction");
    AdamW opt(optimizer_config(), {}, 10);
    train_step(model, zero, opt, 1);
    check("at the step boundary");
    // Per parameter, against §6 with Ψ unpadded: the padding is all the difference.
    const double psi = static_cast<double>(model.params().total_params());
    const double formula[] = {16.0, 8.0 + 8.0 / kN, 4.0 + 12.0 / kN, 16.0 / kN};
    const double per_param = static_cast<double>(e.param + e.grad + e.optim) / psi;
    const double padding = 16.0 * static_cast<double>(kN * model.params().units().size()) / psi;
    EXPECT_NEAR(per_param, formula[stage], padding);
    if (world_rank() == 0)
      std::printf("stage %d: %.4f bytes/param measured, %.4f by the formula (Ψ = %.0f, %zu units)\n", stage, per_param,
                  formula[stage], psi, model.params().units().size());
  }
}

TEST(ZeroMpi, Stage3MovesOneAndAHalfTimesTheBytes) {
  StepResult r[4];
  for (int stage = 0; stage <= 3; ++stage) {
    Model model(ctx, model_config(), 7, moe_config(), {.groups = &groups(), .zero_stage = stage});
    ZeroStore zero(ctx, model.params(), groups());
    AdamW opt(optimizer_config(), {}, 10);
    r[stage] = train_step(model, zero, opt, 3);
  }
  EXPECT_EQ(2 * r[3].dense_bytes, 3 * r[1].dense_bytes);
  EXPECT_EQ(2 * r[3].expert_bytes, 3 * r[1].expert_bytes);
  EXPECT_EQ(r[2].dense_bytes, r[1].dense_bytes);
  EXPECT_EQ(r[2].expert_bytes, r[1].expert_bytes);
  // Stage 0 all-reduces the unpadded units: the same ring volume up to padding.
  EXPECT_NEAR(static_cast<double>(r[0].dense_bytes), static_cast<double>(r[1].dense_bytes),
              0.01 * static_cast<double>(r[1].dense_bytes));
  if (world_rank() == 0)
    std::printf("dp-cp bytes per step: stage 0 %lld, 1 %lld, 2 %lld, 3 %lld (ratio 3/1 = %.4f)\n",
                static_cast<long long>(r[0].dense_bytes), static_cast<long long>(r[1].dense_bytes),
                static_cast<long long>(r[2].dense_bytes), static_cast<long long>(r[3].dense_bytes),
                static_cast<double>(r[3].dense_bytes) / static_cast<double>(r[1].dense_bytes));
}

TEST(ZeroMpi, Stage3KeepsAtMostTwoUnitsWhole) {
  Model model(ctx, model_config(), 7, moe_config(), {.groups = &groups(), .zero_stage = 3});
  ZeroStore zero(ctx, model.params(), groups());
  std::vector<int64_t> unit_bytes;
  for (const ParamUnit& u : model.params().units()) unit_bytes.push_back(4 * u.shard.padded);
  std::sort(unit_bytes.rbegin(), unit_bytes.rend());
  AdamW opt(optimizer_config(), {}, 10);
  TrackedAllocator::host().reset_peaks();
  const int64_t persistent = ledger_now().param;
  train_step(model, zero, opt, 5);
  const int64_t peak_param = TrackedAllocator::host().snapshot().peak[static_cast<int>(MemCategory::param)];
  EXPECT_LE(zero.peak_gathered_bytes(), unit_bytes[0] + unit_bytes[1]);
  EXPECT_GE(zero.peak_gathered_bytes(), unit_bytes[0]) << "the largest unit was gathered at some point";
  EXPECT_LE(peak_param - persistent, unit_bytes[0] + unit_bytes[1]) << "the ledger agrees";
  EXPECT_EQ(zero.gathered_bytes(), 0) << "everything freed after the step";
  if (world_rank() == 0)
    std::printf("stage 3: peak gathered %lld bytes; two largest units %lld + %lld\n",
                static_cast<long long>(zero.peak_gathered_bytes()), static_cast<long long>(unit_bytes[0]),
                static_cast<long long>(unit_bytes[1]));
}

TEST(ZeroMpi, EveryStageTrainsTheSameModel) {
  std::vector<std::vector<float>> finals;
  std::vector<double> losses;
  for (int stage = 0; stage <= 3; ++stage) {
    Model model(ctx, model_config(), 7, moe_config(), {.groups = &groups(), .zero_stage = stage});
    ZeroStore zero(ctx, model.params(), groups());
    AdamW opt(optimizer_config(), {}, 10);
    train_step(model, zero, opt, 11);
    losses.push_back(train_step(model, zero, opt, 12).loss);
    zero.gather_all();
    std::vector<float> all;
    for (const ParamUnit& u : model.params().units()) all.insert(all.end(), u.param.f32(), u.param.f32() + u.numel);
    zero.release_all();
    finals.push_back(std::move(all));
  }
  for (int stage = 1; stage <= 3; ++stage) {
    EXPECT_NEAR(losses[stage], losses[0], 1e-6 * std::abs(losses[0])) << "stage " << stage;
    ASSERT_EQ(finals[stage].size(), finals[0].size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < finals[0].size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(finals[stage][i] - finals[0][i])));
      scale = std::max(scale, static_cast<double>(std::abs(finals[0][i])));
    }
    EXPECT_LE(worst, 1e-6 * scale) << "stage " << stage << " parameters after two steps";
  }
}

TEST(ZeroMpi, Bf16RecipeHoldsThePlannedBytesAndTheFp32Init) {
  const UnitTable table(model_config(), moe_config());
  const PipelineStage one_stage = pipeline_stage(model_config().num_layers, 1, 0);
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    ParamStore fp32, bf16;
    for (ParamStore* s : {&fp32, &bf16})
      s->add_units(table, groups().layout(), groups().coords(), one_stage);
    fp32.allocate(Device::cpu(), DType::f32, zero_shard_plan(stage, &groups()));
    const Ledger before = ledger_now();
    bf16.allocate(Device::cpu(), DType::bf16, zero_shard_plan(stage, &groups()));
    const Ledger now = ledger_now();
    plan::StateBytes want;
    for (const ParamUnit& u : bf16.units())
      want += plan::zero_state_bytes(u.numel, u.shard.group_size, stage, plan::Recipe::bf16);
    EXPECT_EQ(now.param - before.param, want.param);
    EXPECT_EQ(now.grad - before.grad, want.grad);
    EXPECT_EQ(now.optim - before.optim, want.optim);
    fp32.initialize(ctx, 7, 0.1f, model_config().num_layers);
    bf16.initialize(ctx, 7, 0.1f, model_config().num_layers);
    for (size_t i = 0; i < bf16.units().size(); ++i) {
      const ParamUnit &a = fp32.units()[i], &b = bf16.units()[i];
      SCOPED_TRACE(b.name);
      const Tensor& a_param = a.shard.params ? a.param_shard : a.param;  // the fp32 store's master
      const int64_t at = a.shard.optim && !a.shard.params ? a.shard.begin : 0;
      ASSERT_EQ(b.master.numel(), b.exp_avg.numel());
      const Tensor a_slice = a_param.flat_view(at, b.master.numel(), {b.master.numel()});
      EXPECT_EQ(std::memcmp(b.master.f32(), a_slice.f32(), b.master.nbytes()), 0) << "master != fp32 init";
      const Tensor& b_param = b.shard.params ? b.param_shard : b.param;
      ASSERT_EQ(b_param.dtype(), DType::bf16);
      Tensor rounded = Tensor::empty(a_param.shape(), DType::bf16, MemCategory::workspace);
      cast(ctx, a_param, rounded);
      EXPECT_EQ(std::memcmp(b_param.raw(), rounded.raw(), rounded.nbytes()), 0) << "params != bf16(fp32 init)";
    }
  }
}

TEST(ZeroMpi, OverlappedGradReduceIsBitwiseTheSameRun) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    std::vector<float> finals[2];
    double losses[2] = {0, 0};
    int64_t grad_peak[2] = {0, 0}, largest = 0;
    for (int overlap = 0; overlap <= 1; ++overlap) {
      Model model(ctx, model_config(), 7, moe_config(), {.groups = &groups(), .zero_stage = stage});
      ZeroStore zero(ctx, model.params(), groups(), {.overlap_grad_reduce = overlap == 1});
      AdamW opt(optimizer_config(), {}, 10);
      train_step(model, zero, opt, 11);
      TrackedAllocator::host().reset_peaks();
      losses[overlap] = train_step(model, zero, opt, 12).loss;
      grad_peak[overlap] = TrackedAllocator::host().snapshot().peak[static_cast<int>(MemCategory::grad)];
      for (const ParamUnit& u : model.params().units()) largest = std::max(largest, u.shard.padded * 4);
      zero.gather_all();
      for (const ParamUnit& u : model.params().units())
        finals[overlap].insert(finals[overlap].end(), u.param.f32(), u.param.f32() + u.numel);
      zero.release_all();
    }
    EXPECT_EQ(losses[1], losses[0]);
    ASSERT_EQ(finals[1].size(), finals[0].size());
    EXPECT_EQ(std::memcmp(finals[1].data(), finals[0].data(), finals[0].size() * sizeof(float)), 0)
        << "parameters after two steps differ";
    EXPECT_GT(grad_peak[1], grad_peak[0]) << "a second whole gradient is alive while one is in flight";
    EXPECT_LE(grad_peak[1], grad_peak[0] + largest);
  }
}

}  // namespace
}  // namespace origami

// Groups are built for exactly kN ranks; another world size fails every test
// at Groups::create with the layout's message.
int main(int argc, char** argv) {
  return origami::testing::run_mpi_tests(argc, argv, 1, [] { origami::groups_holder().reset(); });
}
