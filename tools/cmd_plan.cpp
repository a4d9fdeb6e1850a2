// `origami plan`: the memory and communication planner (engine/plan.h).
//   origami plan CONFIG --world W [--stage S] [--recipe fp32|bf16] [--set k=v]... [--pp-layers N,...]
//                [--flops-per-rank F] [--link-gbs B | --intra-gbs B --inter-gbs B] [--ranks-per-node R]
//                [--memory-gb G] [--top N] [--json]
//   origami plan --params P --world W [--recipe fp32|bf16] [--json]
// With a config: parameter totals, the per-rank ledger of the configured
// layout (worst pipeline stage), its activation formula, per-group
// communication bytes per step, a step-time estimate, then every valid layout
// of W ranks ranked by estimated step time. With --params: the §6 ZeRO state
// of P parameters sharded over W ranks at each stage. Only rank 0 prints;
// nothing here communicates.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "engine/plan.h"
#include "kernels/check.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

using nlohmann::ordered_json;
using plan::LayoutPlan;

struct PlanArgs {
  std::string config, config_opt;
  std::vector<std::string> overrides;
  int64_t world = 0;
  int stage = -1;  // -1: parallel.zero_stage
  std::string recipe;  // empty: the config's runtime.precision (plan_input), fp32 with --params
  std::vector<std::string> pp_layers_given;  // --pp-layers as written
  std::vector<int64_t> pp_layers;            // parsed from it
  double params = 0;
  plan::Machine machine;
  double link_gbs = 0;  // > 0: both bandwidths
  int64_t top = 10;
  bool json = false;
};

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", bytes / 1e9);
  return b;
}

std::string human(double bytes) {  // 12.345 GB, 1.024 MB, 16.384 KB, 12 B
  char b[32];
  if (bytes >= 1e9)
    std::snprintf(b, sizeof b, "%.3f GB", bytes / 1e9);
  else if (bytes >= 1e6)
    std::snprintf(b, sizeof b, "%.3f MB", bytes / 1e6);
  else if (bytes >= 1e3)
    std::snprintf(b, sizeof b, "%.3f KB", bytes / 1e3);
  else
    std::snprintf(b, sizeof b, "%.0f B", bytes);
  return b;
}

std::string count(double n) {  // 46.70B, 131.07M, 4.10K
  char b[32];
  if (n >= 1e9)
    std::snprintf(b, sizeof b, "%.2fB", n / 1e9);
  else if (n >= 1e6)
    std::snprintf(b, sizeof b, "%.2fM", n / 1e6);
  else if (n >= 1e3)
    std::snprintf(b, sizeof b, "%.2fK", n / 1e3);
  else
    std::snprintf(b, sizeof b, "%.0f", n);
  return b;
}

std::string group_str(comm::GroupKind g) { return std::string(comm::group_name(g)); }

// ---- --params: the §6 table. -----------------------------------------------

