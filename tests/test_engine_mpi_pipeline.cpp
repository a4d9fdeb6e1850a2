// Pipeline parallelism over real ranks (CTest runs it under `mpirun -np 4`;
// the layouts adapt to any world size W, e.g. 1, 2 and 8 pass too):
//  - run_pipeline with toy virtual stages (y = h·a_u + b_u elementwise,
//    gradient dh·a_u) on pp = W and pp = W/2 × dp 2, m = 1, 3, 8, under
//    1F1B, ZB-H1 and interleaved (v = 2, 3 where m % pp = 0): the last stage
//    sees every micro-batch's composition, the first the product of the
//    slopes, the callbacks run in the schedule's order with the right
//    micro-batch and chunk, and
//    the timings are finite and non-negative. Data is tagged by micro-batch
//    and dp replica, so a misrouted tensor fails the comparison;
//  - Model parity: a 4-layer model (one dense, three MoE layers) split into
//    stages by Model(ctx, ..., {.pp_layers}), run through run_pipeline the way
//    engine/trainer.cpp does it, against the one-rank Model on each rank:
//    the same summed loss and aux loss, the same gradient for every
//    parameter a stage owns (its tp slice of the reference under tp = 2),
//    one MoE record per MoE layer of the stage, and the embedding, layers and
//    head only where the stage owns them. Layouts at np 4: pp = 4,
//    pp = 2 × tp = 2, and pp = 4 with empty stages (pp_layers 2,0,1,1 and
//    0,2,2,0: a stage of no layers, the embedding alone, the head alone).
// Every group communicates by NCCL's rules (the host stand-in's): under the
// in-flight check (comm/in_flight_check.h), where a buffer touched between
// an op's launch and its wait fails these tests, and with point-to-point
// messages paired by order alone (CommOptions::p2p_by_order).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "engine/model.h"
#include "engine/pipeline.h"
#include "engine/zero.h"
#include "grad_check.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using testing::world_rank;
using testing::world_size;

// One Groups per layout, built once (collective: every rank asks for the
// same layouts in the same order) and freed before MPI_Finalize.
std::map<std::string, std::unique_ptr<comm::Groups>>& groups_cache() {
  static std::map<std::string, std::unique_ptr<comm::Groups>> cache;
  return cache;
}

comm::LayoutOptions layout(int64_t pp, int64_t tp = 1) {
  comm::LayoutOptions o;
  o.pp = pp;
  o.tp = tp;
  o.num_experts = 4;
  return o;
}

std::string describe(const comm::LayoutOptions& o) {
  return "pp " + std::to_string(o.pp) + " x tp " + std::to_string(o.tp) + " x dp " +
         std::to_string(world_size() / (o.pp * o.tp));
}

comm::Groups& groups_for(const comm::LayoutOptions& o) {
  std::unique_ptr<comm::Groups>& g = groups_cache()[describe(o)];
  if (!g)
    g = std::make_unique<comm::Groups>(
        comm::Groups::create(comm::Layout(world_size(), o), MPI_COMM_WORLD, comm::Backend::mpi,
                             comm::CommOptions{.timeout_s = 60.0, .check_in_flight = true, .p2p_by_order = true}));
  return *g;
}

// The layouts this world size allows: pp = W, and pp = W/2 with a second
// axis of 2 (dp in the toy test, tp in the model test).
std::vector<comm::LayoutOptions> layouts(bool second_axis_tp) {
  const int64_t w = world_size();
  std::vector<comm::LayoutOptions> v{layout(w)};
  if (w % 2 == 0) v.push_back(second_axis_tp ? layout(w / 2, 2) : layout(w / 2));
  return v;
}

// Stage roots are every coordinate 0 but pp; with pp last in the order,
// stage s's root is world rank s·W/pp.
void expect_stage_root(const comm::Groups& g) {
  EXPECT_EQ(stage_root_rank(g), g.coords().pp * (world_size() / g.layout().pp()));
}

// ---- toy stages ------------------------------------------------------------------------------------

const Shape kToyBoundary{3, 5};

Tensor seeded(uint32_t seed) {
  std::mt19937 rng(testing::test_seed(seed));
  return testing::random_tensor(kToyBoundary, rng);
}

