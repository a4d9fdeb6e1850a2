// Parameter store: the model's state in units (ARCHITECTURE.md §6). A unit is
// one flat buffer each for params, grads and the two AdamW moments; named
// tensors are views into it at fixed offsets. Units are the grain ZeRO shards
// and gathers: a unit sharded over N ranks is padded to a multiple of N and
// each rank owns one contiguous 1/N of it (UnitShard). Which buffers are
// whole and which are shards follows the ZeRO stage; engine/zero.h gathers,
// frees and reduces them.
// What a rank holds comes from the unit table (engine/units.h): add_units
// registers this rank's part of every unit of its stage.
// Invariant: tensors of a unit are laid out in registration order, contiguous.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/units.h"
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

struct ParamInfo {
  std::string name;  // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Shape shape;       // this rank's (local) shape
  int64_t offset = 0;  // elements into the unit's flat buffer
  InitKind init = InitKind::normal;
  ShardSpec shard;
  // Whole on every tp rank (norms, router, shared expert): each tp rank's
  // gradient covers only its tokens, so it is summed over tp (engine/zero.h)
  // and counted once in the grad norm.
  bool tp_replicated = false;
  bool weight_decay() const { return shape.size() >= 2; }
  int64_t numel() const { return shape_numel(shape); }
  const Shape& global_shape() const { return shard.dim < 0 ? shape : shard.global_shape; }
};

// ZeRO layout of one unit over its shard group (dense units: dp-cp; expert
// units: edp). Stage 0, or a group of one rank: nothing sharded.
struct UnitShard {
  int64_t group_size = 1, group_rank = 0;
  int64_t padded = 0;  // numel rounded up to a multiple of group_size (sharded), else numel
  int64_t begin = 0;   // this rank's slice of the padded buffer: [begin, begin + size)
  int64_t size = 0;    // (the whole unit when nothing is sharded)
  bool optim = false;   // stages 1-3: moments hold the slice only
  bool grads = false;   // stages 2-3: only grad_shard persists; grad is whole only during backward
  bool params = false;  // stage 3: only param_shard persists; param is whole only while gathered
};

struct ParamUnit {
  std::string name;  // "embedding", "layers.3", "layers.3.experts", "final"
  bool expert = false;  // expert weights: gradients reduce over edp, not dp-cp
  std::vector<ParamInfo> params;
  int64_t numel = 0;
  UnitShard shard;
  // Whole-unit buffers, [shard.padded] (undefined while a ZeRO-3 unit is not
  // gathered, or a ZeRO-2/3 unit is outside its backward).
  Tensor param, grad;
  Tensor param_shard, grad_shard;  // [shard.size], stage 3 / stages 2-3
  Tensor exp_avg, exp_avg_sq;      // [shard.size] when shard.optim, else [padded]
  // The bf16 recipe's fp32 master weights, shaped like the moments (the
  // optimizer's slice); undefined in fp32, where the params are the master.
  Tensor master;

  Tensor param_view(size_t i) const { return view_of(param, i); }
  Tensor grad_view(size_t i) const { return view_of(grad, i); }
  Tensor view_of(const Tensor& flat, size_t i) const {
    return flat.flat_view(params[i].offset, params[i].numel(), params[i].shape);
  }
};

// A parameter resolved once (its unit and its place in the unit's params):
// views through a ref need no name lookup, so modules resolve names at
// construction and take views per use (a ZeRO-3 unit's buffer changes between
// gathers; the ref does not).
struct ParamRef {
  size_t unit = 0, index = 0;
};

class ParamStore {
 public:
  // Registration phase: declare units and their tensors, then allocate().
  // add_units: the units of `table` on `stage`, each with the tensors the
  // rank at `coords` of `layout` holds, cut to its slices (UnitTable::local_unit).
  void add_units(const UnitTable& table, const comm::Layout& layout, const comm::RankCoords& coords,
                 const PipelineStage& stage);
  ParamUnit& add_unit(const std::string& name, bool expert = false);
  void add_param(ParamUnit& unit, const std::string& name, Shape shape, InitKind init, ShardSpec shard = {},
                 bool tp_replicated = false);
  // Buffers by each unit's UnitShard (shard_of(unit); null: nothing sharded),
  // moments and grads zeroed. param_dtype f32: the CPU recipe (params are the
  // master weights; 4 + 4 + 8 bytes per parameter). bf16: params and grads
  // in bf16 plus fp32 master weights beside the moments (2 + 2 + 4 + 8, the
  // GPU recipe of ARCHITECTURE.md §6, counted as optim).
  void allocate(Device device, DType param_dtype = DType::f32,
                const std::function<UnitShard(const ParamUnit&)>& shard_of = nullptr);
  DType param_dtype() const { return param_dtype_; }
  // Where allocate() put every buffer (the compute device).
  Device device() const { return device_; }
  // Layout-independent init (§4): element i of tensor `name` from (seed, name,
  // i), i the element's index in the global tensor, so a shard holds exactly
  // the values of its slice of the whole.
  void initialize(const ExecContext& ctx, uint64_t seed, float init_std, int64_t num_layers);

  std::vector<ParamUnit>& units() { return units_; }
  const std::vector<ParamUnit>& units() const { return units_; }
  int64_t total_params() const;
  // Lookup by HF name (checked: the name exists).
  ParamRef ref(const std::string& name) const;
  Tensor param(const std::string& name) const { return param(ref(name)); }
  Tensor grad(const std::string& name) const { return grad(ref(name)); }
  Tensor param(ParamRef r) const { return units_[r.unit].param_view(r.index); }
  Tensor grad(ParamRef r) const { return units_[r.unit].grad_view(r.index); }
  // On ctx's stream (ExecContext::fill_zero: no device synchronization).
  void zero_grads(const ExecContext& ctx);

 private:
  std::vector<ParamUnit> units_;
  Device device_ = Device::cpu();
  DType param_dtype_ = DType::f32;
  std::map<std::string, std::pair<size_t, size_t>> index_;
};

}  // namespace origami