void run_params(const PlanArgs& a, plan::Recipe recipe, bool print) {
  // Every parameter takes up to 16 bytes of training state, and a stage's
  // bytes are counted in int64 after padding to a multiple of N (the config
  // rule's bound, less the padding).
  // (The double is compared below 2^59, exact in a double, before the
  // integer bound: a double cannot tell 2^59 - 1 from 2^59.)
  const int64_t max_params = INT64_MAX / 16 - (a.world - 1);
  if (!(a.params >= 1 && a.params < 0x1p59 && std::floor(a.params) == a.params) ||
      static_cast<int64_t>(a.params) > max_params)
    ORIGAMI_USER_ERROR("--params ", a.params, ": must be a whole number of parameters in [1, ", max_params,
                       "] (e.g. 7e9): their training state, 16 bytes each, is counted in 64-bit sizes");
  const auto P = static_cast<int64_t>(a.params), N = a.world;
  const plan::RecipeBytes b = plan::recipe_bytes(recipe);
  const char* formula[4];
  char f[4][64];
  std::snprintf(f[0], sizeof f[0], "%lld", static_cast<long long>(b.param + b.grad + b.optim));
  std::snprintf(f[1], sizeof f[1], "%lld + %lld/N", static_cast<long long>(b.param + b.grad),
                static_cast<long long>(b.optim));
  std::snprintf(f[2], sizeof f[2], "%lld + %lld/N", static_cast<long long>(b.param),
                static_cast<long long>(b.grad + b.optim));
  std::snprintf(f[3], sizeof f[3], "%lld/N", static_cast<long long>(b.param + b.grad + b.optim));
  for (int s = 0; s < 4; ++s) formula[s] = f[s];
  ordered_json j;
  j["params"] = P;
  j["world"] = N;
  j["recipe"] = plan::recipe_name(recipe);
  j["bytes_per_param"] = {{"param", b.param}, {"grad", b.grad}, {"optim", b.optim}};
  j["stages"] = ordered_json::array();
  if (print && !a.json)
    std::printf(
        "ZeRO state of %lld params on N = %lld ranks, recipe %s (%lld param + %lld grad + %lld optim bytes "
        "per param); per rank, GB = 1e9 bytes\n%-6s %-18s %10s %10s %10s %10s\n",
        static_cast<long long>(P), static_cast<long long>(N), std::string(plan::recipe_name(recipe)).c_str(),
        static_cast<long long>(b.param), static_cast<long long>(b.grad), static_cast<long long>(b.optim), "stage",
        "bytes/param", "param GB", "grad GB", "optim GB", "total GB");
  for (int s = 0; s < 4; ++s) {
    const plan::StateBytes st = plan::zero_state_bytes(P, N, s, recipe);
    j["stages"].push_back({{"stage", s},
                           {"formula", formula[s]},
                           {"param", st.param},
                           {"grad", st.grad},
                           {"optim", st.optim},
                           {"total", st.total()}});
    if (print && !a.json)
      std::printf("%-6d %-18s %10s %10s %10s %10s\n", s, formula[s], gb(st.param).c_str(), gb(st.grad).c_str(),
                  gb(st.optim).c_str(), gb(st.total()).c_str());
  }
  if (print && a.json) std::printf("%s\n", j.dump().c_str());
}

// ---- With a config. ------------------------------------------------------------

ordered_json layout_row(const LayoutPlan& p) {
  return {{"tp", p.tp},
          {"cp", p.cp},
          {"pp", p.pp},
          {"ep", p.ep},
          {"etp", p.etp},
          {"dp", p.dp},
          {"edp", p.edp},
          {"micro_batches", p.micro_batches},
          {"peak_bytes", p.peak_bytes()},
          {"comm_bytes", p.comm_bytes},
          {"compute_s", p.compute_s},
          {"comm_s", p.comm_s},
          {"bubble", p.bubble},
          {"step_s", p.step_s},
          {"fits", p.fits}};
}

// moe.expert_placement as the plan states it: where it comes from, its EP
// size (the configured layout's: the config's rule) and each placed layer's
// experts per EP rank (ascending). Memory and communication figures do not
// depend on it (every EP rank holds E/EP experts of each layer under any
// placement); candidate layouts of another EP size place experts in
// contiguous blocks.
ordered_json placement_json(const moe::ExpertPlacements& placements) {
  ordered_json layers = ordered_json::object();
  for (const auto& [l, p] : placements.layers) {
    ordered_json ranks = ordered_json::array();
    for (int64_t r = 0; r < p.ep(); ++r) ranks.push_back(p.local_experts(r));
    layers[std::to_string(l)] = ranks;
  }
  return {{"source", "moe.expert_placement"}, {"ep", placements.ep}, {"layers", layers}};
}

void print_placement(const moe::ExpertPlacements& placements) {
  if (placements.ep == 0) return;
  std::string layers;
  for (const auto& [l, p] : placements.layers) {
    std::string ranks;
    for (int64_t r = 0; r < p.ep(); ++r) {
      std::string list;
      for (const int64_t e : p.local_experts(r)) list += (list.empty() ? "" : ", ") + std::to_string(e);
      ranks += (r ? ", [" : "[") + list + "]";
    }
    layers += "\n  layer " + std::to_string(l) + ": [" + ranks + "]";
  }
  std::printf("expert placement: from moe.expert_placement, ep %lld (other MoE layers, and candidate layouts of "
              "another EP size, in contiguous blocks; the figures hold for any placement)%s\n",
              static_cast<long long>(placements.ep), layers.c_str());
}