// Stage s's slope a_s (|a| in [0.5, 1.5], random sign) and offset b_s: the
// same on every rank.
Tensor slope(int64_t s) {
  std::mt19937 rng(testing::test_seed(1000 + static_cast<uint32_t>(s)));
  std::uniform_real_distribution<float> mag(0.5f, 1.5f);
  Tensor a = Tensor::empty(kToyBoundary, DType::f32, MemCategory::activation);
  for (int64_t i = 0; i < a.numel(); ++i) a.f32()[i] = (rng() % 2 ? 1.0f : -1.0f) * mag(rng);
  return a;
}
Tensor offset(int64_t s) { return seeded(2000 + static_cast<uint32_t>(s)); }

Tensor affine(const Tensor& h, int64_t s) {
  const Tensor a = slope(s), b = offset(s);
  Tensor y = Tensor::empty(kToyBoundary, DType::f32, MemCategory::activation);
  for (int64_t i = 0; i < y.numel(); ++i) y.f32()[i] = h.f32()[i] * a.f32()[i] + b.f32()[i];
  return y;
}

Tensor times_slope(const Tensor& d, int64_t s) {
  const Tensor a = slope(s);
  Tensor y = Tensor::empty(kToyBoundary, DType::f32, MemCategory::activation);
  for (int64_t i = 0; i < y.numel(); ++i) y.f32()[i] = d.f32()[i] * a.f32()[i];
  return y;
}

// The first stage's input and the last stage's output gradient of a
// micro-batch, tagged by dp replica so replicas carry different data.
Tensor toy_input(int64_t mb, int64_t dp) { return seeded(static_cast<uint32_t>(7919 * dp + 31 * mb + 1)); }
Tensor toy_output_grad(int64_t mb, int64_t dp) { return seeded(static_cast<uint32_t>(104729 + 7919 * dp + 31 * mb)); }

// Every comparison below is exact: the ranks run the same float operations
// in the same order as the local recomputation, and the transport copies bits.
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  float biggest = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    ASSERT_EQ(got.f32()[i], want.f32()[i]) << what << ", element " << i;
    biggest = std::max(biggest, std::abs(got.f32()[i]));
  }
  EXPECT_GT(biggest, 0.0f) << what << " is all zeros";
}

// Virtual stage u = chunk·p + s computes affine(·, u); the last virtual
// stage's output and the first's input gradient are checked against the
// composition over all p·v virtual stages.
void run_toy(const comm::LayoutOptions& o, PipeSchedule kind, int64_t v, int64_t m) {
  comm::Groups& g = groups_for(o);
  comm::Communicator& pp_group = g.get(comm::GroupKind::pp);
  comm::Communicator* pp = pp_group.size() > 1 ? &pp_group : nullptr;
  const int64_t p = o.pp, s = g.coords().pp, dp = g.coords().dp, last = p * v - 1;
  ASSERT_EQ(pp_group.size(), p);
  ASSERT_EQ(pp_group.rank(), s) << "the pp group's rank is the stage";
  expect_stage_root(g);
  const PipeScheduleSpec spec{kind, p, m, v};

  std::vector<PipeOp> calls;
  std::vector<Tensor> outputs(m), input_grads(m);
  const StageForward forward = [&](int64_t c, int64_t mb, Tensor h_in) {
    calls.push_back({PipeOp::forward, mb, c});
    const int64_t u = c * p + s;
    EXPECT_EQ(h_in.defined(), u > 0) << "forward " << mb;
    if (u > 0) {
      EXPECT_EQ(h_in.shape(), kToyBoundary);
    }
    Tensor y = affine(u == 0 ? toy_input(mb, dp) : h_in, u);
    if (u < last) return y;
    outputs[mb] = y;
    return Tensor();
  };
  const StageBackward backward = [&](int64_t c, int64_t mb, Tensor dh_out) {
    calls.push_back({PipeOp::backward, mb, c});
    const int64_t u = c * p + s;
    EXPECT_EQ(dh_out.defined(), u < last) << "backward " << mb;
    if (u < last) {
      EXPECT_EQ(dh_out.shape(), kToyBoundary);
    }
    Tensor dh_in = times_slope(u == last ? toy_output_grad(mb, dp) : dh_out, u);
    if (u > 0) return dh_in;
    input_grads[mb] = dh_in;
    return Tensor();
  };
  const StageWeight weight = [&](int64_t c, int64_t mb) { calls.push_back({PipeOp::weight, mb, c}); };
  const StageTiming t = run_pipeline(pp, spec, kToyBoundary, forward, backward, weight);

  EXPECT_EQ(calls, pipeline_schedule(spec, s)) << "callbacks out of schedule order";
  EXPECT_TRUE(std::isfinite(t.busy_s) && t.busy_s >= 0) << t.busy_s;
  EXPECT_TRUE(std::isfinite(t.idle_s) && t.idle_s >= 0) << t.idle_s;
  EXPECT_TRUE(t.idle_fraction() >= 0 && t.idle_fraction() <= 1) << t.idle_fraction();
  for (int64_t mb = 0; mb < m; ++mb) {
    if (s == p - 1) {
      Tensor want = toy_input(mb, dp);
      for (int64_t u = 0; u <= last; ++u) want = affine(want, u);
      expect_same(outputs[mb], want, "last stage output of micro-batch " + std::to_string(mb));
    }
    if (s == 0) {
      Tensor want = toy_output_grad(mb, dp);
      for (int64_t u = last; u >= 0; --u) want = times_slope(want, u);
      expect_same(input_grads[mb], want, "first stage input gradient of micro-batch " + std::to_string(mb));
    }
  }
}

