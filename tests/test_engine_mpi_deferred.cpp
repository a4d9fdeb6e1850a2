// The split backward under parallel layouts (run under `mpirun -np 4`): a
// model of one dense and two MoE layers (shared expert, aux and z losses) on
// TP 2 × EP 2 (DP 2, EDP 2), TP 2 × EP 2 × ETP 2 (EDP 1) and CP 2 × EP 2,
// each at ZeRO 2 and 3, runs two micro-batches fused and as B, B, W, W (the
// zero-bubble order, engine/model.h WeightPass):
//  - every rank's gradients after finish_gradients (its owned slices) are
//    bitwise the fused run's;
//  - B and W together move exactly the fused run's bytes on every group (the
//    same collectives: the modules' in B, ZeRO's reduce-scatters in W);
//  - W gathers no parameter at ZeRO 3 (it reads none), the pending work
//    holds none once B ended, and B accumulates no gradient (nor allocates a
//    whole one at ZeRO 2-3).
// Every group communicates by NCCL's rules (the host stand-in's): under the
// in-flight check (comm/in_flight_check.h), where a buffer touched between
// an op's launch and its wait fails these tests, and with point-to-point
// messages paired by order alone (CommOptions::p2p_by_order).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "engine/model.h"
#include "engine/zero.h"
#include "kernels/allocator.h"
#include "grad_check.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using comm::GroupKind;
using testing::world_rank;

constexpr int kWorld = 4;

ModelConfig model_config() {
  ModelConfig m;
  m.vocab_size = 67;  // odd: uneven vocab shards and padded units
  m.hidden_size = 24;
  m.num_layers = 3;
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
  m.router.aux_loss_coeff = 0.01;
  m.router.z_loss_coeff = 0.001;
  m.ffn_hidden_size = 18;
  m.first_dense_layers = 1;
  m.shared_expert_hidden_size = 10;
  return m;
}

struct LayoutCase {
  const char* name;
  comm::LayoutOptions options;
};

std::vector<LayoutCase> layouts() {
  auto opts = [](int64_t tp, int64_t cp, int64_t ep, int64_t etp) {
    comm::LayoutOptions o;
    o.tp = tp, o.cp = cp, o.ep = ep, o.etp = etp;
    o.num_experts = moe_config().router.num_experts;
    return o;
  };
  return {{"tp 2 x ep 2", opts(2, 1, 2, 1)}, {"tp 2 x ep 2 x etp 2", opts(2, 1, 2, 2)}, {"cp 2 x ep 2", opts(1, 2, 2, 1)}};
}

// One Groups per layout, built once (collective), freed before MPI_Finalize.
std::vector<std::unique_ptr<comm::Groups>>& groups_holder() {
  static std::vector<std::unique_ptr<comm::Groups>> g;
  return g;
}
comm::Groups& groups(size_t i) {
  auto& g = groups_holder();
  if (g.empty())
    for (const LayoutCase& c : layouts())
      g.push_back(std::make_unique<comm::Groups>(comm::Groups::create(comm::Layout(kWorld, c.options), MPI_COMM_WORLD,
                                                                      comm::Backend::mpi,
                                                                      comm::CommOptions{.timeout_s = 60.0,
                                                                                        .check_in_flight = true,
                                                                                        .p2p_by_order = true})));
  return *g.at(i);
}

constexpr GroupKind kGroups[] = {GroupKind::tp, GroupKind::cp, GroupKind::dp_cp, GroupKind::tp_cp,
                                 GroupKind::ep, GroupKind::etp, GroupKind::edp};

std::vector<int64_t> bytes_per_group(const comm::Groups& g) {
  std::vector<int64_t> b;
  for (GroupKind k : kGroups) b.push_back(g.get(k).total_bytes());
  return b;
}

// This rank's tokens of micro-batch `mb` (the same on every tp and cp rank of
// a data-parallel replica: the model shards them itself).
Tensor tokens_of(const comm::Groups& g, int mb) {
  std::mt19937 rng(testing::test_seed(static_cast<uint32_t>(1000 * mb + g.coords().dp)));
  return testing::random_tokens(2, 17, model_config().vocab_size, rng);
}

struct Outcome {
  std::vector<std::vector<float>> grads;  // per unit: the owned gradient after finish_gradients
  std::vector<int64_t> bytes;             // per group kind, moved by the two micro-batches' passes
  int64_t w_peak_gathered = 0;
  int64_t params_held_after_b = 0;  // param bytes beyond the persistent ones once B ended
  bool b_left_grads_zero = true;
};