ordered_json plan_json(const PlanArgs& a, const std::string& source, const plan::PlanInput& in,
                       const plan::ParamCounts& pc, const LayoutPlan& p, const std::vector<LayoutPlan>& ranked) {
  ordered_json j;
  j["config"] = source;
  j["world"] = a.world;
  j["recipe"] = plan::recipe_name(in.recipe);
  j["zero_stage"] = in.zero_stage;
  j["units"] = "bytes per rank; comm: bytes sent per step (ring convention)";
  j["machine"] = {{"flops_per_rank", a.machine.flops_per_rank},
                  {"intra_gbs", a.machine.intra_gbs},
                  {"inter_gbs", a.machine.inter_gbs},
                  {"ranks_per_node", a.machine.ranks_per_node},
                  {"memory_gb", a.machine.memory_gb}};
  j["params"] = {{"total", pc.total}, {"active_per_token", pc.active}, {"expert", pc.expert}};
  j["params"]["units"] = ordered_json::array();
  for (const plan::UnitPlan& u : p.units)
    j["params"]["units"].push_back({{"name", u.name},
                                    {"numel", u.numel},
                                    {"local", u.local},
                                    {"tp_replicated", u.tp_replicated},
                                    {"group", u.group},
                                    {"padded", u.padded},
                                    {"stage", u.stage},
                                    {"param", u.state.param},
                                    {"grad", u.state.grad},
                                    {"optim", u.state.optim}});
  j["layout"] = layout_row(p);
  j["layout"]["order"] = p.order;
  if (in.moe.expert_placement.ep > 0) j["expert_placement"] = placement_json(in.moe.expert_placement);
  j["activations"] = {{"dense_layer", p.act.dense_layer}, {"moe_layer", p.act.moe_layer},
                      {"first_stage", p.act.first_stage}, {"last_stage", p.act.last_stage},
                      {"every_stage", p.act.every_stage}, {"moe_rows", p.act.rows},
                      {"rebuild_dense_layer", p.act.rebuild_dense_layer},
                      {"rebuild_moe_layer", p.act.rebuild_moe_layer},
                      {"weight_pending_dense_layer", p.act.weight_pending_dense_layer},
                      {"weight_pending_moe_layer", p.act.weight_pending_moe_layer},
                      {"weight_pending_first_stage", p.act.weight_pending_first_stage},
                      {"weight_pending_last_stage", p.act.weight_pending_last_stage}};
  auto by_method = [](int64_t all_gather, int64_t ring) { return ordered_json{{"all_gather", all_gather}, {"ring", ring}}; };
  j["cp_kv_memory"] = {{"cp_comm", in.cp_comm == dense::CpComm::ring ? "ring" : "all_gather"},
                       {"block", p.kv.block},
                       {"saved_per_layer", by_method(p.kv.saved_all_gather, p.kv.saved_ring)},
                       {"transient", by_method(p.kv.transient_all_gather, p.kv.transient_ring)},
                       {"wire", by_method(p.kv.wire_all_gather, p.kv.wire_ring)},
                       {"peak", by_method(p.kv.peak_all_gather, p.kv.peak_ring)},
                       {"cp_bytes_per_step", by_method(p.kv.step_comm_all_gather, p.kv.step_comm_ring)}};
  j["ledger"] = {{"worst_stage", p.worst_memory_stage}, {"stages", ordered_json::array()}};
  for (const plan::StageMemory& s : p.stages)
    j["ledger"]["stages"].push_back({{"stage", s.stage},
                                     {"first_layer", s.first_layer},
                                     {"num_layers", s.num_layers},
                                     {"num_moe_layers", s.num_moe_layers},
                                     {"param", s.state.param},
                                     {"grad", s.state.grad},
                                     {"optim", s.state.optim},
                                     {"expert_bias", s.expert_bias},
                                     {"transient", s.zero.total},
                                     {"zero_working",
                                      {{"param", s.zero.param}, {"grad", s.zero.grad}, {"comm", s.zero.comm}}},
                                     {"chunk_layers", s.chunk_layers},
                                     {"in_flight", s.in_flight},
                                     {"pending_w", s.pending_w},
                                     {"activations", s.activations},
                                     {"live", s.live},
                                     {"rebuild", s.rebuild},
                                     {"total", s.total()}});
  j["comm"] = {{"worst_stage", p.worst_comm_stage}, {"stages", ordered_json::array()}};
  for (const plan::StageComm& c : p.comm) {
    ordered_json groups = ordered_json::object(), items = ordered_json::array();
    for (comm::GroupKind g : comm::kAllGroupKinds)
      if (c.bytes(g) > 0) groups[group_str(g)] = c.bytes(g);
    for (const plan::CommItem& i : c.items)
      items.push_back({{"group", group_str(i.group)},
                       {"op", std::string(comm::op_name(i.op))},
                       {"what", i.what},
                       {"calls", i.calls},
                       {"bytes", i.bytes}});
    j["comm"]["stages"].push_back({{"stage", c.stage},
                                   {"rank", c.rank},
                                   {"total", c.total()},
                                   {"seconds", c.seconds},
                                   {"groups", groups},
                                   {"items", items}});
  }
  const plan::CheckpointBytes ck = plan::checkpoint_bytes(p, pc);
  j["checkpoint"] = {{"max_rank_bytes", ck.max_rank}, {"total_bytes", ck.total}};
  j["step"] = {
      {"flops", p.flops}, {"compute_s", p.compute_s}, {"comm_s", p.comm_s}, {"bubble", p.bubble}, {"step_s", p.step_s}};
  j["pipeline"] = {{"schedule", schedule_name(p.schedule.kind)},
                   {"virtual_stages", p.schedule.virtual_stages},
                   {"micro_batches", p.micro_batches},
                   {"bubble", p.bubble},
                   {"bubble_1f1b", p.bubble_one_f_one_b}};
  j["layouts_valid"] = ranked.size();
  j["layouts"] = ordered_json::array();
  for (size_t i = 0; i < ranked.size() && static_cast<int64_t>(i) < a.top; ++i)
    j["layouts"].push_back(layout_row(ranked[i]));
  return j;
}

