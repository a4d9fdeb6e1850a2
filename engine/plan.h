// Memory and communication planner (`origami plan`): per-rank state,
// activations and communication volume of a config on a layout, predicted
// from the design (ARCHITECTURE.md §3, §5, §6, §7) without running anything,
// and a ranked list of candidate layouts for a world size.
//
// Conventions (every figure is per rank):
//  - Bytes; GB = 1e9 bytes.
//  - Units are the unit table's (engine/units.h), which the ParamStore
//    registers: "embedding", "layers.l" (attention, norms, dense MLP or
//    router + shared expert), "layers.l.experts", "final" (final norm + LM
//    head). A rank's part of a unit ("local") is the unit after the TP split
//    (column/row-parallel matmuls and the vocab-parallel embedding/head split
//    over tp; norms, the router and the shared expert replicated over tp)
//    and, for expert units, after EP (E/EP experts) and ETP (F/ETP each).
//    The vocab split gives the worst rank (tp rank 0) ceil(V/tp) rows.
//  - ZeRO (§6): N = the unit's shard group, dp·cp for dense units, edp for
//    expert units. A sharded unit (stage ≥ 1 and N > 1) is padded to
//    padded = ceil(local/N)·N elements and each rank owns padded/N; at stage 0
//    (or N = 1) padded = local. Whole buffers hold `padded` elements, shards
//    padded/N. Recipes (bytes per element): fp32 = 4 param + 4 grad + 8
//    moments (CPU, no master copy); bf16 = 2 param + 2 grad + 12 optimizer
//    (4 fp32 master + 8 moments). Stage 0 keeps all whole; 1 shards the
//    optimizer bytes; 2 also the gradient; 3 also the parameter. Per
//    parameter: fp32 16, 8 + 8/N, 4 + 12/N, 16/N; bf16 16, 4 + 12/N,
//    2 + 14/N, 16/N.
//  - Pipeline (§7): layers split evenly over pp stages, the first L % pp
//    stages taking one layer more (or an explicit list); stage 0 holds the
//    embedding, the last stage the final unit. The ledger reports the stage
//    with the largest total.
//  - Activations and the wire carry data in the recipe's data dtype (d: fp32
//    4 bytes, bf16 2: rows, K/V, params and grads); statistics (rstd, lse,
//    router logits and scores, the head's logits, cross-entropy partials)
//    stay fp32; i32 indices 4, i64 counts and f64 statistics 8.
//  - Communication: bytes this rank SENDS per optimizer step, by the
//    Communicator's ring convention (comm/communicator.h) and comm::ring_bytes,
//    for the first rank of a pipeline stage (every coordinate 0 but pp), so
//    its index is 0 in every group but pp. All-to-all volumes are expectations
//    under uniform routing. ZeRO per unit and step, at one micro-batch:
//    stages 0-2 move 2·(N−1)/N of the unit's bytes, stage 3 3·(N−1)/N (1.5×);
//    when accumulating m micro-batches, stages 2 and 3 reduce-scatter the
//    gradient once per micro-batch and stage 3 gathers the params twice per
//    micro-batch. The formulas are in plan.cpp next to their code.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/layout.h"
#include "engine/config.h"
#include "engine/units.h"