int64_t param_bytes() {
  return TrackedAllocator::host().snapshot().current[static_cast<size_t>(MemCategory::param)];
}

Outcome run(comm::Groups& g, int zero_stage, bool deferred) {
  Model model(ctx, model_config(), 7, moe_config(), {.groups = &g, .zero_stage = zero_stage});
  ZeroStore zero(ctx, model.params(), g);
  zero.begin_step();
  const std::vector<int64_t> bytes0 = bytes_per_group(g);
  const int64_t persistent_params = param_bytes();
  const float lm_scale = 1.0f / 128, aux_scale = 0.5f;
  Outcome r;
  WeightPass pass[2];
  for (int mb = 0; mb < 2; ++mb) {
    ModelSaved saved;
    StageIO io;
    io.tokens_BS1 = tokens_of(g, mb);
    io.hooks = &zero;
    model.forward(io, saved);
    StageGradIO gio;
    gio.lm_grad_scale = lm_scale;
    gio.aux_scale = aux_scale;
    gio.hooks = &zero;
    if (deferred) gio.defer = &pass[mb];
    model.backward(gio, saved);
  }
  if (deferred) {
    r.params_held_after_b = param_bytes() - persistent_params;  // a pending call holding a gathered weight shows here
    for (const ParamUnit& u : model.params().units()) {
      const Tensor& kept = u.shard.grads ? u.grad_shard : u.grad;  // what persists; sharded: no whole buffer yet
      r.b_left_grads_zero &= !(u.shard.grads && u.grad.defined()) &&
                             std::all_of(kept.f32(), kept.f32() + kept.numel(), [](float v) { return v == 0; });
    }
    zero.reset_peak_gathered();
    for (WeightPass& p : pass) model.weight_backward(p, &zero);
    r.w_peak_gathered = zero.peak_gathered_bytes();
  }
  zero.finish_gradients();
  const std::vector<int64_t> bytes1 = bytes_per_group(g);
  for (size_t i = 0; i < bytes1.size(); ++i) r.bytes.push_back(bytes1[i] - bytes0[i]);
  for (const ParamUnit& u : model.params().units()) {
    const Tensor& mine = u.shard.grads ? u.grad_shard : u.grad;
    r.grads.emplace_back(mine.f32(), mine.f32() + mine.numel());
  }
  return r;
}

TEST(DeferredMpi, BThenWIsBitwiseTheFusedBackwardUnderParallelLayouts) {
  const std::vector<LayoutCase> cases = layouts();
  for (size_t i = 0; i < cases.size(); ++i)
    for (int stage : {2, 3}) {
      SCOPED_TRACE(std::string(cases[i].name) + ", ZeRO " + std::to_string(stage) + ", rank " +
                   std::to_string(world_rank()));
      comm::Groups& g = groups(i);
      const Outcome fused = run(g, stage, false), split = run(g, stage, true);
      ASSERT_EQ(split.grads.size(), fused.grads.size());
      bool any_nonzero = false;
      for (size_t u = 0; u < fused.grads.size(); ++u) {
        const std::vector<float>& a = split.grads[u];
        const std::vector<float>& b = fused.grads[u];
        ASSERT_EQ(a.size(), b.size()) << "unit " << u;
        const auto diff = std::mismatch(a.begin(), a.end(), b.begin());
        EXPECT_TRUE(diff.first == a.end()) << "unit " << u << ": element " << (diff.first - a.begin()) << " of "
                                          << a.size() << " differs";
        any_nonzero |= std::any_of(fused.grads[u].begin(), fused.grads[u].end(), [](float v) { return v != 0; });
      }
      EXPECT_TRUE(any_nonzero);
      EXPECT_EQ(split.bytes, fused.bytes);
      EXPECT_EQ(split.w_peak_gathered, 0) << "W gathered parameters";
      EXPECT_EQ(split.params_held_after_b, 0) << "the pending weight gradients hold parameters";
      EXPECT_TRUE(split.b_left_grads_zero) << "B reduced a gradient";
    }
}

}  // namespace
}  // namespace origami

int main(int argc, char** argv) {
  return origami::testing::run_mpi_tests(argc, argv, 1, [] { origami::groups_holder().clear(); });
}
