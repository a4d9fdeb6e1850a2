// The unit table (engine/units.h) as properties, without MPI: for several
// layouts of tiny-moe (also with placed experts, moe.expert_placement) and
// of a GQA model with a shared expert, every rank's ParamStore registration
// (ParamStore::add_units) holds exactly the table's slices; the slices of
// each replica group tile every tensor's global shape exactly once (through
// place_slice); the planner's per-rank unit figures are the registered ones;
// and the table's parameter counts equal the Model's measured count and the
// planner's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "engine/model.h"
#include "engine/plan.h"
#include "engine/units.h"
#include "kernels/allocator.h"
#include "kernels/elementwise.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

Config load(const std::string& name, const std::vector<std::string>& overrides = {}) {
  return load_config(std::string(ORIGAMI_SOURCE_DIR) + "/configs/" + name, overrides);
}

std::vector<Config> configs() {
  return {
      load("tiny-moe.toml"),
      // GQA 6 heads over 2 kv heads, a shared expert (whole on every tp rank)
      // whose width 90 no tp here divides.
      load("tiny-moe.toml", {"model.hidden_size=192", "model.num_heads=6", "model.num_kv_heads=2",
                             "moe.shared_expert_hidden_size=90", "training.seq_len=96", "training.micro_batch=1",
                             "training.global_batch=16"}),
      // Layers 1 and 3 placed for EP 2 (the layouts of EP 2 below use it, the
      // others keep contiguous blocks).
      load("tiny-moe.toml", {"parallel.ep=2", "moe.expert_placement={ep = 2, layers = {"
                                                "1 = [[0, 3, 5, 6], [1, 2, 4, 7]], 3 = [[7, 6, 5, 4], [3, 2, 1, 0]]}}"}),
  };
}

struct Sizes {
  int64_t world, tp, cp, pp, ep, etp;
};
// Uneven vocab rows (257 over tp 2), ETP with EP, pipeline stages, CP, and a
// world where EDP differs from DP.
const Sizes kLayouts[] = {{1, 1, 1, 1, 1, 1}, {2, 2, 1, 1, 1, 1}, {4, 2, 1, 1, 2, 1}, {6, 2, 1, 1, 2, 1},
                          {8, 2, 2, 2, 2, 1}, {8, 1, 1, 2, 2, 2}, {16, 2, 2, 2, 4, 2}, {8, 1, 2, 1, 8, 1}};

// The coordinates a tensor is not split over, with the split ones zeroed:
// the ranks sharing this key hold one copy of the tensor between them.
std::vector<int64_t> replica_key(const UnitSpec& u, const TensorSpec& t, const comm::RankCoords& c) {
  if (u.expert) return {c.edp, c.pp};  // split over ep (which experts) and etp
  if (t.rule == ShardRule::whole) return {c.tp, c.cp, c.dp, c.pp};
  return {c.cp, c.dp, c.pp};  // split over tp
}

TEST(Units, NamesAreUniqueAndTheOneRankModelRegistersTheTableInOrder) {
  for (const Config& cfg : configs()) {
    SCOPED_TRACE(cfg.source);
    const UnitTable table(cfg.model, cfg.moe);
    std::set<std::string> names;
    size_t n = 0;
    for (const UnitSpec& u : table.units())
      for (const TensorSpec& t : u.tensors) names.insert(t.name), ++n;
    EXPECT_EQ(names.size(), n);

    static TrackedAllocator& allocator = TrackedAllocator::host();  // outlives the model
    (void)allocator;
    const Model model(ctx, cfg.model, 7, cfg.moe);
    const std::vector<ParamUnit>& store = model.params().units();
    ASSERT_EQ(store.size(), table.units().size());
    for (size_t u = 0; u < store.size(); ++u) {
      const UnitSpec& spec = table.units()[u];
      EXPECT_EQ(store[u].name, spec.name);
      EXPECT_EQ(store[u].expert, spec.expert);
      ASSERT_EQ(store[u].params.size(), spec.tensors.size()) << spec.name;
      for (size_t i = 0; i < spec.tensors.size(); ++i) {
        EXPECT_EQ(store[u].params[i].name, spec.tensors[i].name);
        EXPECT_EQ(store[u].params[i].shape, spec.tensors[i].global_shape) << spec.tensors[i].name;
        EXPECT_EQ(store[u].params[i].init, spec.tensors[i].init) << spec.tensors[i].name;
      }
    }
    // Parameter counts: the table's, the model's measured and the planner's.
    const ParamCounts c = table.counts();
    EXPECT_EQ(c.total, model.params().total_params());
    EXPECT_EQ(c.matmul_active, model.active_matmul_params());
    const plan::ParamCounts p = plan::param_counts(cfg.model, cfg.moe);
    EXPECT_EQ(p.total, c.total);
    EXPECT_EQ(p.active, c.active);
    EXPECT_EQ(p.expert, c.expert);
    EXPECT_EQ(p.matmul_active, c.matmul_active);
    // By hand: everything, then top_k/E of the routed experts.
    const int64_t E = cfg.moe.router.num_experts, Fe = cfg.moe.expert_ffn(cfg.model.ffn_hidden_size);
    const int64_t D = cfg.model.hidden_size;
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < cfg.model.num_layers; ++l) moe_layers += cfg.moe.is_moe_layer(l);
    EXPECT_EQ(c.expert, moe_layers * 3 * E * Fe * D);
    EXPECT_EQ(c.active, c.total - c.expert + moe_layers * 3 * cfg.moe.router.top_k * Fe * D);
  }
}

