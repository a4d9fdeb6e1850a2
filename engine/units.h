// The table of parameter units (ARCHITECTURE.md §4 names, §6 units): every
// tensor of the model with its global shape, its init, and the rule that
// splits it over the tensor-parallel axes — built once from the model and MoE
// config, independent of any layout. Everything that needs to know what a
// rank holds asks this table: the ParamStore's registration (engine/params.h),
// the planner (engine/plan.h), export (engine/export.cpp), the parameter
// counts, and checkpoints.
//
// Units, in table order: "embedding", then per layer l "layers.l" (norms,
// attention, dense MLP or router + shared expert) and, for MoE layers,
// "layers.l.experts"; last "final" (final norm + LM head). Tensors of a unit
// are listed in the order a rank lays them out in the unit's flat buffer;
// a rank's part of a unit is the subsequence of tensors it holds, each cut
// to its slice, in the same order.
//
// Shard rules (one per tensor, at most one split dimension):
//   whole     every rank holds the tensor whole (norms, router, shared
//             expert): in a dense unit it is replicated over tp, so its
//             gradient is summed over tp and counted once in the norm.
//   tp_even   dimension `dim` split evenly over tp, in blocks of `block`
//             elements (attention heads: block = head_dim; ffn: block = 1).
//   tp_vocab  dimension 0 split over tp by the ceil rule: tp rank r holds
//             rows [r·ceil(V/tp), (r+1)·ceil(V/tp)) clipped to V
//             (dense/tensor_parallel.h tp_vocab_range).
//   etp_even  an expert's ffn dimension `dim` split evenly over etp.
// Routed expert tensors (expert >= 0) are held only by the ep rank owning the
// expert under its layer's placement (moe/placement.h): moe.expert_placement
// when that placement is for the layout's EP size, else the contiguous
// blocks, ep coordinate expert / (E/EP). Either way a rank holds E/EP experts
// of each layer, and its held experts in table order (ascending id) are its
// local expert order, one [E/EP, ...] block per weight.
// A split over a size-1 axis is no split: the slice is whole (dim = -1).
//
// ZeRO (§6): a unit shards over dp-cp (dense units) or edp (expert units)
// after the splits above, as one flat buffer (engine/params.h UnitShard).
// Pipeline (§7): the embedding lives on the first stage, "final" on the last,
// a layer's units on the stage owning the layer (engine/pipeline.h).
//
// Asking the table (what a checkpoint writer or reader does): for each unit
// u with u.on_stage(stage), local_unit(u, layout, coords) lists the tensors
// the rank holds, each with its global shape (TensorSpec::global_shape) and
// its slice (TensorSlice::shard: dimension and start), in the order of the
// unit's flat buffer; local_slice answers for one tensor and any rank.
//
// Invariants: names are unique; over all ranks of one replica group (the
// ranks agreeing on every coordinate but tp, ep and etp) the slices tile
// each tensor's global shape exactly once.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/groups.h"
#include "comm/layout.h"
#include "engine/config.h"
#include "engine/pipeline.h"
#include "kernels/tensor.h"