// The stages' held activations under the schedule, and its bubble.
void print_pipeline(const LayoutPlan& p) {
  if (p.pp <= 1) return;
  std::printf("\npipeline: %s, %lld stages", schedule_name(p.schedule.kind),
              static_cast<long long>(p.pp));
  if (p.schedule.virtual_stages > 1)
    std::printf(" x %lld chunks", static_cast<long long>(p.schedule.virtual_stages));
  std::printf(", %lld micro-batches: bubble %.1f%% (1F1B %.1f%%)\n", static_cast<long long>(p.micro_batches),
              100 * p.bubble, 100 * p.bubble_one_f_one_b);
  std::printf("  %-6s %-14s %10s %10s %14s\n", "stage", "layers/chunk", "in flight", "pending W", "activations");
  for (const plan::StageMemory& st : p.stages) {
    std::string layers;
    for (int64_t n : st.chunk_layers) layers += (layers.empty() ? "" : "+") + std::to_string(n);
    std::printf("  %-6lld %-14s %10lld %10lld %14s\n", static_cast<long long>(st.stage), layers.c_str(),
                static_cast<long long>(st.in_flight), static_cast<long long>(st.pending_w),
                human(st.activations).c_str());
  }
}

void print_ledger(const plan::PlanInput& in, const LayoutPlan& p) {
  const plan::StageMemory& st = p.stages[p.worst_memory_stage];
  std::printf("\nper-rank ledger, stage %lld of %lld (layers %lld-%lld, %lld micro-batch(es) in flight):\n",
              static_cast<long long>(st.stage), static_cast<long long>(p.pp), static_cast<long long>(st.first_layer),
              static_cast<long long>(st.first_layer + st.num_layers - 1), static_cast<long long>(st.in_flight));
  std::printf("  %-24s %5s %14s %12s %12s %12s %12s\n", "unit", "count", "elements/rank", "shard group", "param",
              "grad", "optim");
  // Rows by kind: embedding, dense layers, MoE layers' dense part, experts, final.
  struct Row {
    int64_t count = 0, local = 0, group = 1;
    std::string group_name;
    plan::StateBytes state;
  };
  std::map<int, std::pair<std::string, Row>> rows;
  for (const plan::UnitPlan& u : p.units) {
    if (u.stage != st.stage) continue;
    int kind = 4;
    std::string label = u.name;
    if (u.layer < 0) {
      kind = u.name == "embedding" ? 0 : 4;
    } else if (u.expert) {
      kind = 3, label = "layers.*.experts";
    } else {
      kind = in.moe.is_moe_layer(u.layer) ? 2 : 1;
      label = kind == 2 ? "layers.* (MoE layers)" : "layers.* (dense layers)";
    }
    auto& [name, r] = rows[kind];
    name = label;
    ++r.count;
    r.local = std::max(r.local, u.local);
    r.group = u.group;
    r.group_name = u.expert ? "edp" : "dp-cp";
    r.state += u.state;
  }
  for (const auto& [kind, nr] : rows) {
    const auto& [name, r] = nr;
    std::printf("  %-24s %5lld %14s %6s %5lld %12s %12s %12s\n", name.c_str(), static_cast<long long>(r.count),
                count(static_cast<double>(r.local)).c_str(), r.group_name.c_str(), static_cast<long long>(r.group),
                human(r.state.param).c_str(), human(r.state.grad).c_str(), human(r.state.optim).c_str());
  }
  if (st.expert_bias > 0)
    std::printf("  %-24s %5lld %14s %12s %12s %12s %12s\n", "layers.*.expert_bias",
                static_cast<long long>(st.num_moe_layers), count(static_cast<double>(in.moe.router.num_experts)).c_str(),
                "whole", human(st.expert_bias).c_str(), "-", "-");
  std::printf("  %-24s %12s (param %s, grad %s, optim %s)\n", "state", human(st.state.total()).c_str(),
              human(st.state.param).c_str(), human(st.state.grad).c_str(), human(st.state.optim).c_str());
  // Each category's peak; the line's total is their sum's, at one moment.
  std::printf("  %-24s %12s (ZeRO %d at its peak; whole params %s, whole grads %s, reduce-scatter receive %s)\n",
              "working buffers", human(st.zero.total).c_str(), in.zero_stage, human(st.zero.param).c_str(),
              human(st.zero.grad).c_str(), human(st.zero.comm).c_str());
  std::printf("  %-24s %12s (the most held between ops: %lld micro-batch(es) x (%lld dense + %lld MoE layers + "
              "stage extras)%s)\n",
              "activations", human(st.activations).c_str(), static_cast<long long>(st.in_flight),
              static_cast<long long>(st.num_layers - st.num_moe_layers), static_cast<long long>(st.num_moe_layers),
              st.pending_w > 0 ? " + pending W operands" : "");
  if (st.rebuild > 0)
    std::printf("  %-24s %12s (recompute full: the largest layer's activations, live inside its backward)\n",
                "rebuilt in backward", human(st.rebuild).c_str());
  std::printf("  %-24s %12s (state + the most live at once: working buffers, activations, pipeline buffers and a "
              "backward's transients%s; not counted: kernel workspaces)\n",
              "total", human(st.total()).c_str(), st.rebuild > 0 ? " and rebuilt layer" : "");

  const int64_t T = in.training.micro_batch * in.training.seq_len / p.cp, t = T / p.tp;
  std::printf("\nactivations saved per micro-batch (%s; T = mb*s/cp = %lld tokens, t = T/tp = %lld per rank):\n",
              std::string(plan::recipe_name(in.recipe)).c_str(), static_cast<long long>(T), static_cast<long long>(t));
  bool any_dense = false, any_moe = false;
  for (int64_t l = 0; l < in.model.num_layers; ++l) (in.moe.is_moe_layer(l) ? any_moe : any_dense) = true;
  if (any_dense)
    std::printf("  dense layer %s (%.0f bytes per token of t)\n", human(p.act.dense_layer).c_str(),
                static_cast<double>(p.act.dense_layer) / static_cast<double>(t));
  if (any_moe)
    std::printf("  MoE layer   %s (%.0f bytes per token of t; %lld routed rows)\n", human(p.act.moe_layer).c_str(),
                static_cast<double>(p.act.moe_layer) / static_cast<double>(t), static_cast<long long>(p.act.rows));
  std::printf(
      "  + per micro-batch: %s on stage 0 (token ids, positions), %s on the last stage (final norm, head, "
      "loss)\n",
      human(p.act.first_stage + p.act.every_stage).c_str(), human(p.act.last_stage + p.act.every_stage).c_str());
  if (p.cp == 1) return;
  // Both CP methods side by side (engine/plan.h, KvMemory), U = one rank's K and V.
  const plan::KvMemory& kv = p.kv;
  const bool ring = in.cp_comm == dense::CpComm::ring;
  std::printf("\nCP attention K/V per rank (U = 2*T*Hkv/tp*hd*%d = %s; parallel.cp_comm = \"%s\"):\n",
              in.recipe == plan::Recipe::bf16 ? 2 : 4, human(kv.block).c_str(), ring ? "ring" : "all_gather");
  std::printf("  %-12s %16s %24s %12s %14s\n", "cp_comm", "saved per layer", "transient (of it wire)", "peak",
              "cp bytes/step");
  for (const bool r : {false, true})
    std::printf("  %-12s %16s %12s (%9s) %12s %14s%s\n", r ? "ring" : "all_gather",
                human(r ? kv.saved_ring : kv.saved_all_gather).c_str(),
                human(r ? kv.transient_ring : kv.transient_all_gather).c_str(),
                human(r ? kv.wire_ring : kv.wire_all_gather).c_str(),
                human(r ? kv.peak_ring : kv.peak_all_gather).c_str(),
                human(r ? kv.step_comm_ring : kv.step_comm_all_gather).c_str(), r == ring ? "  <- configured" : "");
  std::printf("  (saved: all_gather cp*U + positions, ring U; transient: all_gather (2cp+1)*U, ring (min(2,cp-1)+3)*U;\n"
              "   peak: saved x layers x micro-batches in flight + transient; cp bytes per layer and micro-batch:\n"
              "   all_gather 2(cp-1)*U, ring (3cp-2)*U)\n");
}