namespace origami::plan {

enum class Recipe { fp32, bf16 };
std::string_view recipe_name(Recipe r);
// "fp32" | "bf16"; throws UserError naming `what` otherwise.
Recipe parse_recipe(const std::string& text, const std::string& what);

// Bytes per element of each ledger category (optim includes the master copy).
struct RecipeBytes {
  int64_t param = 4, grad = 4, optim = 8;
};
RecipeBytes recipe_bytes(Recipe r);

// Persistent bytes of one unit on one rank, by ledger category.
struct StateBytes {
  int64_t param = 0, grad = 0, optim = 0;
  int64_t total() const { return param + grad + optim; }
  StateBytes& operator+=(const StateBytes& o) {
    param += o.param, grad += o.grad, optim += o.optim;
    return *this;
  }
};

// The padding rule: ceil(numel/N)·N when the unit is sharded (stage ≥ 1 and
// N > 1), else numel.
int64_t padded_numel(int64_t numel, int64_t N, int stage);
// §6 for `numel` elements sharded over N ranks at ZeRO `stage` (0–3):
// stage 0: all whole; 1: optim/N; 2: + grad/N; 3: + param/N, of the padded
// count. E.g. 7e9 params, N = 8, bf16: 112e9, 38.5e9, 26.25e9, 14e9 bytes.
StateBytes zero_state_bytes(int64_t numel, int64_t N, int stage, Recipe recipe);

// What the planner needs besides the layout.
struct PlanInput {
  ModelConfig model;
  MoeConfig moe;
  TrainingConfig training;
  int zero_stage = 3;
  Recipe recipe = Recipe::fp32;
  std::vector<int64_t> pp_layers;  // layers per virtual stage (Σ = num_layers); empty: even split
  bool reshard_after_forward = true;  // false: ZeRO-3 units stay whole all step (one gather each)
  bool overlap_grad_reduce = false;   // ZeRO 2-3: two whole gradients at once (one in flight)
  PipeSchedule pp_schedule = PipeSchedule::one_f_one_b;
  int64_t virtual_stages = 1;
  dense::CpComm cp_comm = dense::CpComm::all_gather;  // parallel.cp_comm
};
// The config's terms; recipe: runtime.precision as `origami train` resolves
// it (auto: bf16 where runtime.device is "cuda", or "auto" on a machine with a
// CUDA device and a CUDA build; fp32 otherwise).
PlanInput plan_input(const Config& cfg);

// One parameter unit, whole and on this rank.
struct UnitPlan {
  std::string name;
  bool expert = false;
  int64_t layer = -1;         // -1: embedding / final
  int64_t numel = 0;          // whole model: equals Model(...).params() unit numel on one rank
  int64_t local = 0;          // this rank's part (after TP, or EP·ETP for experts)
  int64_t tp_replicated = 0;  // elements of `local` replicated over tp (norms, router, shared expert)
  int64_t group = 1;          // N: dp·cp (dense) or edp (experts)
  int64_t padded = 0;         // padded_numel(local, group, zero_stage)
  int64_t stage = 0;          // pipeline rank (stage) holding it
  StateBytes state;           // zero_state_bytes(local, group, zero_stage, recipe)
};

// Parameter counts of the whole model: UnitTable(m, e).counts()
// (engine/units.h; matmul_active is Model::active_matmul_params()).
using ParamCounts = origami::ParamCounts;
ParamCounts param_counts(const ModelConfig& m, const MoeConfig& e);

// Layers per (virtual) stage: `explicit_layers` if given (validated), else
// even with the remainder on the first stages. `pp`: the number of virtual
// stages, parallel.pp · virtual_stages.
std::vector<int64_t> stage_layers(int64_t num_layers, int64_t pp, const std::vector<int64_t>& explicit_layers = {});

// Every unit of the unit table (engine/units.h) with the figures of its
// stage's first rank on this layout (UnitTable::local_unit).
std::vector<UnitPlan> plan_units(const PlanInput& in, const comm::Layout& layout);
std::vector<UnitPlan> plan_units(const PlanInput& in, const UnitTable& table, const comm::Layout& layout);

// Saved-for-backward activation bytes of one micro-batch on one rank
// (plan.cpp derives them tensor by tensor from the modules' Saved structs),
// under in.training.recompute: "moe" drops the experts' gate, up and h;
// "full" keeps each layer's input [t, D] alone and rebuilds the rest in
// backward (rebuild_*).
struct ActivationBytes {
  int64_t dense_layer = 0;  // one dense layer
  int64_t moe_layer = 0;    // one MoE layer (expected rows under uniform routing)
  int64_t first_stage = 0;  // + stage 0: token ids
  int64_t last_stage = 0;   // + last stage: final norm, LM head, loss
  int64_t every_stage = 0;  // positions
  int64_t rows = 0;         // MoE rows this rank permutes (T_local·k dropless)
  // training.recompute = "full": what a B op rebuilds for the layer it is
  // in, the layer's saved set as "none" keeps it (live inside the op, one
  // layer at a time, on top of the held activations); 0 in other modes.
  int64_t rebuild_dense_layer = 0, rebuild_moe_layer = 0;
  // Split backward (zero-bubble schedules; engine/model.h WeightPass): what
  // one micro-batch's pending weight-gradient work keeps between its B pass
  // (which frees the saved activations above) and its W pass — the operands
  // the deferred calls read, per layer and stage extra; nothing every stage.
  int64_t weight_pending_dense_layer = 0;
  int64_t weight_pending_moe_layer = 0;
  int64_t weight_pending_first_stage = 0;  // the embedding's ids and gathered gradient
  int64_t weight_pending_last_stage = 0;   // final norm and LM head
  // Inside a backward: the gradient dh [t, D] flowing down the stage, and
  // what one layer's backward allocates and frees at its busiest moment,
  // beyond its saved activations and dh (plan.cpp names the buffers; kernel
  // workspaces are not counted); the LM head's and final norm's backward.
  int64_t grad_stream = 0;
  int64_t last_stage_logits = 0;  // of last_stage: the logits f32 [T, Vl], which the head's backward frees
  int64_t backward_dense_layer = 0, backward_moe_layer = 0, backward_last_stage = 0;
  // MoE layers whose experts are placed (a non-contiguous
  // moe.expert_placement at this layout's ep), ascending: their backward
  // reorders rows into slot order and back, backward_placed_moe_layer.
  std::vector<int64_t> placed_moe_layers;
  int64_t backward_placed_moe_layer = 0;
  int64_t backward_moe(int64_t layer) const {
    return std::binary_search(placed_moe_layers.begin(), placed_moe_layers.end(), layer) ? backward_placed_moe_layer
                                                                                          : backward_moe_layer;
  }
};
ActivationBytes activation_bytes(const PlanInput& in, const comm::Layout& layout);

// K and V of CP attention on one rank, by method (both are reported whatever
// parallel.cp_comm says; dense/attention_cp.h, dense/attention_ring.h).
// U = 2·T·(Hkv/tp)·hd·4 bytes: one rank's K and V of one layer and
// micro-batch. Saved = kept from a layer's forward to its backward;
// transient = allocated and freed inside one layer's attention (the peak of
// its forward and backward), K/V-shaped buffers only. At cp = 1 both
// methods are the same: U saved, the backward's dK, dV (U) transient.
//   all_gather, cp > 1: saved cp·U + the gathered keys' positions i32 [s];
//     transient (2·cp + 1)·U in backward: dK, dV of every key (cp·U), their
//     packed reduce_scatter send (cp·U) and receive (U); forward (cp + 1)·U
//     (the gather's send and receive)
//   ring, cp > 1: saved U; transient (min(2, cp − 1) + 3)·U in backward:
//     K, V blocks in flight and three dK, dV blocks (one received, one
//     summed, one on the wire); forward min(2, cp − 1)·U
// The wire and in-flight buffers (all of ring's transient, all_gather's but
// the dK, dV of every key) are the `comm` ledger category.
// Peak per rank = saved × attention layers × micro-batches in flight of the
// stage where that product is largest, + transient.
// Bytes a rank sends over cp per step (stage_comm books the configured
// method's as items), per layer and micro-batch: all_gather 2·(cp − 1)·U
// (the gather and the reduce_scatter), ring (3·cp − 2)·U (cp − 1 K, V blocks
// forward, cp − 1 K, V and cp dK, dV blocks backward); times layers × m of
// the stage with the most layers.
struct KvMemory {
  int64_t block = 0;  // U
  int64_t saved_all_gather = 0, saved_ring = 0;          // per layer and micro-batch
  int64_t transient_all_gather = 0, transient_ring = 0;  // one layer's attention
  int64_t wire_all_gather = 0, wire_ring = 0;            // of transient, the comm-category part
  int64_t peak_all_gather = 0, peak_ring = 0;            // per rank
  int64_t step_comm_all_gather = 0, step_comm_ring = 0;  // cp bytes sent per step
};
KvMemory kv_memory(const PlanInput& in, const comm::Layout& layout);

// ZeRO's working buffers on one rank over a step, each category's peak and
// the peak of their sum (which may come at another moment): whole params
// gathered at stage 3, whole gradients at stages 2-3, and the
// reduce-scatters' receive buffers (ledger category comm). Replayed from
// engine/zero.cpp's rules along the stage's schedule (plan_timeline.cpp), so
// these are the ledger's figures, not a bound.
struct ZeroWorking {
  int64_t param = 0, grad = 0, comm = 0, total = 0;
};

// One stage's (pipeline rank's) ledger.
struct StageMemory {
  int64_t stage = 0, first_layer = 0, num_layers = 0, num_moe_layers = 0;  // first_layer: of chunk 0
  std::vector<int64_t> chunk_layers;  // layers of each model chunk (one unless interleaved)
  std::vector<int64_t> chunk_first;   // the first layer of each chunk
  StateBytes state;          // its units' ZeRO state; param also holds expert_bias
  int64_t expert_bias = 0;   // moe.expert_bias: f32 [E] per MoE layer, whole on every rank, no grad or moments
  ZeroWorking zero;         // ZeRO working buffers (their peaks over the step)
  int64_t in_flight = 1;    // most micro-batch·chunks with saved activations at once (1F1B: min(pp − stage, m))
  int64_t pending_w = 0;    // zb-h1: most micro-batches with W operands kept at once
  // The largest activation bytes held between two ops of the stage's
  // schedule: walking its op list, Σ saved activations of the (micro-batch,
  // chunk)s forwarded and not yet backwarded plus, under zb-h1, the W
  // operands of those backwarded and not yet W'd (1F1B: in_flight × per
  // micro-batch). engine/pipeline.h's HeldActivations measures the same.
  int64_t activations = 0;
  // training.recompute = "full": the largest layer of the stage rebuilt
  // inside a B op (ActivationBytes::rebuild_*), above `activations`.
  int64_t rebuild = 0;
  // The most bytes live at one moment of the step beyond the state,
  // replayed op by op and layer by layer (engine/plan_timeline.cpp): ZeRO's
  // working buffers, saved activations, the pipeline's boundary tensors,
  // and inside a backward the gradient flowing down, the layer's transient
  // buffers and (recompute "full") its rebuilt activations.
  int64_t live = 0;
  // The ledger's peak, but for kernel workspaces and a step's scalars.
  int64_t total() const { return state.total() + live; }
};

// One communication item of a step: `calls` calls of one op on one group.
struct CommItem {
  comm::GroupKind group;
  comm::CommOp op;
  std::string what;
  int64_t calls = 0;
  double bytes = 0;  // all calls together
};
struct StageComm {
  int64_t stage = 0, rank = 0;  // the stage's first rank
  std::vector<CommItem> items;
  double bytes(comm::GroupKind g) const;
  double total() const;
  double seconds = 0;  // under the Machine's bandwidths
};

// The step-time model's machine.
struct Machine {
  double flops_per_rank = 400e12;  // sustained FLOP/s per rank
  double intra_gbs = 150;          // GB/s per rank inside a node
  double inter_gbs = 25;           // GB/s per rank across nodes
  int64_t ranks_per_node = 8;      // world ranks r and r' share a node iff r / n == r' / n
  double memory_gb = 80;           // per-rank memory limit
};

// A planned layout. Step time is a simple model, no overlap assumed:
//   compute = step FLOPs / W / flops_per_rank / (1 − bubble),
//             bubble = (pp − 1) / (m + pp − 1) (1F1B), (pp − 1)/(v·m + pp − 1)
//             (interleaved), ZB-H1's simulated (pipeline.h predicted_bubble
//             with F : B : W times from the FLOPs of each part)
//   comm    = Σ over groups of bytes / bandwidth (intra-node when the
//             group's ranks share a node), the slowest stage's
//   step    = compute + comm
struct LayoutPlan {
  int64_t world = 0, tp = 1, cp = 1, pp = 1, ep = 1, etp = 1, dp = 1, edp = 1;
  std::string order;
  int64_t micro_batches = 0;  // per step per DP rank: global_batch / (micro_batch · dp)
  std::vector<UnitPlan> units;
  ActivationBytes act;
  KvMemory kv;
  std::vector<StageMemory> stages;
  std::vector<StageComm> comm;
  int64_t worst_memory_stage = 0, worst_comm_stage = 0;
  double flops = 0;       // per step, whole model (Model::training_flops)
  double comm_bytes = 0;  // the worst comm stage's total
  double bubble = 0, compute_s = 0, comm_s = 0, step_s = 0;
  PipeScheduleSpec schedule;  // the step's pipeline schedule
  double bubble_one_f_one_b = 0;  // 1F1B's on the same layout, for comparison
  int64_t peak_bytes() const { return stages[worst_memory_stage].total(); }
  bool fits = true;
};

// Validates the layout against the model (layout_problem; UserError naming
// the key and rule) and plans it. `layout` already passed comm::Layout's rules.
LayoutPlan plan_layout(const PlanInput& in, const comm::Layout& layout, const Machine& machine);
// The same with the input's unit table already built (UnitTable(in.model, in.moe)).
LayoutPlan plan_layout(const PlanInput& in, const UnitTable& table, const comm::Layout& layout,
                       const Machine& machine);
// The rule a layout breaks, or "": exactly train's (origami::layout_problem
// in engine/config.h, with the input's pp_layers).
std::string layout_problem(const PlanInput& in, const comm::Layout& layout);

// Every (tp, cp, pp, ep, etp) that comm::Layout and the model accept for
// `world` (the order string is `order`), planned: those that fit in memory by
// step time, then those that do not, by step time. To stay small for large
// worlds the entries keep their stages and totals, not units or comm items.
std::vector<LayoutPlan> rank_layouts(const PlanInput& in, int64_t world, const std::string& order,
                                     const Machine& machine);

// A checkpoint of the layout (engine/checkpoint.h): every element of the
// model once, as its fp32 parameter and two AdamW moments (12 bytes; file
// headers and the expert biases aside). A rank writes its ZeRO share of each
// unit it holds (tp rank 0 also the tensors every tp rank holds whole); the
// largest is a tp-rank-0 rank of the heaviest stage.
struct CheckpointBytes {
  int64_t max_rank = 0, total = 0;
};
CheckpointBytes checkpoint_bytes(const LayoutPlan& p, const ParamCounts& counts);

}  // namespace origami::plan