namespace origami {

enum class InitKind { normal, normal_scaled_output, ones };

// Which slice of a parameter's global tensor a rank holds: a split of one
// dimension (e.g. an expert's F over etp). Whole tensors have dim = -1.
struct ShardSpec {
  int dim = -1;
  int64_t start = 0;  // first global index along dim
  Shape global_shape;
};

enum class ShardRule { whole, tp_even, tp_vocab, etp_even };

struct TensorSpec {
  std::string name;    // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Shape global_shape;  // [out, in] for weights
  InitKind init = InitKind::normal;
  ShardRule rule = ShardRule::whole;
  int dim = -1;           // the split dimension (rule != whole)
  int64_t block = 1;      // split granularity along dim (head_dim for heads)
  int64_t expert = -1;    // routed expert index (expert units), else -1
  bool matmul = false;    // multiplies activations (counted by 6·N·tokens); not the embedding lookup
  int64_t layer = -1;     // the layer of a routed expert tensor (its placement's), else -1
  int64_t numel() const { return shape_numel(global_shape); }
};

enum class UnitPlace { first_stage, layer, last_stage };

struct UnitSpec {
  std::string name;  // "embedding", "layers.3", "layers.3.experts", "final"
  bool expert = false;  // routed experts: ZeRO shards and reduces over edp, not dp-cp
  UnitPlace place = UnitPlace::layer;
  int64_t layer = -1;  // place == layer: the layer, else -1
  std::vector<TensorSpec> tensors;
  int64_t numel = 0;  // global elements, all tensors (set by UnitTable)
  comm::GroupKind zero_group() const { return expert ? comm::GroupKind::edp : comm::GroupKind::dp_cp; }
  // The ZeRO shard group's size under `layout`: dp·cp or edp.
  int64_t zero_group_size(const comm::Layout& layout) const;
  bool on_stage(const PipelineStage& stage) const;
  // The pipeline rank holding the unit, for layers per virtual stage
  // `stage_layers` (plan::stage_layers / pipeline_stage: pp·v entries, Σ =
  // num_layers): virtual stage u is on rank u % pp.
  int64_t stage(const std::vector<int64_t>& stage_layers, int64_t pp) const;
  // Held whole by every tp rank of a dense unit: its gradient is summed over tp.
  bool tp_replicated(const TensorSpec& t) const { return !expert && t.rule == ShardRule::whole; }
};

// This rank's part of one tensor.
struct TensorSlice {
  bool held = false;  // false: another ep rank's expert
  Shape shape;        // local shape (empty when not held)
  ShardSpec shard;    // dim = -1 when whole
  int64_t numel() const { return held ? shape_numel(shape) : 0; }
};

// This rank's part of one unit: the held tensors in table order.
struct LocalUnit {
  std::vector<size_t> tensors;      // indices into UnitSpec::tensors
  std::vector<TensorSlice> slices;  // one per entry of `tensors`
  int64_t numel = 0;                // Σ local elements: the unit's flat buffer before ZeRO padding
  int64_t tp_replicated = 0;        // of numel, elements held whole in a dense unit (grads summed over tp)
};

// Parameter counts of the whole model (no layout).
struct ParamCounts {
  int64_t total = 0;
  int64_t active = 0;         // per token: all non-expert params + top_k/E of the routed experts
  int64_t expert = 0;         // routed experts
  int64_t matmul_active = 0;  // what 6·N·tokens counts: active params that multiply (not the embedding, norms)
};

class UnitTable {
 public:
  // Every unit of the model (all layers, all experts), in table order.
  UnitTable(const ModelConfig& model, const MoeConfig& moe);

  const std::vector<UnitSpec>& units() const { return units_; }
  // (unit index, tensor index) of a tensor by name; ORIGAMI_CHECK if absent.
  std::pair<size_t, size_t> find(const std::string& name) const;
  const TensorSpec& tensor(const std::string& name) const;
  ParamCounts counts() const;

  // Whether the rank at `coords` holds any of `t`: every rank but another
  // ep rank's expert (its stage aside; the expert's owner per the placement
  // of its layer for layout.ep()).
  bool holds(const TensorSpec& t, const comm::Layout& layout, const comm::RankCoords& coords) const;
  // The slice of `t` held by the rank at `coords` of `layout` (its stage
  // aside: see UnitSpec::on_stage). ORIGAMI_CHECK when the split does not
  // divide (layout_problem rejects such layouts first).
  TensorSlice local_slice(const TensorSpec& t, const comm::Layout& layout, const comm::RankCoords& coords) const;
  LocalUnit local_unit(const UnitSpec& u, const comm::Layout& layout, const comm::RankCoords& coords) const;
  // local_unit's numel and tp_replicated alone, without building slices
  // (the planner asks for every unit of every candidate layout).
  std::pair<int64_t, int64_t> local_numel(const UnitSpec& u, const comm::Layout& layout,
                                          const comm::RankCoords& coords) const;

 private:
  // The one place the shard rules are applied: the range [start, start +
  // count) of dimension dim the rank holds (dim = -1: the whole tensor).
  struct Cut {
    bool held = false;
    int dim = -1;
    int64_t start = 0, count = 0;
  };
  Cut cut(const TensorSpec& t, const comm::Layout& layout, const comm::RankCoords& coords) const;

  int64_t num_experts_ = 0;
  int64_t top_k_ = 0;
  moe::ExpertPlacements placements_;  // moe.expert_placement
  std::vector<UnitSpec> units_;
  std::map<std::string, std::pair<size_t, size_t>> index_;
};

// The names of §4, stated once.
std::string layer_param_name(int64_t layer, std::string_view suffix);  // model.layers.{l}.{suffix}
std::string expert_param_name(int64_t layer, int64_t expert, std::string_view w);  // ...experts.{e}.{w}.weight
// The MoE expert bias (state, not a parameter): model.layers.{l}.block_sparse_moe.expert_bias.
std::string expert_bias_name(int64_t layer);

// The world-1 layout a model without groups runs on.
comm::Layout single_rank_layout(const MoeConfig& moe);

// Copies a rank's slice (contiguous, `slice.shape`) into its place in the
// whole tensor `whole_f32` of shape slice.shard.global_shape (or the whole
// tensor when the slice is whole).
void place_slice(const TensorSlice& slice, const float* local, float* whole_f32);

}  // namespace origami