void print_comm(const LayoutPlan& p, const plan::Machine& mc) {
  const plan::StageComm& c = p.comm[p.worst_comm_stage];
  std::printf("\ncommunication per step, stage %lld (world rank %lld), bytes sent by this rank:\n",
              static_cast<long long>(c.stage), static_cast<long long>(c.rank));
  for (comm::GroupKind g : comm::kAllGroupKinds) {
    if (c.bytes(g) <= 0) continue;
    std::map<std::string, double> by_op;
    for (const plan::CommItem& i : c.items)
      if (i.group == g) by_op[std::string(comm::op_name(i.op))] += i.bytes;
    std::string ops;
    for (const auto& [op, b] : by_op) ops += (ops.empty() ? "" : ", ") + op + " " + human(b);
    std::printf("  %-9s %12s   (%s)\n", group_str(g).c_str(), human(c.bytes(g)).c_str(), ops.c_str());
  }
  std::printf("  %-9s %12s\n", "total", human(c.total()).c_str());
  std::printf(
      "\nstep estimate: %.3g FLOP; compute %.4g s (bubble %.1f%%) + comm %.4g s = %.4g s\n"
      "  (%.3g FLOP/s per rank, %.3g GB/s intra-node, %.3g GB/s inter-node, %lld ranks per node, no overlap)\n",
      p.flops, p.compute_s, 100 * p.bubble, p.comm_s, p.step_s, mc.flops_per_rank, mc.intra_gbs, mc.inter_gbs,
      static_cast<long long>(mc.ranks_per_node));
}