TEST(PipelineMpi, ToyStagesComposeOverTheSchedule) {
  for (const comm::LayoutOptions& o : layouts(/*second_axis_tp=*/false))
    for (int64_t m : {1, 3, 8}) {
      SCOPED_TRACE(describe(o) + ", m = " + std::to_string(m));
      run_toy(o, PipeSchedule::one_f_one_b, 1, m);
      run_toy(o, PipeSchedule::zb_h1, 1, m);
      if (o.pp >= 2 && m % o.pp == 0)
        for (int64_t v : {2, 3}) run_toy(o, PipeSchedule::interleaved, v, m);
    }
}

// ---- model parity ----------------------------------------------------------------------------------

ModelConfig model_config() {
  ModelConfig m;
  m.vocab_size = 67;  // odd: the tp = 2 vocab slices differ in size (34 + 33)
  m.hidden_size = 32;
  m.num_layers = 4;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden_size = 48;
  m.init_std = 0.1;
  return m;
}

MoeConfig moe_config() {
  MoeConfig m;
  m.router.num_experts = 4;
  m.router.top_k = 2;
  m.ffn_hidden_size = 24;
  m.first_dense_layers = 1;  // layer 0 dense, 1..3 MoE
  m.shared_expert_hidden_size = 16;
  m.router.aux_loss_coeff = 0.01;
  m.router.z_loss_coeff = 1e-3;  // so both router losses' gradients take part
  return m;
}

constexpr int64_t kBatch = 2, kSeq = 16, kMicroBatches = 3;
constexpr uint64_t kSeed = 7;

std::vector<Tensor> micro_batches() {
  std::vector<Tensor> v;
  for (int64_t mb = 0; mb < kMicroBatches; ++mb) {
    std::mt19937 rng(testing::test_seed(500 + static_cast<uint32_t>(mb)));  // the same on every rank
    v.push_back(testing::random_tokens(kBatch, kSeq + 1, model_config().vocab_size, rng));
  }
  return v;
}

// Element [r, c] (or [c] of a vector) of `local` sits at [r, c] of the
// reference shifted by the shard's start along its dim.
int64_t global_index(const ParamInfo& p, int64_t i) {
  if (p.shard.dim < 0) return i;
  const int64_t cols = p.shape.size() > 1 ? p.shape[1] : 1, gcols = p.global_shape().size() > 1 ? p.global_shape()[1] : 1;
  int64_t r = i / cols, c = i % cols;
  (p.shard.dim == 0 ? r : c) += p.shard.start;
  return r * gcols + c;
}

struct Worst {
  double grad = 0;  // max over tensors of max|a − b| / max|ref|
  std::string where;
};