TEST(Units, EveryRanksSlicesTileEachTensorOncePerReplicaGroup) {
  for (const Config& cfg : configs()) {
    const UnitTable table(cfg.model, cfg.moe);
    int64_t planned = 0;
    for (const Sizes& z : kLayouts) {
      ParallelConfig par = cfg.parallel;
      par.tp = z.tp, par.cp = z.cp, par.pp = z.pp, par.ep = z.ep, par.etp = z.etp;
      if (!layout_problem(cfg.model, cfg.moe, cfg.training, par, z.world).empty()) continue;
      ++planned;
      SCOPED_TRACE(cfg.source + ": world " + std::to_string(z.world) + " tp " + std::to_string(z.tp) + " cp " +
                   std::to_string(z.cp) + " pp " + std::to_string(z.pp) + " ep " + std::to_string(z.ep) + " etp " +
                   std::to_string(z.etp));
      const comm::Layout layout(
          z.world, comm::LayoutOptions{z.tp, z.cp, z.pp, z.ep, z.etp, par.order, cfg.moe.router.num_experts});
      // Per tensor and replica group: the whole tensor, each element marked
      // by the rank that placed it (0: nobody).
      std::map<std::pair<std::string, std::vector<int64_t>>, std::vector<float>> wholes;
      std::map<std::pair<std::string, std::vector<int64_t>>, std::map<int, int64_t>> placed;
      std::vector<ParamStore> stores(static_cast<size_t>(z.world));
      for (int r = 0; r < z.world; ++r) {
        const comm::RankCoords c = layout.coords(r);
        const PipelineStage stage = pipeline_stage(cfg.model.num_layers, z.pp, c.pp);
        ParamStore& store = stores[static_cast<size_t>(r)];
        store.add_units(table, layout, c, stage);  // what a real rank registers
        size_t k = 0;
        for (const UnitSpec& u : table.units()) {
          if (!u.on_stage(stage)) continue;
          const ParamUnit& pu = store.units()[k++];
          ASSERT_EQ(pu.name, u.name);
          const LocalUnit local = table.local_unit(u, layout, c);
          EXPECT_EQ(pu.numel, local.numel) << u.name;
          EXPECT_EQ(table.local_numel(u, layout, c), std::make_pair(local.numel, local.tp_replicated)) << u.name;
          ASSERT_EQ(pu.params.size(), local.tensors.size()) << u.name;
          for (size_t i = 0; i < local.tensors.size(); ++i) {
            const TensorSpec& t = u.tensors[local.tensors[i]];
            const TensorSlice& s = local.slices[i];
            const ParamInfo& p = pu.params[i];
            EXPECT_EQ(p.name, t.name);
            EXPECT_EQ(p.shape, s.shape) << t.name;
            EXPECT_EQ(p.global_shape(), t.global_shape) << t.name;
            EXPECT_EQ(p.tp_replicated, u.tp_replicated(t)) << t.name;
            const auto key = std::make_pair(t.name, replica_key(u, t, c));
            std::vector<float>& whole = wholes[key];
            whole.resize(static_cast<size_t>(t.numel()), 0.0f);
            const std::vector<float> mine(static_cast<size_t>(s.numel()), static_cast<float>(r + 1));
            place_slice(s, mine.data(), whole.data());
            placed[key][r] = s.numel();
          }
        }
        EXPECT_EQ(k, store.units().size());
      }
      // Exactly once: every element placed, and each rank's mark survives on
      // all of its elements (an overlap would overwrite some).
      std::map<std::string, int64_t> groups_of;
      for (const auto& [key, whole] : wholes) {
        std::map<int, int64_t> seen;
        for (float v : whole) {
          ASSERT_NE(v, 0.0f) << key.first << ": an element no rank of its replica group holds";
          ++seen[static_cast<int>(v) - 1];
        }
        EXPECT_EQ(seen, placed[key]) << key.first;
        ++groups_of[key.first];
      }
      // Every tensor appears, in world / (the ranks one copy spans) groups.
      for (const UnitSpec& u : table.units())
        for (const TensorSpec& t : u.tensors) {
          const int64_t span = u.expert ? z.ep * z.etp : t.rule == ShardRule::whole ? 1 : z.tp;
          EXPECT_EQ(groups_of[t.name], z.world / z.pp / span) << t.name;
        }
      // The planner's figures are the first rank of each stage's registration.
      const std::vector<plan::UnitPlan> units = plan::plan_units(plan::plan_input(cfg), layout);
      ASSERT_EQ(units.size(), table.units().size());
      for (size_t i = 0; i < units.size(); ++i) {
        const UnitSpec& u = table.units()[i];
        EXPECT_EQ(units[i].name, u.name);
        EXPECT_EQ(units[i].numel, u.numel);
        EXPECT_EQ(units[i].group, u.zero_group_size(layout));
        int64_t root = 0;
        for (int r = 0; r < z.world; ++r)
          if (layout.coords(r).pp == units[i].stage && layout.coords(r).tp == 0 && layout.coords(r).cp == 0 &&
              layout.coords(r).dp == 0 && layout.coords(r).ep == 0 && layout.coords(r).etp == 0) {
            root = r;
            break;
          }
        const ParamStore& store = stores[static_cast<size_t>(root)];
        const auto it = std::find_if(store.units().begin(), store.units().end(),
                                     [&](const ParamUnit& pu) { return pu.name == u.name; });
        ASSERT_NE(it, store.units().end()) << u.name << " not on world rank " << root;
        EXPECT_EQ(units[i].local, it->numel) << u.name;
        int64_t replicated = 0;
        for (const ParamInfo& p : it->params) replicated += p.tp_replicated ? p.numel() : 0;
        EXPECT_EQ(units[i].tp_replicated, replicated) << u.name;
      }
    }
    EXPECT_GE(planned, 5) << cfg.source << ": too few layouts accepted to test";
  }
}