void print_ranked(const PlanArgs& a, const std::vector<LayoutPlan>& ranked) {
  std::printf("\nlayouts of %lld ranks: %zu valid, ranked by estimated step time (fitting in %.4g GB first):\n",
              static_cast<long long>(a.world), ranked.size(), a.machine.memory_gb);
  if (ranked.empty()) {
    std::printf("  (none satisfies the model's constraints)\n");
    return;
  }
  std::printf("  %3s %4s %4s %4s %4s %4s %5s %5s %5s %11s %11s %10s %10s %7s %10s %s\n", "#", "tp", "cp", "pp", "ep",
              "etp", "dp", "edp", "m", "peak mem", "comm/step", "compute s", "comm s", "bubble", "step s", "fits");
  for (size_t i = 0; i < ranked.size() && static_cast<int64_t>(i) < a.top; ++i) {
    const LayoutPlan& p = ranked[i];
    std::printf("  %3zu %4lld %4lld %4lld %4lld %4lld %5lld %5lld %5lld %11s %11s %10.4g %10.4g %6.1f%% %10.4g %s\n",
                i + 1, static_cast<long long>(p.tp), static_cast<long long>(p.cp), static_cast<long long>(p.pp),
                static_cast<long long>(p.ep), static_cast<long long>(p.etp), static_cast<long long>(p.dp),
                static_cast<long long>(p.edp), static_cast<long long>(p.micro_batches), human(p.peak_bytes()).c_str(),
                human(p.comm_bytes).c_str(), p.compute_s, p.comm_s, 100 * p.bubble, p.step_s,
                p.fits ? "yes" : "NO (over memory)");
  }
}

