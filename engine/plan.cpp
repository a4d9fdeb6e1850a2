// Memory and communication planner (see plan.h for the conventions). Every
// formula sits next to its code. Notation, per rank and micro-batch:
//   mb = training.micro_batch, s = training.seq_len, m = micro-batches per
//   step = global_batch / (mb·dp), D = hidden, hd = head_dim, Hq/Hkv heads,
//   F dense ffn, E experts, k = top_k, Fe expert ffn, Fs shared expert ffn,
//   V vocab, Vl = ceil(V/tp);
//   T = mb·s/cp   tokens of this rank's cp shard (the width after the tp all-gather)
//   t = T/tp      tokens of the sequence-parallel residual stream [mb, s/(cp·tp), D]
//   R             MoE rows this rank permutes: t·k dropless; with a capacity
//                 C = ceil(t·k/E · cf): E·C padded, else min(t·k, E·C)
//                 (uniform routing: each expert gets t·k/E).
#include "engine/plan.h"

#include "engine/plan_internal.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>

#include "kernels/check.h"
#include "kernels/device.h"
#include "moe/permutation.h"

namespace origami::plan {

using namespace internal;

namespace {

using comm::CommOp;
using comm::GroupKind;
using detail::concat;
namespace ring = comm::ring_bytes;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_sharded(int64_t N, int stage) { return stage >= 1 && N > 1; }

int64_t moe_layers_in(const MoeConfig& e, int64_t first, int64_t count) {
  int64_t n = 0;
  for (int64_t l = first; l < first + count; ++l) n += e.is_moe_layer(l);
  return n;
}

// MoE rows this rank permutes per layer and micro-batch (R above).
int64_t moe_rows(const MoeConfig& e, int64_t t) {
  const int64_t tk = t * e.router.top_k;
  const int64_t C = moe::expert_capacity(e.capacity, t, e.router.top_k, e.router.num_experts);
  if (C < 0) return tk;
  return e.capacity.pad_to_capacity ? e.router.num_experts * C : std::min(tk, e.router.num_experts * C);
}

}  // namespace

std::string_view recipe_name(Recipe r) { return r == Recipe::bf16 ? "bf16" : "fp32"; }

Recipe parse_recipe(const std::string& text, const std::string& what) {
  if (text == "fp32") return Recipe::fp32;
  if (text == "bf16") return Recipe::bf16;
  ORIGAMI_USER_ERROR(what, " = \"", text, "\": must be \"fp32\" (CPU: 4 param + 4 grad + 8 moments) or \"bf16\" ",
                     "(GPU: 2 param + 2 grad + 4 master + 8 moments)");
}

RecipeBytes recipe_bytes(Recipe r) { return r == Recipe::bf16 ? RecipeBytes{2, 2, 12} : RecipeBytes{4, 4, 8}; }

int64_t padded_numel(int64_t numel, int64_t N, int stage) {
  return is_sharded(N, stage) ? ceil_div(numel, N) * N : numel;
}

StateBytes zero_state_bytes(int64_t numel, int64_t N, int stage, Recipe recipe) {
  ORIGAMI_CHECK(stage >= 0 && stage <= 3 && N >= 1 && numel >= 0, "zero_state_bytes(", numel, ", ", N, ", ", stage,
                ")");
  const RecipeBytes b = recipe_bytes(recipe);
  const int64_t whole = padded_numel(numel, N, stage);
  const int64_t shard = is_sharded(N, stage) ? whole / N : whole;
  return {(stage >= 3 ? shard : whole) * b.param, (stage >= 2 ? shard : whole) * b.grad,
          (stage >= 1 ? shard : whole) * b.optim};
}

PlanInput plan_input(const Config& cfg) {
  PlanInput in;
  in.model = cfg.model;
  in.moe = cfg.moe;
  in.training = cfg.training;
  in.zero_stage = static_cast<int>(cfg.parallel.zero_stage);
  in.pp_layers = cfg.parallel.pp_layers;
  in.reshard_after_forward = cfg.parallel.reshard_after_forward;
  in.overlap_grad_reduce = cfg.parallel.overlap_grad_reduce;
  in.pp_schedule = cfg.parallel.pp_schedule;
  in.virtual_stages = cfg.parallel.virtual_stages;
  in.cp_comm = cfg.parallel.cp_comm;
  const RuntimeConfig& rt = cfg.runtime;
  const bool cuda = rt.device == RuntimeDevice::cuda ||
                    (rt.device == RuntimeDevice::auto_ && built_with_cuda() && cuda_device_count() > 0);
  const bool bf16 = rt.precision == Precision::bf16 || (rt.precision == Precision::auto_ && cuda);
  in.recipe = bf16 ? Recipe::bf16 : Recipe::fp32;
  return in;
}

ParamCounts param_counts(const ModelConfig& m, const MoeConfig& e) { return UnitTable(m, e).counts(); }

std::vector<int64_t> stage_layers(int64_t num_layers, int64_t pp, const std::vector<int64_t>& explicit_layers) {
  if (!explicit_layers.empty()) {
    const int64_t sum = std::accumulate(explicit_layers.begin(), explicit_layers.end(), int64_t{0});
    const bool non_negative =
        std::all_of(explicit_layers.begin(), explicit_layers.end(), [](int64_t n) { return n >= 0; });
    if (static_cast<int64_t>(explicit_layers.size()) != pp || sum != num_layers || !non_negative)
      ORIGAMI_USER_ERROR("pp_layers: ", explicit_layers.size(), " stages summing to ", sum,
                         ": must list parallel.pp (· virtual_stages) = ", pp,
                         " non-negative layer counts summing to model.num_layers = ", num_layers);
    return explicit_layers;
  }
  // Even split; the first num_layers % pp stages take one layer more.
  std::vector<int64_t> n(pp, num_layers / pp);
  for (int64_t s = 0; s < num_layers % pp; ++s) ++n[s];
  return n;
}

std::vector<UnitPlan> plan_units(const PlanInput& in, const comm::Layout& layout) {
  return plan_units(in, UnitTable(in.model, in.moe), layout);
}

std::vector<UnitPlan> plan_units(const PlanInput& in, const UnitTable& table, const comm::Layout& layout) {
  const std::vector<int64_t> per_stage =
      stage_layers(in.model.num_layers, layout.pp() * in.virtual_stages, in.pp_layers);
  std::vector<UnitPlan> units;
  for (const UnitSpec& spec : table.units()) {
    UnitPlan u;
    u.name = spec.name;
    u.expert = spec.expert;
    u.layer = spec.layer;
    u.stage = spec.stage(per_stage, layout.pp());
    comm::RankCoords first;  // the stage's first rank: every coordinate 0 but pp
    first.pp = u.stage;
    u.numel = spec.numel;
    std::tie(u.local, u.tp_replicated) = table.local_numel(spec, layout, first);
    u.group = spec.zero_group_size(layout);
    u.padded = padded_numel(u.local, u.group, in.zero_stage);
    u.state = zero_state_bytes(u.local, u.group, in.zero_stage, in.recipe);
    units.push_back(std::move(u));
  }
  return units;
}

// Saved-for-backward bytes, tensor by tensor from the modules' Saved structs
// (dense/norm.h, dense/attention.h, dense/mlp.h, moe/router.h, moe/permutation.h,
// moe/experts.h, moe/moe_layer.h, dense/lm_head.h, engine/model.h): data
// tensors in the recipe's data dtype (d: 4 bytes in fp32, 2 in bf16),
// statistics (rstd, lse, the router's logits, scores and weights, the head's
// logits) f32, indices i32, the router's statistics buffer f64. Under TP+SP
// a module saves its tp-gathered input (so backward needs no second gather);
// under CP attention saves the cp-gathered K and V and their positions
// (parallel.cp_comm = "all_gather") or only the local K and V ("ring").
ActivationBytes activation_bytes(const PlanInput& in, const comm::Layout& layout) {
  const ModelConfig& m = in.model;
  const MoeConfig& e = in.moe;
  const int64_t tp = layout.tp(), cp = layout.cp(), etp = layout.etp();
  const int64_t D = m.hidden_size, hd = m.head_dim(), Hq = m.num_heads / tp, Hkv = m.num_kv_heads / tp;
  const int64_t F = m.ffn_hidden_size / tp, E = e.router.num_experts, k = e.router.top_k;
  const int64_t Fe = e.expert_ffn(m.ffn_hidden_size) / etp, Fs = e.shared_expert_hidden_size;
  const int64_t s = in.training.seq_len, T = in.training.micro_batch * s / cp, t = T / tp;
  const int64_t f = kF32, d = data_bytes(in.recipe);  // f: statistics (rstd, lse, logits); d: data

  ActivationBytes a;
  // RmsNormSaved: x [t, D], rstd [t].
  const int64_t norm = t * D * d + t * f;
  // CpAttentionSaved: x [T, D] (tp-gathered), q and o [T, Hq/tp·hd], lse
  // [Hq/tp, T], and K, V (kv_memory): all_gather k and v [T·cp, Hkv/tp·hd]
  // (cp-gathered) with their positions i32 [s] when cp > 1; ring k and v
  // [T, Hkv/tp·hd]. The local positions are shared per micro-batch.
  const KvMemory kv = kv_memory(in, layout);
  const int64_t attention = (T * D + 2 * T * Hq * hd) * d + T * Hq * f +
                            (in.cp_comm == dense::CpComm::ring ? kv.saved_ring : kv.saved_all_gather);
  // MlpSaved: x [T, D] (tp-gathered), gate, up, h [T, F/tp].
  const int64_t mlp = (T * D + 3 * T * F) * d;
  a.dense_layer = 2 * norm + attention + mlp;
  if (E > 0) {
    const int64_t R = moe_rows(e, t), M = R * etp;  // M: rows the local experts compute (etp-gathered)
    a.rows = R;
    // RouterSaved: x [t, D], logits and scores f32 [t, E], expert i32 [t, k]; Routing: weight f32 [t, k];
    // with an aux loss the reduced statistics f64 [2·S·E + 2], S segments (sequences for seq_aux_loss).
    const int64_t S_aux = e.router.load_balancing == moe::LoadBalancing::seq_aux_loss ? t / s : 1;
    const int64_t stats = e.router.aux_active() ? (2 * S_aux * E + 2) * static_cast<int64_t>(kF64) : 0;
    const int64_t router = t * D * d + (2 * t * E + t * k) * f + t * k * kI32 + stats;
    // Permutation: row_token, row_slot i32 [R], row_of i32 [t, k].
    const int64_t perm = (2 * R + t * k) * kI32;
    // ExpertsSaved: x [M, D], gate, up, h [M, Fe/etp]; expert_out [R, D].
    // training.recompute = "moe" drops gate, up and h (backward rebuilds
    // them from x), the shared expert's too.
    const bool keep_swiglu = in.training.recompute != Recompute::moe;
    const int64_t experts = (M * D + (keep_swiglu ? 3 * M * Fe : 0) + R * D) * d;
    // Shared expert: whole on the rank's own tokens at any tp (engine/units.cpp),
    // its x the router's; gate, up, h [t, Fs].
    const int64_t shared = keep_swiglu ? 3 * t * Fs * d : 0;
    a.moe_layer = 2 * norm + attention + router + perm + experts + shared;
  }
  // training.recompute = "full": a layer keeps its input [t, D] alone; its
  // backward rebuilds the rest, one layer at a time (inside the B op, so not
  // held between ops, but live beside what is).
  if (in.training.recompute == Recompute::full) {
    a.rebuild_dense_layer = a.dense_layer, a.rebuild_moe_layer = a.moe_layer;
    a.dense_layer = a.moe_layer = t * D * d;
  }
  a.every_stage = (s / cp) * kI32;  // positions i32 [s/cp]
  a.first_stage = T * kI32;         // token ids i32 [T] (vocab-parallel lookup of the cp shard)
  // Final norm; LmHeadSaved: y [T, D] (tp-gathered), targets i32 [T], logits f32 [T, Vl], lse f32 [T].
  a.last_stage = norm + T * D * d + (T * ceil_div(m.vocab_size, tp) + T) * f + T * kI32;
  a.last_stage_logits = T * ceil_div(m.vocab_size, tp) * f;

  // Pending weight gradients after a deferred backward (kernels/deferred.h):
  // the operands each pushed call keeps, each tensor once. "Gathered" tensors
  // are [T, D] (the tp all-gather; the shard itself when tp = 1), residual
  // stream ones [t, D]. A residual gradient dh is kept by the calls of the
  // sublayer that read it as dy; deferred, the residual sums go to fresh
  // buffers, so each dh is its own tensor.
  //   RMSNorm: dy [t, D] (the sublayer's dx), x [t, D] (its input), rstd [t].
  const int64_t norm_w = t * 2 * D * d + t * f;
  //   Attention: dy [T, D] (gathered dh) and o [T, Hq/tp·hd] (Wo); dq [T,
  //   Hq/tp·hd], dk, dv [T, Hkv/tp·hd] (after RoPE's backward; under cp the
  //   local keys' reduce-scattered buffer, ledger category comm) and x [T, D]
  //   (Wq, Wk, Wv).
  const int64_t attention_w = (2 * T * D + 2 * T * Hq * hd + 2 * T * Hkv * hd) * d;
  //   Dense MLP: dy [T, D] (gathered dh) and h [T, F/tp] (down); dgate, dup
  //   [T, F/tp] and x [T, D] (gate, up).
  const int64_t mlp_w = (2 * T * D + 3 * T * F) * d;
  a.weight_pending_dense_layer = 2 * norm_w + attention_w + mlp_w;
  if (E > 0) {
    const int64_t M = a.rows * etp;
    //   Router: dlogits [t, E] (the data-dtype copy the GEMMs read) and x
    //   [t, D] (the norm's output m).
    const int64_t router_w = (t * E + t * D) * d;
    //   Experts: dy, x [M, D] (the dispatched rows and their gradient), h,
    //   dgate, dup [M, Fe/etp].
    const int64_t experts_w = (2 * M * D + 3 * M * Fe) * d;
    //   Shared expert: dy [t, D] (the layer's dh: kept only when there is
    //   one), h, dgate, dup [t, Fs]; its x is the router's m. It runs whole on
    //   the local tokens (engine/units.cpp), so at any tp: t rows, all Fs.
    const int64_t shared_w = Fs > 0 ? (t * D + 3 * t * Fs) * d : 0;
    a.weight_pending_moe_layer = 2 * norm_w + attention_w + router_w + experts_w + shared_w;
  }
  // Backward transients, each at its part's busiest moment (data dtype d
  // unless said). tp > 1 first gathers the layer's output gradient [T, D].
  // Under zb-h1 (deferred weight gradients) the operands a part's W calls
  // keep (below: "kept") stay alive through the layer's later parts.
  const bool deferred = in.pp_schedule == PipeSchedule::zb_h1;
  const int64_t gathered_dy = tp > 1 ? T * D * d : 0;
  a.grad_stream = t * D * d;
  //   Attention: dm [t, D] (the MLP part's input gradient, alive to the
  //   layer's end), the gathered dh, dO and dQ [T, Hq/tp·hd]; then either the
  //   kernel's dK, dV (KvMemory's transient: of every gathered key, and under
  //   cp all_gather their packed reduce-scatter; ring: also its partial dQ
  //   [T, Hq/tp·hd]) or the projections' backward: dK, dV of the local keys
  //   [T, Hkv/tp·hd] and dx [T, D].
  const bool ring_cp = in.cp_comm == dense::CpComm::ring && cp > 1;
  const int64_t kv_transient = ring_cp ? kv.transient_ring + T * Hq * hd * d : kv.transient_all_gather;
  const int64_t attention_bwd =
      t * D * d + gathered_dy + 2 * T * Hq * hd * d + std::max(kv_transient, (2 * T * Hkv * hd + T * D) * d);
  //   Dense MLP: the gathered dy, dh, dgate, dup [T, F/tp] and dx [T, D];
  //   kept: dy (the layer's dh itself at tp = 1, a residual sum going to a
  //   fresh buffer), dgate and dup.
  const int64_t mlp_kept = deferred ? (tp > 1 ? T * D : t * D) * d + 2 * T * F * d : 0;
  a.backward_dense_layer = std::max(attention_bwd + mlp_kept, gathered_dy + (3 * T * F + T * D) * d);
  if (E > 0) {
    const int64_t R = a.rows, M = R * etp, ep = layout.ep();
    const bool recompute_moe = in.training.recompute == Recompute::moe;
    // Placed experts (a non-contiguous moe.expert_placement on this ep)
    // reorder rows into slot order and back: one more [R, D] beside the
    // exchange, in those layers' backward only.
    for (const auto& [l, placement] : e.expert_placement.layers)
      if (ep > 1 && e.expert_placement.find(l, ep) && !placement.is_contiguous() && e.is_moe_layer(l))
        a.placed_moe_layers.push_back(l);
    //   MoE: the combine's backward leaves dy per routed row [R, D], dL/dp
    //   f32 [t, k] and the dx accumulator [t, D] for the layer's end; dy
    //   reaches the local experts in a buffer of its own [M, D] when rows
    //   move (ep or etp > 1).
    const auto moe_backward = [&](bool placed) {
      const int64_t rows_in = ep > 1 || etp > 1 ? M * D * d : 0;
      const int64_t combine = (R * D + t * D) * d + t * k * f + rows_in;
      //   The shared expert runs first, beside them and the ep exchange in
      //   flight (its receive [M/etp, D], placed: the slot-order copy [R, D]):
      //   its dh, dgate, dup [t, Fs] (recompute "moe": and the rebuilt three)
      //   and dx [t, D]; kept: dgate, dup (and the rebuilt h).
      const int64_t swiglu = recompute_moe ? 6 : 3, kept_swiglu = recompute_moe ? 3 : 2;
      const int64_t shared = Fs > 0 ? (R * D + t * D + (ep > 1 ? R * D : 0) + (placed ? R * D : 0) +
                                       swiglu * t * Fs) * d + t * k * f
                                    : 0;
      const int64_t shared_kept = deferred && Fs > 0 ? kept_swiglu * t * Fs * d : 0;
      //   The routed experts: dh, dgate, dup [M, Fe/etp] (recompute "moe": and
      //   the rebuilt three) and dx [M, D]; kept: dgate, dup (and h).
      const int64_t experts = combine + shared_kept + (swiglu * M * Fe + M * D) * d;
      const int64_t experts_kept = shared_kept + (deferred ? kept_swiglu * M * Fe * d : 0);
      //   dx [M, D] on its way back: its etp reduce-scatter [M/etp, D] and the
      //   ep receive [R, D]; placed, the receive's copy back into expert order
      //   (once the reduce-scatter's buffer has gone, so one more only at etp = 1).
      const int64_t back = combine + experts_kept +
                           (M * D + (etp > 1 ? R * D : 0) + (ep > 1 ? R * D : 0) + (placed && etp == 1 ? R * D : 0)) * d;
      //   The router, with every buffer of the layer's backward still alive:
      //   dx [M, D] and its [R, D] home (rows that moved), dlogits f32 [t, E]
      //   (bf16: and a data-dtype copy, kept) and dx [t, D].
      const int64_t router = combine + experts_kept + (M * D + (ep > 1 || etp > 1 ? R * D : 0) + t * D) * d +
                             t * E * f + (in.recipe == Recipe::bf16 ? t * E * d : 0);
      //   Then attention beside the MoE part's kept operands: the experts' dy
      //   [M, D], the router's dlogits copy [t, E] and, read by a shared
      //   expert, the layer's dh [t, D].
      const int64_t moe_kept = deferred ? experts_kept + (M * D + t * E + (Fs > 0 ? t * D : 0)) * d : 0;
      return std::max({attention_bwd + moe_kept, shared, experts, back, router});
    };
    a.backward_moe_layer = moe_backward(false);
    a.backward_placed_moe_layer = a.placed_moe_layers.empty() ? 0 : moe_backward(true);
  }
  //   LM head: dlogits in place of the logits (bf16: a data-dtype copy [T,
  //   Vl]), dy [T, D] and, tp > 1, its reduce-scatter [t, D].
  a.backward_last_stage = (in.recipe == Recipe::bf16 ? T * ceil_div(m.vocab_size, tp) * d : 0) + T * D * d +
                          (tp > 1 ? t * D * d : 0);

  // Embedding: ids i32 [T] and the gathered gradient [T, D] (all of it is W).
  a.weight_pending_first_stage = T * kI32 + T * D * d;
  // Final norm (norm_w) and LM head: dlogits [T, Vl] (fp32: the logits
  // buffer itself; bf16: its data-dtype copy) and y [T, D] (gathered).
  a.weight_pending_last_stage = norm_w + (T * ceil_div(m.vocab_size, tp) + T * D) * d;
  return a;
}

KvMemory kv_memory(const PlanInput& in, const comm::Layout& layout) {
  const int64_t tp = layout.tp(), cp = layout.cp();
  const int64_t s = in.training.seq_len, T = in.training.micro_batch * s / cp;
  KvMemory k;
  const int64_t U = k.block = 2 * T * (in.model.num_kv_heads / tp) * in.model.head_dim() * data_bytes(in.recipe);
  if (cp == 1) {  // one rank: both methods are the dense module's
    k.saved_all_gather = k.saved_ring = U;
    k.transient_all_gather = k.transient_ring = U;
  } else {
    k.saved_all_gather = cp * U + s * kI32;
    k.saved_ring = U;
    k.wire_all_gather = (cp + 1) * U;
    k.transient_all_gather = cp * U + k.wire_all_gather;
    k.wire_ring = k.transient_ring = (std::min<int64_t>(2, cp - 1) + 3) * U;
  }
  // Saved blocks held at once: the stage with the most attention layers ×
  // micro-batches in flight (1F1B: min(pp − stage, m)). A pipeline rank's
  // layers are those of its virtual stages (chunk c of rank s is virtual
  // stage c·pp + s).
  const int64_t pp = layout.pp(), v = in.virtual_stages;
  const std::vector<int64_t> per_virtual = stage_layers(in.model.num_layers, pp * v, in.pp_layers);
  const int64_t m = in.training.global_batch / (in.training.micro_batch * layout.dp());
  int64_t held = 0, layers = 0;
  for (int64_t st = 0; st < pp; ++st) {
    int64_t rank_layers = 0;
    for (int64_t c = 0; c < v; ++c) rank_layers += per_virtual[static_cast<size_t>(c * pp + st)];
    held = std::max(held, rank_layers * std::min(pp - st, m));
    layers = std::max(layers, rank_layers);
  }
  k.peak_all_gather = held * k.saved_all_gather + k.transient_all_gather;
  k.peak_ring = held * k.saved_ring + k.transient_ring;
  k.step_comm_all_gather = layers * m * 2 * (cp - 1) * U;
  k.step_comm_ring = layers * m * (cp > 1 ? 3 * cp - 2 : 0) * U;
  return k;
}

namespace {
// The ParallelConfig a planned layout stands for.
ParallelConfig parallel_of(const PlanInput& in, const comm::Layout& layout) {
  ParallelConfig p;
  p.tp = layout.tp(), p.cp = layout.cp(), p.pp = layout.pp(), p.ep = layout.ep(), p.etp = layout.etp();
  p.order = layout.order();
  p.pp_layers = in.pp_layers;
  p.zero_stage = in.zero_stage;
  p.reshard_after_forward = in.reshard_after_forward;
  p.pp_schedule = in.pp_schedule;
  p.virtual_stages = in.virtual_stages;
  p.cp_comm = in.cp_comm;
  return p;
}
}  // namespace

std::string layout_problem(const PlanInput& in, const comm::Layout& layout) {
  return origami::layout_problem(in.model, in.moe, in.training, parallel_of(in, layout), layout.world());
}

LayoutPlan plan_layout(const PlanInput& in, const comm::Layout& layout, const Machine& machine) {
  return plan_layout(in, UnitTable(in.model, in.moe), layout, machine);
}

LayoutPlan plan_layout(const PlanInput& in, const UnitTable& table, const comm::Layout& layout,
                       const Machine& machine) {
  if (std::string p = layout_problem(in, layout); !p.empty()) ORIGAMI_USER_ERROR(p);
  LayoutPlan lp;
  lp.world = layout.world();
  lp.tp = layout.tp(), lp.cp = layout.cp(), lp.pp = layout.pp(), lp.ep = layout.ep(), lp.etp = layout.etp();
  lp.dp = layout.dp(), lp.edp = layout.edp();
  lp.order = layout.order();
  const TrainingConfig& tr = in.training;
  lp.micro_batches = tr.global_batch / (tr.micro_batch * lp.dp);
  lp.units = plan_units(in, table, layout);
  lp.act = activation_bytes(in, layout);
  lp.kv = kv_memory(in, layout);

  const int64_t v = in.virtual_stages;
  lp.schedule = {in.pp_schedule, lp.pp, lp.micro_batches, v};
  const ParamCounts pc = table.counts();
  const double B = static_cast<double>(tr.global_batch), S = static_cast<double>(tr.seq_len);
  lp.flops = 6.0 * static_cast<double>(pc.matmul_active) * B * S +
             12.0 * B * static_cast<double>(in.model.num_heads * in.model.head_dim()) * S * (S + 1) / 2.0 *
                 static_cast<double>(in.model.num_layers);
  // Op times for the pipeline's simulation, in FLOPs of one micro-batch: a
  // forward is the matmuls M plus attention A; the input-gradient half of
  // backward M + 2A (attention's backward is all input gradient); the
  // weight half M. It gives ZB-H1's bubble and, at any schedule, the
  // boundary tensors in flight during each op (the replay's).
  const double op_M = 2.0 * static_cast<double>(pc.matmul_active),
               op_A = 4.0 * static_cast<double>(in.model.num_heads * in.model.head_dim()) * (S + 1) / 2.0 *
                      static_cast<double>(in.model.num_layers);
  const PipelineSimulation sim =
      lp.pp > 1 ? simulate_pipeline(lp.schedule, op_M + op_A, op_M + 2 * op_A, op_M) : PipelineSimulation{};
  ORIGAMI_CHECK(lp.pp == 1 || (sim.finished && sim.error.empty()), "plan: the pipeline simulation of ",
                schedule_name(in.pp_schedule), " stalled: ", sim.error);
  lp.bubble = predicted_bubble(lp.schedule, op_M + op_A, op_M + 2 * op_A, op_M);
  lp.bubble_one_f_one_b = predicted_bubble({PipeSchedule::one_f_one_b, lp.pp, lp.micro_batches, 1});

  const std::vector<int64_t> per_stage = stage_layers(in.model.num_layers, lp.pp * v, in.pp_layers);
  for (int64_t s = 0; s < lp.pp; ++s) {
    StageMemory st;
    st.stage = s;
    // Chunk c of rank s is virtual stage c·pp + s; its layers start after
    // every earlier virtual stage's.
    std::vector<int64_t> chunk_first, chunk_moe;
    for (int64_t c = 0; c < v; ++c) {
      const int64_t u = c * lp.pp + s;
      const int64_t first = std::accumulate(per_stage.begin(), per_stage.begin() + u, int64_t{0});
      const int64_t n = per_stage[static_cast<size_t>(u)];
      chunk_first.push_back(first);
      st.chunk_layers.push_back(n);
      chunk_moe.push_back(moe_layers_in(in.moe, first, n));
      st.num_layers += n;
      st.num_moe_layers += chunk_moe.back();
    }
    st.rebuild = std::max(st.num_layers > st.num_moe_layers ? lp.act.rebuild_dense_layer : 0,
                          st.num_moe_layers > 0 ? lp.act.rebuild_moe_layer : 0);
    st.first_layer = chunk_first.front();
    st.chunk_first = chunk_first;
    for (const UnitPlan& u : lp.units)
      if (u.stage == s) st.state += u.state;
    if (in.moe.expert_bias) st.expert_bias = st.num_moe_layers * in.moe.router.num_experts * kF32;
    st.state.param += st.expert_bias;
    // ZeRO working buffers and held activations: the step replayed.
    replay_stage(in, lp.units, lp.act, lp.pp, lp.schedule,
                 lp.pp > 1 ? &sim.boundary_buffers[static_cast<size_t>(s)] : nullptr, st);
    lp.stages.push_back(st);
  }
  for (const StageMemory& st : lp.stages)
    if (st.total() > lp.stages[lp.worst_memory_stage].total()) lp.worst_memory_stage = st.stage;

  // Step time: compute = step FLOPs / W / flops_per_rank / (1 − bubble),
  // bubble = (pp−1)/(m+pp−1); comm = Σ_group bytes / bandwidth (intra-node
  // when the group lies in one node of ranks_per_node ranks), no overlap;
  // the slowest stage's comm counts.
  lp.compute_s = lp.flops / static_cast<double>(lp.world) / machine.flops_per_rank / (1.0 - lp.bubble);
  for (const StageMemory& st : lp.stages) {
    StageComm c = stage_comm(in, layout, lp.units, st, lp.act, lp.micro_batches);
    for (const CommItem& i : c.items) {
      const GroupSpan g = span_of(layout, i.group, c.rank);
      const bool intra = g.lo / machine.ranks_per_node == g.hi / machine.ranks_per_node;
      c.seconds += i.bytes / ((intra ? machine.intra_gbs : machine.inter_gbs) * 1e9);
    }
    lp.comm.push_back(std::move(c));
  }
  for (const StageComm& c : lp.comm)
    if (c.seconds > lp.comm[lp.worst_comm_stage].seconds) lp.worst_comm_stage = c.stage;
  lp.comm_s = lp.comm[lp.worst_comm_stage].seconds;
  lp.comm_bytes = lp.comm[lp.worst_comm_stage].total();
  lp.step_s = lp.compute_s + lp.comm_s;
  lp.fits = static_cast<double>(lp.peak_bytes()) <= machine.memory_gb * 1e9;
  return lp;
}

std::vector<LayoutPlan> rank_layouts(const PlanInput& in, int64_t world, const std::string& order,
                                     const Machine& machine) {
  std::vector<int64_t> div;
  for (int64_t d = 1; d <= world; ++d)
    if (world % d == 0) div.push_back(d);
  const bool moe = in.moe.router.num_experts > 0;
  PlanInput even = in;
  even.pp_layers.clear();  // candidates split layers evenly
  const UnitTable table(in.model, in.moe);  // once for every candidate
  std::vector<LayoutPlan> out;
  for (int64_t tp : div)
    for (int64_t cp : div)
      for (int64_t pp : div) {
        if (world % (tp * cp * pp) != 0) continue;
        for (int64_t ep : div)
          for (int64_t etp : div) {
            if (world % (etp * ep * pp) != 0 || (!moe && (ep > 1 || etp > 1))) continue;
            if (moe && in.moe.router.num_experts % ep != 0) continue;
            // The rules train applies (layout_problem), comm::Layout's included.
            ParallelConfig candidate;
            candidate.tp = tp, candidate.cp = cp, candidate.pp = pp, candidate.ep = ep, candidate.etp = etp;
            candidate.order = order;
            candidate.pp_schedule = in.pp_schedule;
            candidate.virtual_stages = in.virtual_stages;
            if (!origami::layout_problem(even.model, even.moe, even.training, candidate, world).empty()) continue;
            const comm::Layout layout(world,
                                      comm::LayoutOptions{tp, cp, pp, ep, etp, order, in.moe.router.num_experts});
            LayoutPlan p = plan_layout(even, table, layout, machine);
            p.units = {};
            p.comm = {};
            out.push_back(std::move(p));
          }
      }
  std::stable_sort(out.begin(), out.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_s < b.step_s;
  });
  return out;
}

CheckpointBytes checkpoint_bytes(const LayoutPlan& p, const ParamCounts& counts) {
  constexpr int64_t kBytes = 12;  // fp32 param + exp_avg + exp_avg_sq
  std::map<int64_t, int64_t> per_stage;
  for (const UnitPlan& u : p.units) per_stage[u.stage] += (u.local + u.group - 1) / u.group * kBytes;
  CheckpointBytes b;
  for (const auto& [stage, bytes] : per_stage) b.max_rank = std::max(b.max_rank, bytes);
  b.total = counts.total * kBytes;
  return b;
}

}  // namespace origami::plan