// ZeRO-3 draws only a rank's slice of each unit (ParamStore::initialize):
// every slice, of every unit of a TP 2 rank (rows of a dim-0 split, runs of
// each row of a dim-1 split, whole tensors, ones), cut at an odd group size
// so slices begin and end inside tensors and rows, is bitwise the same slice
// of the unit drawn whole, with zero padding; in fp32, and in the bf16
// recipe its fp32 master alike and its params that rounded to bf16.
TEST(Units, AZeroThreeSliceDrawsBitwiseWhatTheWholeUnitHolds) {
  const Config cfg = configs()[1];  // GQA and a shared expert: every shard rule
  const UnitTable table(cfg.model, cfg.moe);
  const comm::Layout layout(2, comm::LayoutOptions{2, 1, 1, 1, 1, cfg.parallel.order, cfg.moe.router.num_experts});
  const comm::RankCoords coords = layout.coords(1);
  const PipelineStage stage = pipeline_stage(cfg.model.num_layers, 1, 0);
  const float init_std = 0.05f;
  ParamStore whole;
  whole.add_units(table, layout, coords, stage);
  whole.allocate(Device::cpu(), DType::f32, nullptr);
  whole.initialize(ctx, 17, init_std, cfg.model.num_layers);
  int64_t split_dim1 = 0, cut_inside = 0;
  for (const ParamUnit& u : whole.units())
    for (const ParamInfo& p : u.params) split_dim1 += p.shard.dim == 1;
  EXPECT_GT(split_dim1, 0) << "no tensor split along dim 1 to test";
  constexpr int64_t kGroup = 3;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (int64_t g = 0; g < kGroup; ++g) {
      SCOPED_TRACE(std::string(to_string(dtype)) + ", slice " + std::to_string(g) + " of " + std::to_string(kGroup));
      ParamStore sliced;
      sliced.add_units(table, layout, coords, stage);
      sliced.allocate(Device::cpu(), dtype, [&](const ParamUnit&) {
        return UnitShard{.group_size = kGroup, .group_rank = g, .optim = true, .grads = true, .params = true};
      });
      sliced.initialize(ctx, 17, init_std, cfg.model.num_layers);
      for (size_t i = 0; i < whole.units().size(); ++i) {
        const ParamUnit &w = whole.units()[i], &s = sliced.units()[i];
        SCOPED_TRACE(s.name);
        ASSERT_TRUE(s.shard.params);
        std::vector<float> want(static_cast<size_t>(s.shard.size), 0.0f);  // zero past the unit's end
        const int64_t n = std::max<int64_t>(0, std::min(s.shard.size, w.numel - s.shard.begin));
        std::copy_n(w.param.f32() + s.shard.begin, n, want.begin());
        for (const ParamInfo& p : s.params) {
          const int64_t b = s.shard.begin, e = b + s.shard.size;
          cut_inside += (b > p.offset && b < p.offset + p.numel()) || (e > p.offset && e < p.offset + p.numel());
        }
        const Tensor& fp32 = dtype == DType::f32 ? s.param_shard : s.master;
        ASSERT_EQ(fp32.numel(), s.shard.size);
        EXPECT_EQ(std::memcmp(fp32.f32(), want.data(), want.size() * sizeof(float)), 0);
        if (dtype == DType::bf16) {
          Tensor from = Tensor::empty({s.shard.size}, DType::f32, MemCategory::workspace);
          std::copy(want.begin(), want.end(), from.f32());
          Tensor rounded = Tensor::empty({s.shard.size}, DType::bf16, MemCategory::workspace);
          cast(ctx, from, rounded);
          EXPECT_EQ(std::memcmp(s.param_shard.raw(), rounded.raw(), rounded.nbytes()), 0);
        }
      }
    }
  }
  EXPECT_GT(cut_inside, 10) << "too few slices begin or end inside a tensor";
}

}  // namespace
}  // namespace origami