void run_config(const PlanArgs& a, plan::Recipe recipe, const std::string& path, bool print) {
  const Config cfg = load_config(path, a.overrides);
  // The planner tabulates every unit (each layer's attention, norms and
  // router, each expert) for every layout it ranks; a model of millions of
  // layers would take tens of GB to plan. Real ones have tens of thousands.
  constexpr long double kMaxPlannedUnits = 1 << 22;
  const long double units = static_cast<long double>(cfg.model.num_layers) *
                            static_cast<long double>(cfg.moe.router.num_experts + 8);
  if (units > kMaxPlannedUnits)
    ORIGAMI_USER_ERROR(cfg.origin_of({"model.num_layers", "moe.num_experts"}), ": model.num_layers = ", cfg.model.num_layers,
                       " with moe.num_experts = ", cfg.moe.router.num_experts, " makes about ",
                       static_cast<int64_t>(units), " units to plan; the planner takes at most 4194304 (rule: ",
                       "num_layers × (num_experts + 8) <= 2^22)");
  plan::PlanInput in = plan::plan_input(cfg);
  if (!a.recipe.empty()) in.recipe = recipe;
  if (a.stage >= 0) in.zero_stage = a.stage;
  in.pp_layers = a.pp_layers.empty() ? cfg.parallel.pp_layers : a.pp_layers;  // the flag overrides the config
  // The configured layout meets train's rules, with train's message.
  Config configured = cfg;
  configured.parallel.pp_layers = in.pp_layers;
  if (!a.pp_layers.empty()) {  // the flag is where the value came from
    std::string given;
    for (int64_t n : a.pp_layers) given += (given.empty() ? "" : ",") + std::to_string(n);
    configured.set_by["parallel.pp_layers"] = "--pp-layers " + given;
  }
  validate_for_world(configured, static_cast<int>(a.world));
  const ParallelConfig& pc = cfg.parallel;
  const comm::Layout layout(a.world, comm::LayoutOptions{pc.tp, pc.cp, pc.pp, pc.ep, pc.etp, pc.order,
                                                         cfg.moe.router.num_experts});
  const LayoutPlan p = plan::plan_layout(in, layout, a.machine);
  const std::vector<LayoutPlan> ranked = plan::rank_layouts(in, a.world, pc.order, a.machine);
  const plan::ParamCounts counts = plan::param_counts(in.model, in.moe);
  if (!print) return;
  if (a.json) {
    std::printf("%s\n", plan_json(a, cfg.source, in, counts, p, ranked).dump().c_str());
    return;
  }
  const plan::RecipeBytes rb = plan::recipe_bytes(in.recipe);
  std::printf("origami plan: %s on %lld ranks; per-rank figures, GB = 1e9 bytes\n", cfg.source.c_str(),
              static_cast<long long>(a.world));
  std::printf("recipe %s (%lld param + %lld grad + %lld optim bytes per param), ZeRO stage %d\n",
              std::string(plan::recipe_name(in.recipe)).c_str(), static_cast<long long>(rb.param),
              static_cast<long long>(rb.grad), static_cast<long long>(rb.optim), in.zero_stage);
  std::printf("model: %s params (%lld), %s active per token, %s in routed experts\n",
              count(static_cast<double>(counts.total)).c_str(), static_cast<long long>(counts.total),
              count(static_cast<double>(counts.active)).c_str(), count(static_cast<double>(counts.expert)).c_str());
  std::printf("layout: TP %lld x CP %lld x DP %lld x PP %lld | ETP %lld x EP %lld x EDP %lld x PP %lld (order %s)\n",
              static_cast<long long>(p.tp), static_cast<long long>(p.cp), static_cast<long long>(p.dp),
              static_cast<long long>(p.pp), static_cast<long long>(p.etp), static_cast<long long>(p.ep),
              static_cast<long long>(p.edp), static_cast<long long>(p.pp), p.order.c_str());
  std::printf("batch: %lld samples x %lld tokens, micro_batch %lld, %lld micro-batches per step per DP rank\n",
              static_cast<long long>(in.training.global_batch), static_cast<long long>(in.training.seq_len),
              static_cast<long long>(in.training.micro_batch), static_cast<long long>(p.micro_batches));
  print_placement(in.moe.expert_placement);
  print_ledger(in, p);
  print_pipeline(p);
  const plan::CheckpointBytes ck = plan::checkpoint_bytes(p, counts);
  std::printf("\ncheckpoint (fp32 params + AdamW moments, each element once): %s on the largest rank, %s in all\n",
              human(static_cast<double>(ck.max_rank)).c_str(), human(static_cast<double>(ck.total)).c_str());
  print_comm(p, a.machine);
  print_ranked(a, ranked);
}

