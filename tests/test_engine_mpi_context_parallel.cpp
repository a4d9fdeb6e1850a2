// Context parallelism through the whole model against the planner (run under
// `mpirun -np 4`), for both parallel.cp_comm methods, on configs/tiny-moe.toml
// (one dense and three MoE layers) at CP 4, CP 2 × DP 2 and TP 2 × CP 2,
// the last also with a shared expert:
//  - the activation ledger after one micro-batch's forward equals
//    plan::activation_bytes exactly on tp rank 0, the plan's worst rank (the
//    saved K, V: cp-gathered with their positions under all_gather, the local
//    block only under the ring);
//  - over that micro-batch's forward and backward, the ring's measured peak
//    of every ledger category together is below all_gather's, as the plan's
//    per-rank K/V peak (plan::kv_memory) predicts, and its saved activations
//    are lower by the plan's K/V difference per layer.
// Every group communicates by NCCL's rules (the host stand-in's): under the
// in-flight check (comm/in_flight_check.h), where a buffer touched between
// an op's launch and its wait fails these tests, and with point-to-point
// messages paired by order alone (CommOptions::p2p_by_order).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>

#include "engine/model.h"
#include "engine/plan.h"
#include "grad_check.h"
#include "kernels/allocator.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();
using testing::world_rank;
using testing::world_size;

Config tiny_moe() {
  Config cfg = load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-moe.toml");
  cfg.training.micro_batch = 2;  // a small forward; the plan reads the same sizes
  cfg.training.global_batch = 2 * world_size();
  return cfg;
}

struct Measured {
  int64_t saved = 0;  // activation bytes held after forward
  int64_t peak = 0;   // peak of every category together over forward + backward, above the start
};

Measured run_micro_batch(const Config& cfg, const comm::Groups& groups, dense::CpComm method) {
  Model model(ctx, cfg.model, 3, cfg.moe, {.groups = &groups});
  model.set_cp_comm(method);
  std::mt19937 rng(testing::test_seed(4));  // the same windows on every rank: each cp rank takes its chunks
  const Tensor tokens =
      testing::random_tokens(cfg.training.micro_batch, cfg.training.seq_len + 1, cfg.model.vocab_size, rng);
  TrackedAllocator& mem = TrackedAllocator::host();
  const auto act = static_cast<size_t>(MemCategory::activation);
  Measured m;
  const LedgerSnapshot before = mem.snapshot();
  mem.reset_peaks();
  {
    ModelSaved saved;
    model.forward(tokens, saved);
    m.saved = mem.snapshot().current[act] - before.current[act];
    model.backward(saved, 1.0f);
  }
  m.peak = mem.snapshot().peak_total - before.current_total;
  return m;
}

TEST(ContextParallelModel, ActivationsAndPeakAgainstThePlan) {
  ASSERT_EQ(world_size(), 4) << "run under mpirun -np 4";
  const Config base = tiny_moe();
  struct Layout {
    int64_t tp, cp, shared_expert = 0;
  };
  // The shared expert runs whole on each tp rank's own tokens (no tp
  // collective), its hidden size not a multiple of tp.
  for (const Layout l : {Layout{1, 4}, Layout{1, 2}, Layout{2, 2}, Layout{2, 2, 95}}) {
    Config cfg = base;
    cfg.parallel.tp = cfg.parallel.etp = l.tp;
    cfg.parallel.cp = l.cp;
    cfg.moe.shared_expert_hidden_size = l.shared_expert;
    const std::string at = "tp " + std::to_string(l.tp) + " cp " + std::to_string(l.cp) +
                           (l.shared_expert ? " shared expert " + std::to_string(l.shared_expert) : "");
    SCOPED_TRACE(at);
    ASSERT_EQ(layout_problem(cfg, world_size()), "");
    const comm::Layout layout(world_size(), comm::LayoutOptions{l.tp, l.cp, 1, 1, l.tp, cfg.parallel.order,
                                                                cfg.moe.router.num_experts});
    const comm::Groups groups = comm::Groups::create(
        layout, MPI_COMM_WORLD, comm::Backend::mpi,
        comm::CommOptions{.timeout_s = 60, .check_in_flight = true, .p2p_by_order = true});
    int64_t dense_layers = 0, moe_layers = 0;
    for (int64_t i = 0; i < cfg.model.num_layers; ++i) (cfg.moe.is_moe_layer(i) ? moe_layers : dense_layers) += 1;
    Measured got[2];
    plan::KvMemory kv;
    for (const dense::CpComm method : {dense::CpComm::all_gather, dense::CpComm::ring}) {
      const bool ring = method == dense::CpComm::ring;
      SCOPED_TRACE(ring ? "ring" : "all_gather");
      cfg.parallel.cp_comm = method;
      const plan::PlanInput in = plan::plan_input(cfg);
      const plan::ActivationBytes a = plan::activation_bytes(in, layout);
      kv = plan::kv_memory(in, layout);
      const int64_t planned = dense_layers * a.dense_layer + moe_layers * a.moe_layer + a.every_stage + a.first_stage +
                              a.last_stage;
      got[ring] = run_micro_batch(cfg, groups, method);
      // The plan is the worst rank's: tp rank 0 holds ceil(V/tp) vocab rows
      // of the head's logits, the others up to one fewer.
      if (groups.coords().tp == 0)
        EXPECT_EQ(got[ring].saved, planned) << "activation ledger after forward vs plan::activation_bytes";
      else
        EXPECT_LE(got[ring].saved, planned) << "activation ledger after forward vs plan::activation_bytes";
    }
    const int64_t layers = cfg.model.num_layers;
    EXPECT_EQ(got[0].saved - got[1].saved, layers * (kv.saved_all_gather - kv.saved_ring));
    EXPECT_LT(kv.peak_ring, kv.peak_all_gather);
    EXPECT_LT(got[1].peak, got[0].peak) << "the ring's peak memory should be the lower one";
    if (world_rank() == 0)
      std::printf("[          ] %s: saved activations all_gather %lld ring %lld B; planned K/V peak all_gather %lld "
                  "ring %lld B; measured peak (all categories) all_gather %lld ring %lld B\n",
                  at.c_str(), static_cast<long long>(got[0].saved), static_cast<long long>(got[1].saved),
                  static_cast<long long>(kv.peak_all_gather), static_cast<long long>(kv.peak_ring),
                  static_cast<long long>(got[0].peak), static_cast<long long>(got[1].peak));
  }
}

}  // namespace
}  // namespace origami

int main(int argc, char** argv) { return origami::testing::run_mpi_tests(argc, argv); }
