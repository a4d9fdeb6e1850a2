// Which elements of which tensor a rank stores in a checkpoint and which it
// reads back, all derived from the unit table (engine/units.h): this file
// restates no shard rule, it intersects what the table says.
//
// A rank's part of a unit is one flat buffer (its held tensors in table
// order, each cut to its slice). ZeRO partitions that buffer over the unit's
// shard group (dp-cp or edp) into equal contiguous ranges, the last one
// short; a rank stores its range — at ZeRO 1-3 exactly the moments (and at 3
// the parameters) it owns, at stage 0 the same partition of what it holds
// whole, so the writing is spread over the group either way. Tensors held
// whole by every tp rank of a dense unit (norms, router, shared expert) are
// stored by tp rank 0 only. Hence every element of the global model is
// stored exactly once per state kind (params, exp_avg, exp_avg_sq).
//
// A stored piece is a slice of its tensor (a split of at most one dimension,
// `TensorSlice`) and a flat element range [begin, end) of that slice in
// row-major order. In global flat coordinates a piece is a few contiguous
// runs: one for a whole tensor or a dim-0 split, one per row for a dim-1
// split of a matrix. Resharding is intersecting runs.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/layout.h"
#include "engine/units.h"

namespace origami {

// The stored elements [begin, end) of one tensor's slice (row-major).
struct SliceRange {
  TensorSlice slice;  // held; shard.dim = -1 when whole
  int64_t begin = 0, end = 0;
  int64_t numel() const { return end - begin; }
  const Shape& global_shape() const { return slice.shard.dim < 0 ? slice.shape : slice.shard.global_shape; }
};

// All of a tensor of global shape `shape`, as one range.
SliceRange whole_range(const Shape& shape);

// A piece of one tensor inside a rank's flat unit buffer.
struct UnitPiece {
  size_t tensor = 0;        // index into UnitSpec::tensors
  SliceRange range;         // which elements
  int64_t unit_offset = 0;  // flat buffer index of element range.begin
};

// The ZeRO partition of a flat buffer of `numel` elements over `group_size`
// ranks: range [begin, end) of `group_rank` (the ParamStore's UnitShard
// rule, without padding: the last range is short or empty).
std::pair<int64_t, int64_t> zero_range(int64_t numel, int64_t group_size, int64_t group_rank);

// The pieces of tensors in [begin, end) of `local` (a rank's flat unit buffer).
std::vector<UnitPiece> pieces_in(const LocalUnit& local, int64_t begin, int64_t end);

// What world rank `rank` of `layout` stores of unit `u` (see the file
// comment); empty when the unit is on another stage (`stage_layers`: layers
// per stage) or the rank stores none of it.
std::vector<UnitPiece> stored_pieces(const UnitTable& table, const UnitSpec& u, const comm::Layout& layout, int rank,
                                     const std::vector<int64_t>& stage_layers);

// Copies the elements two ranges of one tensor share from `src` (the data
// of src_range, contiguous) into `dst` (dst_range's data); returns how many.
int64_t copy_overlap(const SliceRange& src_range, const float* src, const SliceRange& dst_range, float* dst);

}  // namespace origami