void run_plan(const PlanArgs& a) {
  const int rank = job_rank();
  if (!a.config.empty() && !a.config_opt.empty() && a.config != a.config_opt)
    ORIGAMI_USER_ERROR("two configs given: ", a.config, " and --config ", a.config_opt);
  const std::string path = a.config.empty() ? a.config_opt : a.config;
  if (path.empty() && a.params == 0)
    ORIGAMI_USER_ERROR(
        "nothing to plan: give a config (origami plan CONFIG --world W) or --params P (origami plan "
        "--params 7e9 --world 8)");
  if (!path.empty() && a.params != 0)
    ORIGAMI_USER_ERROR("--params plans a bare parameter count; it does not go with a config (", path, ")");
  if (path.empty() && (!a.overrides.empty() || a.stage >= 0 || !a.pp_layers.empty()))
    ORIGAMI_USER_ERROR("--params plans a bare parameter count at every ZeRO stage; ",
                       !a.overrides.empty() ? "--set" : a.stage >= 0 ? "--stage" : "--pp-layers",
                       " goes with a config (origami plan CONFIG --world W ...)");
  if (a.world < 1) ORIGAMI_USER_ERROR("--world is required (the number of ranks to plan for)");
  PlanArgs args = a;
  if (a.link_gbs > 0) args.machine.intra_gbs = args.machine.inter_gbs = a.link_gbs;
  const plan::Recipe recipe = plan::parse_recipe(a.recipe.empty() ? "fp32" : a.recipe, "--recipe");
  if (path.empty())
    run_params(args, recipe, rank == 0);
  else
    run_config(args, recipe, path, rank == 0);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "Predict per-rank memory and communication, and rank layouts of W ranks");
  cmd->add_option("config", a->config, "TOML config file");
  cmd->add_option("--config", a->config_opt, "TOML config file (same as the positional argument)");
  add_set_option(cmd, a->overrides);
  cmd->add_option("--world", a->world, "Number of ranks to plan for")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--stage", a->stage, "ZeRO stage (default: parallel.zero_stage)")->check(CLI::Range(0, 3));
  cmd->add_option("--recipe", a->recipe,
                  "fp32 (4+4+8 bytes/param) or bf16 (2+2+4+8: master weights beside the moments); default: the "
                  "config's runtime.precision as train resolves it, fp32 with --params")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--pp-layers", a->pp_layers_given,
                  "Layers per pipeline stage of the configured layout, comma-separated (default: "
                  "parallel.pp_layers, else even)");
  cmd->add_option("--params", a->params, "Without a config: ZeRO state of this many parameters over --world ranks")
      ->check(finite_positive());
  cmd->add_option("--flops-per-rank", a->machine.flops_per_rank, "Sustained FLOP/s per rank (default 4e14)")
      ->check(finite_positive());
  CLI::Option* link = cmd->add_option("--link-gbs", a->link_gbs, "One bandwidth for every group, GB/s per rank")
                          ->check(finite_positive());
  // One bandwidth for every group, or the two of a node and between nodes: not both.
  cmd->add_option("--intra-gbs", a->machine.intra_gbs, "Intra-node bandwidth, GB/s per rank (default 150)")
      ->check(finite_positive())
      ->excludes(link);
  cmd->add_option("--inter-gbs", a->machine.inter_gbs, "Inter-node bandwidth, GB/s per rank (default 25)")
      ->check(finite_positive())
      ->excludes(link);
  cmd->add_option("--ranks-per-node", a->machine.ranks_per_node, "Ranks per node (default 8)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--memory-gb", a->machine.memory_gb, "Per-rank memory limit, GB (default 80)")
      ->check(finite_positive());
  cmd->add_option("--top", a->top, "Rows of the ranked layout table (default 10)")->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--json", a->json, "Print everything as one JSON object");
  cmd->callback([a] {
    a->pp_layers.clear();
    for (const std::string& item : comma_items(a->pp_layers_given, "--pp-layers")) {
      // "3, 3" and "+3" read as CLI11 reads a number.
      const size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
      const std::string digits = item.substr(first, last - first + 1);
      const char* from = digits.data() + (digits[0] == '+' ? 1 : 0);
      const char* end = digits.data() + digits.size();
      int64_t n = 0;
      const auto [at, ec] = std::from_chars(from, end, n);
      if (ec == std::errc::result_out_of_range)
        ORIGAMI_USER_ERROR("--pp-layers '", shorten(item), "': does not fit in 64 bits");
      if (ec != std::errc() || at != end || from == end)
        ORIGAMI_USER_ERROR("--pp-layers '", shorten(item), "': not a whole number of layers (rule: a comma-separated "
                           "count of layers per pipeline stage, e.g. 3,3,2)");
      a->pp_layers.push_back(n);
    }
    run_plan(*a);
  });
}

}  // namespace origami::tools
