// Checkpoint shard maps (see checkpoint_shards.h).
#include "engine/checkpoint_shards.h"

#include <algorithm>

#include "kernels/check.h"

namespace origami {

namespace {

// A contiguous run of a range in global flat coordinates: `count` elements
// from global index `global`, at `local` in the range's slice.
struct Run {
  int64_t global = 0, local = 0, count = 0;
};

std::vector<Run> runs_of(const SliceRange& r) {
  std::vector<Run> runs;
  if (r.begin >= r.end) return runs;
  const TensorSlice& s = r.slice;
  if (s.shard.dim < 0) return {{r.begin, r.begin, r.numel()}};
  const Shape& g = s.shard.global_shape;
  const int64_t inner = shape_numel(g) / g[0];  // elements per global row
  if (s.shard.dim == 0) return {{s.shard.start * inner + r.begin, r.begin, r.numel()}};
  ORIGAMI_CHECK(s.shard.dim == 1 && g.size() == 2, "checkpoint: only dims 0 and 1 of a matrix split");
  const int64_t cols = s.shape[1];
  for (int64_t row = r.begin / cols; row * cols < r.end; ++row) {
    const int64_t b = std::max(r.begin, row * cols), e = std::min(r.end, (row + 1) * cols);
    runs.push_back({row * g[1] + s.shard.start + (b - row * cols), b, e - b});
  }
  return runs;
}

// This rank's place in a unit's ZeRO group: (size, rank).
std::pair<int64_t, int64_t> zero_place(const UnitSpec& u, const comm::Layout& layout, int rank) {
  const comm::RankGroup g = layout.group_of(u.zero_group(), rank);
  const auto it = std::find(g.begin(), g.end(), rank);
  ORIGAMI_CHECK(it != g.end(), "checkpoint: rank ", rank, " is not in its own ", u.name, " shard group");
  return {static_cast<int64_t>(g.size()), static_cast<int64_t>(it - g.begin())};
}

}  // namespace

SliceRange whole_range(const Shape& shape) {
  SliceRange r;
  r.slice.held = true;
  r.slice.shape = shape;
  r.end = shape_numel(shape);
  return r;
}

std::pair<int64_t, int64_t> zero_range(int64_t numel, int64_t group_size, int64_t group_rank) {
  const int64_t chunk = (numel + group_size - 1) / group_size;
  const int64_t begin = std::min(numel, group_rank * chunk);
  return {begin, std::min(numel, begin + chunk)};
}

std::vector<UnitPiece> pieces_in(const LocalUnit& local, int64_t begin, int64_t end) {
  std::vector<UnitPiece> out;
  int64_t offset = 0;
  for (size_t k = 0; k < local.tensors.size(); ++k) {
    const int64_t n = local.slices[k].numel();
    const int64_t b = std::max(begin, offset), e = std::min(end, offset + n);
    if (b < e) out.push_back({local.tensors[k], {local.slices[k], b - offset, e - offset}, b});
    offset += n;
  }
  return out;
}

std::vector<UnitPiece> stored_pieces(const UnitTable& table, const UnitSpec& u, const comm::Layout& layout, int rank,
                                     const std::vector<int64_t>& stage_layers) {
  const comm::RankCoords c = layout.coords(rank);
  if (u.stage(stage_layers, layout.pp()) != c.pp) return {};
  const LocalUnit local = table.local_unit(u, layout, c);
  const auto [size, index] = zero_place(u, layout, rank);
  const auto [begin, end] = zero_range(local.numel, size, index);
  std::vector<UnitPiece> out = pieces_in(local, begin, end);
  if (c.tp != 0)  // tp rank 0 stores what every tp rank holds whole
    std::erase_if(out, [&](const UnitPiece& p) { return u.tp_replicated(u.tensors[p.tensor]); });
  return out;
}

int64_t copy_overlap(const SliceRange& src_range, const float* src, const SliceRange& dst_range, float* dst) {
  const std::vector<Run> a = runs_of(src_range), b = runs_of(dst_range);
  int64_t copied = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].global, b[j].global);
    const int64_t hi = std::min(a[i].global + a[i].count, b[j].global + b[j].count);
    if (lo < hi) {
      std::copy_n(src + (a[i].local - src_range.begin) + (lo - a[i].global), hi - lo,
                  dst + (b[j].local - dst_range.begin) + (lo - b[j].global));
      copied += hi - lo;
    }
    // Runs of each list ascend and do not overlap: advance the one ending first.
    if (a[i].global + a[i].count <= b[j].global + b[j].count) ++i;
    else ++j;
  }
  return copied;
}

}  // namespace origami
