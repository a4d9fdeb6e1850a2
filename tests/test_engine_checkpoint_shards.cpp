// Checkpoint shard maps (engine/checkpoint_shards.h), without MPI: over many
// layouts, the pieces ranks store tile every tensor of the model exactly
// once, and every rank of any other layout reassembles exactly its own
// slices from them. Elements carry their global index (data = index), and
// where an element belongs is computed here by plain index arithmetic, not
// by the runs the code under test uses.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <vector>

#include "engine/checkpoint_shards.h"
#include "engine/config.h"
#include "engine/plan.h"

namespace origami {
namespace {

struct LayoutCase {
  int64_t world, tp, cp, pp, ep, etp;
};

// Tiny-moe's shapes with what makes splits uneven: a vocab (257) that tp
// does not divide, a dense first layer, a shared expert, 8 experts.
struct Model {
  ModelConfig model;
  MoeConfig moe;
  Model() {
    model.num_layers = 4;
    model.hidden_size = 64;
    model.num_heads = 4;
    model.num_kv_heads = 2;
    model.ffn_hidden_size = 96;
    moe.router.num_experts = 8;
    moe.router.top_k = 2;
    moe.first_dense_layers = 1;
    moe.shared_expert_hidden_size = 32;
    moe.ffn_hidden_size = 48;
  }
};

comm::Layout make_layout(const LayoutCase& c, int64_t experts) {
  return comm::Layout(c.world, comm::LayoutOptions{c.tp, c.cp, c.pp, c.ep, c.etp, "tp-cp-ep-dp-pp", experts});
}

// The global flat index of element `i` (row-major) of a slice.
int64_t global_index(const SliceRange& r, int64_t i) {
  const Shape& g = r.global_shape();
  const Shape& s = r.slice.shape;
  int64_t rest = i, global = 0, stride = 1;
  std::vector<int64_t> idx(s.size());
  for (size_t d = s.size(); d-- > 0;) {
    idx[d] = rest % s[d];
    rest /= s[d];
  }
  for (size_t d = g.size(); d-- > 0;) {
    const int64_t at = idx[d] + (static_cast<int>(d) == r.slice.shard.dim ? r.slice.shard.start : 0);
    global += at * stride;
    stride *= g[d];
  }
  return global;
}

// Every stored piece of `layout`, by tensor name.
std::map<std::string, std::vector<SliceRange>> stored(const UnitTable& table, const comm::Layout& layout,
                                                      const std::vector<int64_t>& stages) {
  std::map<std::string, std::vector<SliceRange>> out;
  for (const UnitSpec& u : table.units())
    for (int r = 0; r < layout.world(); ++r)
      for (const UnitPiece& p : stored_pieces(table, u, layout, r, stages))
        out[u.tensors[p.tensor].name].push_back(p.range);
  return out;
}

const std::vector<LayoutCase> kLayouts = {
    {1, 1, 1, 1, 1, 1}, {4, 1, 1, 1, 4, 1}, {4, 2, 1, 1, 2, 1}, {4, 1, 1, 2, 1, 1}, {8, 2, 2, 2, 2, 1},
    {4, 1, 1, 1, 2, 2}, {8, 1, 1, 1, 8, 1}, {2, 2, 1, 1, 1, 2}, {8, 2, 1, 2, 4, 1}, {16, 2, 2, 2, 2, 2},
    {6, 1, 1, 1, 2, 1}, {12, 1, 3, 2, 2, 1},
};

TEST(CheckpointShards, EveryElementIsStoredExactlyOnce) {
  const Model m;
  const UnitTable table(m.model, m.moe);
  for (const LayoutCase& c : kLayouts) {
    SCOPED_TRACE(testing::Message() << "world " << c.world << " tp " << c.tp << " cp " << c.cp << " pp " << c.pp
                                    << " ep " << c.ep << " etp " << c.etp);
    const comm::Layout layout = make_layout(c, m.moe.router.num_experts);
    const auto pieces = stored(table, layout, plan::stage_layers(m.model.num_layers, c.pp));
    for (const UnitSpec& u : table.units())
      for (const TensorSpec& t : u.tensors) {
        std::vector<int> count(static_cast<size_t>(t.numel()), 0);
        ASSERT_TRUE(pieces.count(t.name)) << t.name << " is stored by no rank";
        for (const SliceRange& r : pieces.at(t.name)) {
          EXPECT_EQ(r.global_shape(), t.global_shape) << t.name;
          for (int64_t i = r.begin; i < r.end; ++i) ++count[static_cast<size_t>(global_index(r, i))];
        }
        for (size_t i = 0; i < count.size(); ++i)
          ASSERT_EQ(count[i], 1) << t.name << " element " << i << " stored " << count[i] << " times";
      }
  }
}

// Saved under one layout, each rank of another reassembles the whole of its
// own flat unit buffer (what it holds at ZeRO 0-2) and its ZeRO-3 range.
TEST(CheckpointShards, AnyLayoutReassemblesItsSlicesFromAnyOther) {
  const Model m;
  const UnitTable table(m.model, m.moe);
  int pairs = 0;
  for (const LayoutCase& from : kLayouts) {
    const comm::Layout saved_layout = make_layout(from, m.moe.router.num_experts);
    const auto pieces = stored(table, saved_layout, plan::stage_layers(m.model.num_layers, from.pp));
    // The stored data: each element is its global index.
    std::map<std::string, std::vector<std::vector<float>>> data;
    for (const auto& [name, ranges] : pieces)
      for (const SliceRange& r : ranges) {
        std::vector<float> d;
        for (int64_t i = r.begin; i < r.end; ++i) d.push_back(static_cast<float>(global_index(r, i)));
        data[name].push_back(std::move(d));
      }
    for (const LayoutCase& to : kLayouts) {
      SCOPED_TRACE(testing::Message() << "world " << from.world << " -> " << to.world << " (tp " << to.tp << " cp "
                                      << to.cp << " pp " << to.pp << " ep " << to.ep << " etp " << to.etp << ")");
      const comm::Layout layout = make_layout(to, m.moe.router.num_experts);
      const std::vector<int64_t> stages = plan::stage_layers(m.model.num_layers, to.pp);
      for (int rank = 0; rank < layout.world(); rank += 3) {  // every third rank keeps it fast
        const comm::RankCoords c = layout.coords(rank);
        for (const UnitSpec& u : table.units()) {
          if (u.stage(stages, to.pp) != c.pp) continue;
          const LocalUnit local = table.local_unit(u, layout, c);
          const comm::RankGroup g = layout.group_of(u.zero_group(), rank);
          const int64_t zr = std::find(g.begin(), g.end(), rank) - g.begin();
          const auto [zb, ze] = zero_range(local.numel, static_cast<int64_t>(g.size()), zr);
          for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, local.numel}, {zb, ze}})
            for (const UnitPiece& p : pieces_in(local, begin, end)) {
              const std::string& name = u.tensors[p.tensor].name;
              std::vector<float> got(static_cast<size_t>(p.range.numel()), -1.0f);
              int64_t copied = 0;
              const auto& src = pieces.at(name);
              for (size_t s = 0; s < src.size(); ++s)
                copied += copy_overlap(src[s], data.at(name)[s].data(), p.range, got.data());
              ASSERT_EQ(copied, p.range.numel()) << name;
              for (int64_t i = 0; i < p.range.numel(); ++i)
                ASSERT_EQ(got[static_cast<size_t>(i)], static_cast<float>(global_index(p.range, p.range.begin + i)))
                    << name << " element " << i << " of rank " << rank;
            }
        }
      }
      ++pairs;
    }
  }
  EXPECT_EQ(pairs, static_cast<int>(kLayouts.size() * kLayouts.size()));
}

}  // namespace
}  // namespace origami