void check_parity(const comm::LayoutOptions& o, const std::vector<int64_t>& pp_layers, Worst& worst) {
  comm::Groups& g = groups_for(o);
  comm::Communicator& pp_group = g.get(comm::GroupKind::pp);
  comm::Communicator* pp = pp_group.size() > 1 ? &pp_group : nullptr;
  const ModelConfig cfg = model_config();
  const MoeConfig moe = moe_config();
  Model model(ctx, cfg, kSeed, moe, {.groups = &g, .pp_layers = pp_layers});
  Model ref(ctx, cfg, kSeed, moe);
  ZeroStore zero(ctx, model.params(), g);
  const PipelineStage& st = model.stage();
  expect_stage_root(g);

  // Ownership: the stage is pipeline_stage's, its names are the reference's
  // names of its layers, the embedding first and the head last.
  const PipelineStage want_stage = pipeline_stage(cfg.num_layers, o.pp, g.coords().pp, pp_layers);
  EXPECT_EQ(st.index, want_stage.index);
  EXPECT_EQ(st.count, o.pp);
  EXPECT_EQ(st.chunks[0].first_layer, want_stage.chunks[0].first_layer);
  EXPECT_EQ(st.chunks[0].end_layer, want_stage.chunks[0].end_layer);
  std::set<std::string> have, want;
  for (const ParamUnit& u : model.params().units()) {
    EXPECT_TRUE(u.name != "embedding" || st.first()) << u.name;
    EXPECT_TRUE(u.name != "final" || st.last()) << u.name;
    for (const ParamInfo& p : u.params) have.insert(p.name);
  }
  for (const ParamUnit& u : ref.params().units())
    for (const ParamInfo& p : u.params) {
      const std::string& n = p.name;
      const std::string prefix = "model.layers.";
      const bool owned = n.rfind(prefix, 0) == 0 ? st.owns_layer(std::stoll(n.substr(prefix.size())))
                         : n == "model.embed_tokens.weight" ? st.first()
                                                            : st.last();  // model.norm, lm_head
      if (owned) want.insert(n);
    }
  EXPECT_EQ(have, want);
  EXPECT_EQ(have.count("model.embed_tokens.weight"), st.first() ? 1u : 0u);
  EXPECT_EQ(have.count("lm_head.weight"), st.last() ? 1u : 0u);

  // One step's micro-batches, as engine/trainer.cpp runs them.
  const std::vector<Tensor> tokens = micro_batches();
  const float lm_scale = 1.0f / static_cast<float>(kMicroBatches * kBatch * kSeq);
  const float aux_scale = 1.0f / static_cast<float>(kMicroBatches);
  zero.begin_step();
  std::vector<ModelSaved> saved(kMicroBatches);
  const Tensor loss_sum = ctx.zeros({1}, DType::f64, MemCategory::workspace);
  ForwardStats stats;
  const StageForward forward = [&](int64_t, int64_t mb, Tensor h_in) {
    StageIO io{tokens[mb], std::move(h_in), &stats, &zero, loss_sum};
    model.forward(io, saved[mb]);
    return io.h_out;
  };
  const StageBackward backward = [&](int64_t, int64_t mb, Tensor dh_out) {
    StageGradIO io{lm_scale, aux_scale, &zero, std::move(dh_out)};
    model.backward(io, saved[mb]);
    return io.dh_in;
  };
  const StageTiming t = run_pipeline(pp, {PipeSchedule::one_f_one_b, comm::group_size(pp), kMicroBatches},
                                     model.boundary_shape(kBatch, kSeq), forward, backward);
  zero.finish_gradients();
  double loss = ctx.read_later(loss_sum).scalar_f64();
  EXPECT_TRUE(std::isfinite(t.busy_s) && t.busy_s >= 0 && std::isfinite(t.idle_s) && t.idle_s >= 0);
  if (!st.last()) {
    EXPECT_EQ(loss, 0.0) << "only the last stage scores";
  }
  int64_t moe_layers = 0;
  for (int64_t l = st.chunks[0].first_layer; l < st.chunks[0].end_layer; ++l) moe_layers += moe.is_moe_layer(l);
  ASSERT_EQ(static_cast<int64_t>(stats.moe.size()), moe_layers);
  for (int64_t i = 0; i < moe_layers; ++i) {
    EXPECT_TRUE(st.owns_layer(stats.moe[i].layer)) << stats.moe[i].layer;
    if (i > 0) {
      EXPECT_LT(stats.moe[i - 1].layer, stats.moe[i].layer);
    }
  }
  double aux = stats.aux_loss() + stats.z_loss();
  if (pp) {
    pp->all_reduce(std::span<double>(&loss, 1));  // the last stage's sum to every stage
    pp->all_reduce(std::span<double>(&aux, 1));   // Σ over the stages' layers
  }

  double ref_loss = 0;
  ForwardStats ref_stats;
  for (int64_t mb = 0; mb < kMicroBatches; ++mb) {
    ModelSaved s;
    ref_loss += ref.forward(tokens[mb], s, &ref_stats);
    ref.backward(s, lm_scale, aux_scale);
  }
  // fp32 activations, the same ops; tp only reorders sums: relative 1e-5.
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
  EXPECT_GT(ref_loss, 0.0);
  const double ref_aux = ref_stats.aux_loss() + ref_stats.z_loss();
  EXPECT_GT(ref_aux, 0.0);
  EXPECT_NEAR(aux, ref_aux, 1e-5 * ref_aux);

  // Gradients: |a − b| ≤ 1e-4·max|ref| + 1e-6 per tensor. Without tp the
  // stages run the one-rank model's ops on the same bits (measured: bitwise
  // equal); under tp = 2 the head, o/down projections and replicated-parameter
  // sums add fp32 partials in another order (~1e-7 relative per sum, grown by
  // a few layers of backward; measured 8.7e-7), far below the O(1e-3..1)
  // error of a missing, doubled or misplaced term.
  for (const ParamUnit& u : model.params().units())
    for (size_t i = 0; i < u.params.size(); ++i) {
      const ParamInfo& p = u.params[i];
      const Tensor got = u.grad_view(i), full = ref.params().grad(p.name);
      ASSERT_EQ(full.shape(), p.global_shape()) << p.name;
      double scale = 0, diff = 0;
      for (int64_t k = 0; k < got.numel(); ++k) {
        const double want_k = full.f32()[global_index(p, k)];
        scale = std::max(scale, std::abs(want_k));
        diff = std::max(diff, std::abs(static_cast<double>(got.f32()[k]) - want_k));
      }
      // Every expert gets tokens here (96 tokens × top-2 over 4 experts), so
      // no reference gradient is zero.
      EXPECT_GT(scale, 0.0) << p.name << ": zero reference gradient, the check would be vacuous";
      EXPECT_LE(diff, 1e-4 * scale + 1e-6) << p.name << " (" << describe(o) << ", stage " << st.index << ")";
      if (scale > 0 && diff / scale > worst.grad) worst = {diff / scale, p.name};
    }
}

