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

namespace {

using comm::CommOp;
using comm::GroupKind;
using detail::concat;
namespace ring = comm::ring_bytes;

constexpr size_t kF32 = 4, kI64 = 8, kF64 = 8;
constexpr int64_t kI32 = 4;

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

// The axes (in the kind's view) that a group kind spans.
std::vector<comm::Axis> axes_of(GroupKind k) {
  using comm::Axis;
  switch (k) {
    case GroupKind::tp: return {Axis::tp};
    case GroupKind::cp: return {Axis::cp};
    case GroupKind::dp: return {Axis::dp};
    case GroupKind::dp_cp: return {Axis::dp, Axis::cp};
    case GroupKind::tp_cp: return {Axis::tp, Axis::cp};
    case GroupKind::tp_dp_cp: return {Axis::tp, Axis::dp, Axis::cp};
    case GroupKind::pp: return {Axis::pp};
    case GroupKind::tp_pp: return {Axis::tp, Axis::pp};
    case GroupKind::embedding: return {Axis::pp};  // first and last stage only; carries nothing here
    case GroupKind::ep: return {Axis::ep};
    case GroupKind::etp: return {Axis::tp};
    case GroupKind::edp: return {Axis::dp};
    case GroupKind::tp_ep: return {Axis::tp, Axis::ep};
    case GroupKind::tp_ep_pp: return {Axis::tp, Axis::ep, Axis::pp};
  }
  return {};
}

// Size of a group kind, and the lowest and highest world rank of the group
// holding `rank` (rank = Σ coord·stride over the order string, Megatron's
// RankGenerator), so a group lies in one node iff both ends do.
struct GroupSpan {
  int64_t size = 1, lo = 0, hi = 0;
};
GroupSpan span_of(const comm::Layout& layout, GroupKind k, int64_t rank) {
  const comm::View view = comm::group_view(k);
  const auto& sizes = layout.sizes(view);
  std::array<int64_t, comm::kNumAxes> stride{};
  int64_t s = 1;
  for (comm::Axis a : layout.full_order()) {
    stride[static_cast<size_t>(a)] = s;
    s *= sizes[static_cast<size_t>(a)];
  }
  GroupSpan g{1, rank, rank};
  for (comm::Axis a : axes_of(k)) {
    const auto i = static_cast<size_t>(a);
    const int64_t coord = (rank / stride[i]) % sizes[i];
    g.size *= sizes[i];
    g.lo -= coord * stride[i];
    g.hi += (sizes[i] - 1 - coord) * stride[i];
  }
  return g;
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

namespace {
// Bytes of one data element (activations, their gradients, the wire's rows):
// the recipe's parameter dtype (ExecContext::data_dtype).
int64_t data_bytes(Recipe r) { return recipe_bytes(r).param; }
}  // namespace

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
  const int64_t Fe = e.expert_ffn(m.ffn_hidden_size) / etp, Fs = e.shared_expert_hidden_size / tp;
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
    const int64_t experts = (M * D + 3 * M * Fe + R * D) * d;
    // Shared expert (tensor-parallel): x [T, D] gathered (the router's x when tp = 1), gate, up, h [T, Fs/tp].
    const int64_t shared = Fs > 0 ? ((tp > 1 ? T * D : 0) + 3 * T * Fs) * d : 0;
    a.moe_layer = 2 * norm + attention + router + perm + experts + shared;
  }
  a.every_stage = (s / cp) * kI32;  // positions i32 [s/cp]
  a.first_stage = T * kI32;         // token ids i32 [T] (vocab-parallel lookup of the cp shard)
  // Final norm; LmHeadSaved: y [T, D] (tp-gathered), targets i32 [T], logits f32 [T, Vl], lse f32 [T].
  a.last_stage = norm + T * D * d + (T * ceil_div(m.vocab_size, tp) + T) * f + T * kI32;

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
    const int64_t Fs_whole = e.shared_expert_hidden_size;
    const int64_t shared_w = Fs_whole > 0 ? (t * D + 3 * t * Fs_whole) * d : 0;
    a.weight_pending_moe_layer = 2 * norm_w + attention_w + router_w + experts_w + shared_w;
  }
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
  // micro-batches in flight (1F1B: min(pp − stage, m)).
  const std::vector<int64_t> per_stage = stage_layers(in.model.num_layers, layout.pp(), in.pp_layers);
  const int64_t m = in.training.global_batch / (in.training.micro_batch * layout.dp());
  int64_t held = 0, layers = 0;
  for (int64_t st = 0; st < layout.pp(); ++st) {
    held = std::max(held, per_stage[st] * std::min(layout.pp() - st, m));
    layers = std::max(layers, per_stage[st]);
  }
  k.peak_all_gather = held * k.saved_all_gather + k.transient_all_gather;
  k.peak_ring = held * k.saved_ring + k.transient_ring;
  k.step_comm_all_gather = layers * m * 2 * (cp - 1) * U;
  k.step_comm_ring = layers * m * (cp > 1 ? 3 * cp - 2 : 0) * U;
  return k;
}

