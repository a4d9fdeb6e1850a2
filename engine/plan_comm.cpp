// The planner's communication volume per step (see plan.h for the
// conventions, plan.cpp for the notation): every collective a stage's first
// rank issues, by group, with its ring-convention bytes.
#include "engine/plan.h"
#include "engine/plan_internal.h"

namespace origami::plan {

using namespace internal;
using comm::CommOp;
using comm::GroupKind;
namespace ring = comm::ring_bytes;

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

// One step's communication for the first rank of stage `st`.
StageComm internal::stage_comm(const PlanInput& in, const comm::Layout& layout, const std::vector<UnitPlan>& units,
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
    const int64_t sublayers = L + Ldense;  // attention and dense MLPs (the MoE layer's shared expert runs whole)
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
  // The step's MoE records (engine/moe_records.cpp): every layer's counts
  // packed into one all-reduce, its losses into another.
  if (Lmoe > 0 && n_of(GroupKind::tp_dp_cp) > 1)
    add(GroupKind::tp_dp_cp, CommOp::all_reduce, "routing counts", 1,
        ring::all_reduce(Lmoe * (2 * E + ep), kI64, 0, n_of(GroupKind::tp_dp_cp)));
  if (Lmoe > 0 && n_of(GroupKind::dp) > 1)
    add(GroupKind::dp, CommOp::all_reduce, "aux and z loss", 1, ring::all_reduce(2 * Lmoe, kF64, 0, n_of(GroupKind::dp)));
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

}  // namespace origami::plan