TEST(PipelineMpi, StagesTrainTheOneRankModel) {
  struct Case {
    comm::LayoutOptions layout;
    std::vector<int64_t> pp_layers;
  };
  std::vector<Case> cases;
  for (const comm::LayoutOptions& o : layouts(/*second_axis_tp=*/true)) cases.push_back({o, {}});
  if (world_size() == 4) {
    cases.push_back({layout(4), {2, 0, 1, 1}});  // an empty middle stage
    cases.push_back({layout(4), {0, 2, 2, 0}});  // end stages with only the embedding / only the head
  }
  if (world_size() == 2) cases.push_back({layout(2), {3, 1}});
  for (const Case& c : cases) {
    std::string name = describe(c.layout);
    if (!c.pp_layers.empty()) name += ", pp_layers";
    for (int64_t n : c.pp_layers) name.append(" ").append(std::to_string(n));
    SCOPED_TRACE(name);
    Worst worst;
    check_parity(c.layout, c.pp_layers, worst);
    struct {
      double value;
      int rank;
    } mine{worst.grad, world_rank()}, all{};
    MPI_Allreduce(&mine, &all, 1, MPI_DOUBLE_INT, MPI_MAXLOC, MPI_COMM_WORLD);
    if (world_rank() == all.rank) {
      if (worst.grad == 0)
        std::printf("%s: every gradient bitwise equal to the reference\n", name.c_str());
      else
        std::printf("%s: worst gradient difference %.3g of max|ref| (rank %d, %s)\n", name.c_str(), worst.grad,
                    world_rank(), worst.where.c_str());
    }
    std::fflush(stdout);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

}  // namespace
}  // namespace origami

int main(int argc, char** argv) {
  return origami::testing::run_mpi_tests(argc, argv, 1, [] { origami::groups_cache().clear(); });
}
