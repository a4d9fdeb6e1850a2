// Parameter store (see params.h).
#include "engine/params.h"

#include <algorithm>
#include <cmath>

#include "kernels/elementwise.h"
#include "kernels/init.h"

namespace origami {

namespace {

// Fills `out` with elements [local_begin, local_begin + out.numel()) of
// parameter `p`'s local tensor, flattened. Every element is a function of
// (seed, name, global index) alone, so any range of any slice draws what the
// whole global tensor would hold there: a split of dim 0 is one contiguous
// run of global indices; a split of dim 1 of a matrix is one run per row.
void init_param_range(const ExecContext& ctx, Tensor out, uint64_t seed, const ParamInfo& p, int64_t local_begin,
                      float stddev) {
  const int64_t n = out.numel();
  if (p.init == InitKind::ones) return init_constant(ctx, out, 1.0f);
  if (p.shard.dim < 0) return init_normal(ctx, out, seed, p.name, local_begin, stddev);
  const Shape& g = p.global_shape();
  const int64_t inner = shape_numel(g) / g[0];  // elements per global row
  if (p.shard.dim == 0) return init_normal(ctx, out, seed, p.name, p.shard.start * inner + local_begin, stddev);
  ORIGAMI_CHECK(p.shard.dim == 1 && g.size() == 2, "parameter ", p.name, ": only dims 0 and 1 of a matrix shard");
  const int64_t cols = p.shape[1], local_end = local_begin + n;
  for (int64_t r = local_begin / cols; r * cols < local_end; ++r) {
    const int64_t c0 = std::max(local_begin, r * cols) - r * cols, c1 = std::min(local_end, (r + 1) * cols) - r * cols;
    Tensor run = out.flat_view(r * cols + c0 - local_begin, c1 - c0, {c1 - c0});
    init_normal(ctx, run, seed, p.name, r * g[1] + p.shard.start + c0, stddev);
  }
}

}  // namespace

ParamUnit& ParamStore::add_unit(const std::string& name, bool expert) {
  ORIGAMI_CHECK(units_.empty() || !units_.back().param.defined(), "add_unit after allocate()");
  units_.push_back(ParamUnit{});
  units_.back().name = name;
  units_.back().expert = expert;
  return units_.back();
}

void ParamStore::add_units(const UnitTable& table, const comm::Layout& layout, const comm::RankCoords& coords,
                           const PipelineStage& stage) {
  for (const UnitSpec& spec : table.units()) {
    if (!spec.on_stage(stage)) continue;
    ParamUnit& unit = add_unit(spec.name, spec.expert);
    const LocalUnit local = table.local_unit(spec, layout, coords);
    for (size_t k = 0; k < local.tensors.size(); ++k) {
      const TensorSpec& t = spec.tensors[local.tensors[k]];
      const TensorSlice& s = local.slices[k];
      add_param(unit, t.name, s.shape, t.init, s.shard, spec.tp_replicated(t));
    }
    ORIGAMI_CHECK(unit.numel == local.numel, "unit ", spec.name, ": ", unit.numel,
                  " elements registered, the table says ", local.numel);
  }
}

void ParamStore::add_param(ParamUnit& unit, const std::string& name, Shape shape, InitKind init, ShardSpec shard,
                           bool tp_replicated) {
  ORIGAMI_CHECK(!index_.count(name), "parameter ", name, " registered twice");
  if (shard.dim >= 0) {
    ORIGAMI_CHECK(shard.global_shape.size() == shape.size() && shard.dim < static_cast<int>(shape.size()) &&
                      shard.start >= 0 && shard.start + shape[shard.dim] <= shard.global_shape[shard.dim],
                  "parameter ", name, ": shard ", shape_string(shape), " at ", shard.start, " along dim ", shard.dim,
                  " does not fit ", shape_string(shard.global_shape));
    for (size_t d = 0; d < shape.size(); ++d)
      ORIGAMI_CHECK(static_cast<int>(d) == shard.dim || shape[d] == shard.global_shape[d], "parameter ", name,
                    ": shard and global shape differ outside dim ", shard.dim);
  }
  ParamInfo info{name, std::move(shape), unit.numel, init, std::move(shard), tp_replicated};
  unit.numel += info.numel();
  index_[name] = {static_cast<size_t>(&unit - units_.data()), unit.params.size()};
  unit.params.push_back(std::move(info));
}

void ParamStore::allocate(Device device, DType param_dtype, const std::function<UnitShard(const ParamUnit&)>& shard_of) {
  ORIGAMI_CHECK(param_dtype == DType::f32 || param_dtype == DType::bf16, "parameters in ", to_string(param_dtype),
                ": the recipes are f32 and bf16");
  device_ = device;
  param_dtype_ = param_dtype;
  const DType pd = param_dtype;
  for (ParamUnit& u : units_) {
    UnitShard& s = u.shard;
    s = shard_of ? shard_of(u) : UnitShard{};
    ORIGAMI_CHECK(s.group_size >= 1 && s.group_rank >= 0 && s.group_rank < s.group_size, "unit ", u.name,
                  ": bad shard group ", s.group_rank, " of ", s.group_size);
    ORIGAMI_CHECK(s.optim || (!s.grads && !s.params), "unit ", u.name, ": ZeRO stages shard moments first");
    if (s.optim) {  // sharded: pad to divide the group, own one slice
      s.padded = (u.numel + s.group_size - 1) / s.group_size * s.group_size;
      s.size = s.padded / s.group_size;
      s.begin = s.group_rank * s.size;
    } else {  // whole: this rank "owns" all of it
      s.padded = s.size = u.numel;
      s.begin = 0;
    }
    // Padding elements are zero in every buffer and stay zero (no gradient
    // reaches them, and AdamW leaves a zero param with zero moments at zero).
    if (s.params)
      u.param_shard = Tensor::zeros({s.size}, pd, MemCategory::param, device);
    else
      u.param = Tensor::zeros({s.padded}, pd, MemCategory::param, device);
    if (s.grads)
      u.grad_shard = Tensor::zeros({s.size}, pd, MemCategory::grad, device);
    else
      u.grad = Tensor::zeros({s.padded}, pd, MemCategory::grad, device);
    const int64_t m = s.optim ? s.size : s.padded;
    if (pd != DType::f32) u.master = Tensor::zeros({m}, DType::f32, MemCategory::optim, device);
    u.exp_avg = Tensor::zeros({m}, DType::f32, MemCategory::optim, device);
    u.exp_avg_sq = Tensor::zeros({m}, DType::f32, MemCategory::optim, device);
  }
}

void ParamStore::initialize(const ExecContext& ctx, uint64_t seed, float init_std, int64_t num_layers) {
  // Output projections feed the residual stream once per sub-block; scaling
  // them by 1/sqrt(2L) keeps the residual variance flat in depth.
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(num_layers));
  // Draws the part of the unit's flat buffer [begin, begin + buf.numel()) into
  // `buf` (zeros outside every parameter: the padding).
  auto draw = [&](const ParamUnit& u, Tensor& buf, int64_t begin) {
    const int64_t end = begin + buf.numel();
    for (const ParamInfo& p : u.params) {
      const int64_t a = std::max(begin, p.offset), b = std::min(end, p.offset + p.numel());
      if (a >= b) continue;
      const float stddev = p.init == InitKind::normal_scaled_output ? out_std : init_std;
      init_param_range(ctx, buf.flat_view(a - begin, b - a, {b - a}), seed, p, a - p.offset, stddev);
    }
  };
  for (ParamUnit& u : units_) {
    const bool sharded = u.shard.params, mixed = u.master.defined();
    if (sharded) {
      // ZeRO-3 (its moments are sharded alike): only this rank's slice is
      // drawn, in fp32, and the master and the bf16 params take it.
      Tensor slice = mixed ? ctx.zeros({u.shard.size}, DType::f32, MemCategory::workspace) : u.param_shard;
      draw(u, slice, u.shard.begin);
      if (mixed) {
        u.master.copy_from(slice);
        cast(ctx, slice, u.param_shard);
      }
    } else if (mixed) {
      // bf16 params whole: drawn whole in fp32, the master takes its slice.
      Tensor whole = ctx.zeros({u.shard.padded}, DType::f32, MemCategory::workspace);
      draw(u, whole, 0);
      u.master.copy_from(u.shard.optim ? whole.flat_view(u.shard.begin, u.shard.size, {u.shard.size}) : whole);
      cast(ctx, whole, u.param);
    } else {
      draw(u, u.param, 0);
    }
  }
}

int64_t ParamStore::total_params() const {
  int64_t n = 0;
  for (const ParamUnit& u : units_) n += u.numel;
  return n;
}

ParamRef ParamStore::ref(const std::string& name) const {
  auto it = index_.find(name);
  ORIGAMI_CHECK(it != index_.end(), "no parameter named ", name);
  return {it->second.first, it->second.second};
}

void ParamStore::zero_grads(const ExecContext& ctx) {
  for (ParamUnit& u : units_) {
    if (u.grad.defined()) ctx.fill_zero(u.grad);
    if (u.grad_shard.defined()) ctx.fill_zero(u.grad_shard);
  }
}

}  // namespace origami