double StageComm::bytes(GroupKind g) const {
  double b = 0;
  for (const CommItem& i : items)
    if (i.group == g) b += i.bytes;
  return b;
}

double StageComm::total() const {
  double b = 0;
  for (const CommItem& i : items) b += i.bytes;
  return b;
}

namespace {

// One step's communication for the first rank of stage `st`.
StageComm stage_comm(const PlanInput& in, const comm::Layout& layout, const std::vector<UnitPlan>& units,
                     const StageMemory& st, const ActivationBytes& act, int64_t micro_batches) {
  const ModelConfig& m = in.model;
  const MoeConfig& e = in.moe;
  const int64_t tp = layout.tp(), cp = layout.cp(), pp = layout.pp(), ep = layout.ep(), etp = layout.etp();
  const int64_t D = m.hidden_size, hd = m.head_dim(), E = e.router.num_experts, mb = in.training.micro_batch;
  const int64_t T = mb * in.training.seq_len / cp, t = T / tp, R = act.rows, mm = micro_batches;
  const int64_t L = st.num_layers, Lmoe = st.num_moe_layers, Ldense = L - Lmoe;
  const int zs = in.zero_stage;
  const size_t d = static_cast<size_t>(data_bytes(in.recipe));  // rows, K/V, params and grads on the wire
  const bool first = st.stage == 0, last = st.stage == pp - 1;
  StageComm c;
  c.stage = st.stage;
  int64_t stride_pp = 1;  // the stage's first rank: pp coordinate st.stage, every other 0
  for (comm::Axis a : layout.full_order()) {
    if (a == comm::Axis::pp) break;
    stride_pp *= layout.sizes(comm::View::dense)[static_cast<size_t>(a)];
  }
  c.rank = st.stage * stride_pp;
  auto n_of = [&](GroupKind g) { return static_cast<int>(span_of(layout, g, c.rank).size); };
  auto add = [&](GroupKind g, CommOp op, std::string what, int64_t calls, double bytes_per_call) {
    if (calls > 0 && bytes_per_call > 0) c.items.push_back({g, op, std::move(what), calls, calls * bytes_per_call});
  };

  // TP with SP: every sublayer all-gathers its input [mb, s/(cp·tp), D] on
  // entry and reduce-scatters its output on exit (send/recv t·D each), and
  // backward runs the adjoints (reduce-scatter, all-gather): per sublayer
  // and micro-batch 2 all-gathers + 2 reduce-scatters of (tp−1)·t·D·d.
  if (tp > 1) {
    const double ag = ring::all_gather(t * D, d, tp), rs = ring::reduce_scatter(t * D, d, tp);
    const int64_t sublayers = L + Ldense + (e.shared_expert_hidden_size > 0 ? Lmoe : 0);
    add(GroupKind::tp, CommOp::all_gather, "sublayer input (fwd) + output grad (bwd)", 2 * mm * sublayers, ag);
    add(GroupKind::tp, CommOp::reduce_scatter, "sublayer output (fwd) + input grad (bwd)", 2 * mm * sublayers, rs);
    if (first) {  // vocab-parallel embedding: reduce-scatter of partial rows (fwd), all-gather of the grad (bwd)
      add(GroupKind::tp, CommOp::reduce_scatter, "embedding output (fwd)", mm, rs);
      add(GroupKind::tp, CommOp::all_gather, "embedding grad (bwd)", mm, ag);
    }
    // Head: all-gather its input (fwd), reduce-scatter the grad (bwd); vocab-parallel
    // cross-entropy: all-reduce the max, then [sum-exp | target logit].
    if (last) {
      add(GroupKind::tp, CommOp::all_gather, "head input (fwd)", mm, ag);
      add(GroupKind::tp, CommOp::reduce_scatter, "head input grad (bwd)", mm, rs);
      add(GroupKind::tp, CommOp::all_reduce, "cross-entropy max [T]", mm, ring::all_reduce(T, kF32, 0, tp));
      add(GroupKind::tp, CommOp::all_reduce, "cross-entropy sum-exp + target logit [2T]", mm,
          ring::all_reduce(2 * T, kF32, 0, tp));
    }
    // Grads of params replicated over tp (norms, router): all-reduced over
    // tp before their unit's dp-cp reduction, at its cadence (per step at
    // stages 0-1, per micro-batch at 2-3).
    for (const UnitPlan& u : units)
      if (u.stage == st.stage && u.tp_replicated > 0)
        add(GroupKind::tp, CommOp::all_reduce, "replicated grads (norms, router)", zs >= 2 ? mm : 1,
            ring::all_reduce(u.tp_replicated, d, 0, tp));
  }
  // CP, per attention (layer) and micro-batch, one rank's K and V packed:
  // kv = 2·T·Hkv/tp·hd floats. all_gather: K, V all-gathered (fwd), dK, dV
  // reduce-scattered (bwd): (cp−1)·kv·d each. ring (dense/attention_ring.h):
  // cp−1 sends of kv·d in forward; in backward cp−1 K, V sends and cp dK, dV
  // sends (the last hop delivers each block's sum to its owner).
  if (cp > 1) {
    const int64_t kv = 2 * T * (m.num_kv_heads / tp) * hd;
    if (in.cp_comm == dense::CpComm::ring) {
      const double block = static_cast<double>(kv * static_cast<int64_t>(d));
      add(GroupKind::cp, CommOp::send, "attention K, V ring (fwd)", mm * L * (cp - 1), block);
      add(GroupKind::cp, CommOp::send, "attention K, V ring (bwd)", mm * L * (cp - 1), block);
      add(GroupKind::cp, CommOp::send, "attention dK, dV ring (bwd)", mm * L * cp, block);
    } else {
      add(GroupKind::cp, CommOp::all_gather, "attention K, V (fwd)", mm * L, ring::all_gather(kv, d, cp));
      add(GroupKind::cp, CommOp::reduce_scatter, "attention dK, dV (bwd)", mm * L,
          ring::reduce_scatter(kv, d, cp));
    }
  }
  // Router statistics: one all-reduce of 2·S·E + 2 doubles per MoE layer and
  // micro-batch over tp-cp (tp-dp-cp for global_aux_loss), when an aux loss
  // or the z-loss is on; S = mb for seq_aux_loss, else 1 (moe/router.h).
  const bool aux = e.router.aux_active();
  if (Lmoe > 0 && (aux || e.router.z_active())) {
    const GroupKind g =
        e.router.load_balancing == moe::LoadBalancing::global_aux_loss ? GroupKind::tp_dp_cp : GroupKind::tp_cp;
    const int64_t S = !aux ? 0 : e.router.load_balancing == moe::LoadBalancing::seq_aux_loss ? mb : 1;
    if (n_of(g) > 1)
      add(g, CommOp::all_reduce, "router statistics", mm * Lmoe, ring::all_reduce(2 * S * E + 2, kF64, 0, n_of(g)));
  }
  // ZeRO (§6, engine/zero.h), per unit of `padded` elements over its N ranks:
  //   stage 0: all-reduce of the gradient once per step: 2·(N−1)/N·padded·d
  //   stage 1: reduce-scatter of the gradient + all-gather of the updated
  //            params, once per step: the same bytes
  //   stage 2: the reduce-scatter once per micro-batch (m) when accumulating
  //            (a unit's whole gradient lives only during its backward), the
  //            all-gather once
  //   stage 3: param all-gather before each forward and each backward (2m) +
  //            gradient reduce-scatter per micro-batch (m): 1.5× stage 0 at m = 1;
  //            with reshard_after_forward = false one gather per step
  for (const UnitPlan& u : units) {
    if (u.stage != st.stage || u.group <= 1) continue;
    const GroupKind g = u.expert ? GroupKind::edp : GroupKind::dp_cp;
    const int n = static_cast<int>(u.group);
    const std::string what = u.expert ? "expert units" : "dense units";
    const double rs = ring::reduce_scatter(u.padded / n, d, n), ag = ring::all_gather(u.padded / n, d, n);
    switch (zs) {
      case 0: add(g, CommOp::all_reduce, what + ": grads", 1, ring::all_reduce(u.padded, d, 0, n)); break;
      case 1:
      case 2:
        add(g, CommOp::reduce_scatter, what + ": grads", zs == 1 ? 1 : mm, rs);
        add(g, CommOp::all_gather, what + ": updated params", 1, ag);
        break;
      default:
        if (in.reshard_after_forward)
          add(g, CommOp::all_gather, what + ": params before fwd and bwd", 2 * mm, ag);
        else
          add(g, CommOp::all_gather, what + ": params, kept whole all step", 1, ag);
        add(g, CommOp::reduce_scatter, what + ": grads", mm, rs);
    }
  }
  // EP (moe/token_dispatcher.h), per MoE layer and micro-batch: counts
  // all_to_all_v of E/EP int64 per peer (dispatch only; backward reuses
  // them); rows: dispatch and combine forward, their adjoints backward, each
  // R·D·d·(EP−1)/EP expected under uniform routing.
  if (Lmoe > 0 && ep > 1) {
    add(GroupKind::ep, CommOp::all_to_all_v, "per-expert counts", mm * Lmoe,
        static_cast<double>((ep - 1) * (E / ep)) * kI64);
    add(GroupKind::ep, CommOp::all_to_all_v, "token rows: dispatch, combine (fwd + bwd)", 4 * mm * Lmoe,
        static_cast<double>(R * D * static_cast<int64_t>(d)) * static_cast<double>(ep - 1) / static_cast<double>(ep));
  }
  // ETP: counts all-gather (ETP−1)·E·8; rows all-gathered (dispatch fwd,
  // combine bwd) and reduce-scattered (combine fwd, dispatch bwd), each
  // (ETP−1)·R·D·d (every etp peer received R rows).
  if (Lmoe > 0 && etp > 1) {
    add(GroupKind::etp, CommOp::all_gather, "per-expert counts", mm * Lmoe, ring::all_gather(E, kI64, etp));
    add(GroupKind::etp, CommOp::all_gather, "token rows: dispatch (fwd), combine grad (bwd)", 2 * mm * Lmoe,
        ring::all_gather(R * D, d, etp));
    add(GroupKind::etp, CommOp::reduce_scatter, "token rows: combine (fwd), dispatch grad (bwd)", 2 * mm * Lmoe,
        ring::reduce_scatter(R * D, d, etp));
  }
  // PP (§7): [mb, s/(cp·tp), D] activations to the next virtual stage per
  // micro-batch and chunk, their gradients to the previous one (every
  // chunk has both but the first's input and the last's output).
  if (pp > 1) {
    const auto v = static_cast<int64_t>(st.chunk_layers.size());
    if (const int64_t n = mm * (v - (last ? 1 : 0)); n > 0)
      add(GroupKind::pp, CommOp::send, "activations (fwd)", n, static_cast<double>(t * D * static_cast<int64_t>(d)));
    if (const int64_t n = mm * (v - (first ? 1 : 0)); n > 0)
      add(GroupKind::pp, CommOp::send, "activation grads (bwd)", n, static_cast<double>(t * D * static_cast<int64_t>(d)));
  }
  // Bookkeeping once per step (engine/trainer.cpp): loss sum over dp-cp;
  // per MoE layer, routed/kept counts (E each) and tokens per EP rank over
  // tp-dp-cp, aux/z losses (2 doubles) over dp. One-element all-reduces
  // (loss, grad-norm partial sums) send nothing from group rank 0.
  if (n_of(GroupKind::dp_cp) > 1)
    add(GroupKind::dp_cp, CommOp::all_reduce, "loss sum", 1, ring::all_reduce(1, kF64, 0, n_of(GroupKind::dp_cp)));
  if (Lmoe > 0 && n_of(GroupKind::tp_dp_cp) > 1) {
    const int n = n_of(GroupKind::tp_dp_cp);
    add(GroupKind::tp_dp_cp, CommOp::all_reduce, "routing counts", Lmoe,
        2.0 * ring::all_reduce(E, kI64, 0, n) + ring::all_reduce(ep, kI64, 0, n));
  }
  if (Lmoe > 0 && n_of(GroupKind::dp) > 1)
    add(GroupKind::dp, CommOp::all_reduce, "aux and z loss", Lmoe, ring::all_reduce(2, kF64, 0, n_of(GroupKind::dp)));
  // Pipeline bookkeeping once per step: the loss from the last stage, the
  // grad norm's dense and expert partial sums, every MoE layer's statistics
  // (each stage adds its own layers', zeros for the rest), each stage's busy
  // and idle seconds. The stage root is pp rank st.stage.
  if (pp > 1) {
    int64_t model_moe_layers = 0;
    for (int64_t l = 0; l < m.num_layers; ++l) model_moe_layers += e.is_moe_layer(l);
    const int r = static_cast<int>(st.stage), n = static_cast<int>(pp);
    add(GroupKind::pp, CommOp::all_reduce, "loss sum", 1, ring::all_reduce(1, kF64, r, n));
    add(GroupKind::pp, CommOp::all_reduce, "grad-norm partial sums", 1, ring::all_reduce(2, kF64, r, n));
    add(GroupKind::pp, CommOp::all_reduce, "routing counts of every MoE layer", 1,
        ring::all_reduce(model_moe_layers * (2 * E + ep), kI64, r, n));
    add(GroupKind::pp, CommOp::all_reduce, "aux and z loss of every MoE layer", 1,
        ring::all_reduce(2 * model_moe_layers, kF64, r, n));
    add(GroupKind::pp, CommOp::all_gather, "stage busy and idle seconds", 1, ring::all_gather(2, kF64, n));
  }
  return c;
}

}  // namespace

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
  const RecipeBytes rb = recipe_bytes(in.recipe);

  const int64_t v = in.virtual_stages;
  lp.schedule = {in.pp_schedule, lp.pp, lp.micro_batches, v};
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
    st.first_layer = chunk_first.front();
    // ZeRO working buffers: stage 2 keeps a unit's whole gradient during its
    // backward (two with overlap_grad_reduce: the previous unit's, in flight,
    // beside it: the two largest); stage 3 also keeps at most two units' whole params (the one
    // computing and the one prefetched; largest units of the stage), or all
    // of them with reshard_after_forward = false.
    std::vector<int64_t> gathered, whole_grads;
    for (const UnitPlan& u : lp.units) {
      if (u.stage != s) continue;
      st.state += u.state;
      if (u.group <= 1) continue;
      gathered.push_back(u.padded * rb.param);
      whole_grads.push_back(u.padded * rb.grad);
    }
    std::sort(gathered.rbegin(), gathered.rend());
    std::sort(whole_grads.rbegin(), whole_grads.rend());
    if (in.zero_stage >= 2)
      for (size_t i = 0; i < std::min<size_t>(in.overlap_grad_reduce ? 2 : 1, whole_grads.size()); ++i)
        st.transient += whole_grads[i];
    if (in.zero_stage >= 3)
      for (size_t i = 0; i < (in.reshard_after_forward ? std::min<size_t>(2, gathered.size()) : gathered.size()); ++i)
        st.transient += gathered[i];
    // Held activations: walk the stage's schedule. A forward of chunk c
    // keeps its saved activations until its backward, which under zb-h1
    // leaves the W operands until the W op.
    const bool first_rank = s == 0, last_rank = s == lp.pp - 1;
    auto saved_bytes = [&](int64_t c) {
      return (st.chunk_layers[c] - chunk_moe[c]) * lp.act.dense_layer + chunk_moe[c] * lp.act.moe_layer +
             lp.act.every_stage + (first_rank && c == 0 ? lp.act.first_stage : 0) +
             (last_rank && c == v - 1 ? lp.act.last_stage : 0);
    };
    auto pending_bytes = [&](int64_t c) {
      return (st.chunk_layers[c] - chunk_moe[c]) * lp.act.weight_pending_dense_layer +
             chunk_moe[c] * lp.act.weight_pending_moe_layer +
             (first_rank && c == 0 ? lp.act.weight_pending_first_stage : 0) +
             (last_rank && c == v - 1 ? lp.act.weight_pending_last_stage : 0);
    };
    int64_t held = 0, saved = 0, pending = 0;
    st.in_flight = 0;
    for (const PipeOp& op : pipeline_schedule(lp.schedule, s)) {
      switch (op.kind) {
        case PipeOp::forward: held += saved_bytes(op.chunk), ++saved; break;
        case PipeOp::backward:
          held -= saved_bytes(op.chunk), --saved;
          if (in.pp_schedule == PipeSchedule::zb_h1) held += pending_bytes(op.chunk), ++pending;
          break;
        case PipeOp::weight: held -= pending_bytes(op.chunk), --pending; break;
      }
      st.activations = std::max(st.activations, held);
      st.in_flight = std::max(st.in_flight, saved);
      st.pending_w = std::max(st.pending_w, pending);
    }
    lp.stages.push_back(st);
  }
  for (const StageMemory& st : lp.stages)
    if (st.total() > lp.stages[lp.worst_memory_stage].total()) lp.worst_memory_stage = st.stage;

  // Step time: compute = step FLOPs / W / flops_per_rank / (1 − bubble),
  // bubble = (pp−1)/(m+pp−1); comm = Σ_group bytes / bandwidth (intra-node
  // when the group lies in one node of ranks_per_node ranks), no overlap;
  // the slowest stage's comm counts.
  const ParamCounts pc = table.counts();
  const double B = static_cast<double>(tr.global_batch), S = static_cast<double>(tr.seq_len);
  lp.flops = 6.0 * static_cast<double>(pc.matmul_active) * B * S +
             12.0 * B * static_cast<double>(in.model.num_heads * in.model.head_dim()) * S * (S + 1) / 2.0 *
                 static_cast<double>(in.model.num_layers);
  {
    // Op times for the ZB-H1 simulation, in FLOPs of one micro-batch: a
    // forward is the matmuls M plus attention A; the input-gradient half of
    // backward M + 2A (attention's backward is all input gradient); the
    // weight half M.
    const double M = 2.0 * static_cast<double>(pc.matmul_active), A = 4.0 *
                     static_cast<double>(in.model.num_heads * in.model.head_dim()) * (S + 1) / 2.0 *
                     static_cast<double>(in.model.num_layers);
    lp.bubble = predicted_bubble(lp.schedule, M + A, M + 2 * A, M);
    lp.bubble_one_f_one_b = predicted_bubble({PipeSchedule::one_f_one_b, lp.pp, lp.micro_batches, 1});
  }
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
