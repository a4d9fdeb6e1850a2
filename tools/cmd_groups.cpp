// `origami groups`: prints every rank group of a parallel-folding layout, the
// dense view (tp, cp, dp, dp-cp, tp-cp, tp-dp-cp, pp, tp-pp, embedding) then
// the expert view (ep, etp, edp, tp-ep, tp-ep-pp), Megatron Core's rank maps.
//   origami groups --config C [--set k=v]... [--world W] [--rank R] [--json]
//   origami groups --world W [--tp --cp --pp --ep --etp --order --experts] [--rank R] [--json]
// With --config the layout is the [parallel] section and moe.num_experts; the
// world size is --world, else the MPI job's size. Invalid layouts are user
// errors (exit 2) whose message carries the numbers. Only rank 0 prints.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "comm/layout.h"
#include "engine/config.h"
#include "kernels/check.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

struct GroupsArgs {
  std::string config;
  std::vector<std::string> overrides;
  int64_t world = 0;  // 0: the MPI world size
  comm::LayoutOptions layout;
  int64_t rank = -1;  // -1: no per-rank section
  bool json = false;
  const CLI::Option* etp_flag = nullptr;  // --etp absent: etp = tp (Megatron's default, as in configs)
};

void print_text(const comm::Layout& l, int64_t rank) {
  std::printf("world %lld, order %s\n", static_cast<long long>(l.world()), l.order().c_str());
  std::printf("dense  TP %lld x CP %lld x DP %lld x PP %lld\n", static_cast<long long>(l.tp()),
              static_cast<long long>(l.cp()), static_cast<long long>(l.dp()), static_cast<long long>(l.pp()));
  std::printf("expert ETP %lld x EP %lld x EDP %lld x PP %lld\n", static_cast<long long>(l.etp()),
              static_cast<long long>(l.ep()), static_cast<long long>(l.edp()), static_cast<long long>(l.pp()));
  std::fputs(comm::describe(l).c_str(), stdout);
  if (rank < 0) return;
  const comm::RankCoords c = l.coords(static_cast<int>(rank));
  std::printf("rank %lld: dense tp %lld cp %lld dp %lld pp %lld; expert etp %lld ep %lld edp %lld\n",
              static_cast<long long>(rank), static_cast<long long>(c.tp), static_cast<long long>(c.cp),
              static_cast<long long>(c.dp), static_cast<long long>(c.pp), static_cast<long long>(c.etp),
              static_cast<long long>(c.ep), static_cast<long long>(c.edp));
  for (comm::GroupKind k : comm::kAllGroupKinds) {
    const comm::RankGroup g = l.group_of(k, static_cast<int>(rank));
    std::printf("  %-9s %s\n", std::string(comm::group_name(k)).c_str(),
                g.empty() ? "(none)" : comm::format_group(g).c_str());
  }
}

void print_json(const comm::Layout& l, int64_t rank) {
  nlohmann::ordered_json j;
  j["world"] = l.world();
  j["order"] = l.order();
  j["sizes"] = {{"tp", l.tp()}, {"cp", l.cp()},   {"dp", l.dp()},  {"pp", l.pp()},
                {"ep", l.ep()}, {"etp", l.etp()}, {"edp", l.edp()}};
  j["dense"] = nlohmann::ordered_json::object();
  j["expert"] = nlohmann::ordered_json::object();
  for (comm::GroupKind k : comm::kAllGroupKinds)
    j[comm::group_view(k) == comm::View::dense ? "dense" : "expert"][std::string(comm::group_name(k))] = l.groups(k);
  if (rank >= 0) {
    const comm::RankCoords c = l.coords(static_cast<int>(rank));
    nlohmann::ordered_json r;
    r["rank"] = rank;
    r["coords"] = {{"tp", c.tp},   {"cp", c.cp}, {"dp", c.dp},  {"pp", c.pp},
                   {"etp", c.etp}, {"ep", c.ep}, {"edp", c.edp}};
    r["groups"] = nlohmann::ordered_json::object();
    for (comm::GroupKind k : comm::kAllGroupKinds)
      r["groups"][std::string(comm::group_name(k))] = l.group_of(k, static_cast<int>(rank));
    j["rank"] = r;
  }
  std::printf("%s\n", j.dump().c_str());
}

void run_groups(const GroupsArgs& a) {
  const int mpi_rank = job_rank(), mpi_size = job_size();
  const int64_t world = a.world > 0 ? a.world : mpi_size;
  comm::LayoutOptions opts = a.layout;
  if (a.etp_flag && a.etp_flag->count() == 0) opts.etp = opts.tp;
  if (!a.config.empty()) {
    // A config's layout meets train's rules (layout_problem), with train's message.
    const Config cfg = load_config(a.config, a.overrides);
    validate_for_world(cfg, static_cast<int>(world));
    const ParallelConfig& p = cfg.parallel;
    opts = comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, cfg.moe.router.num_experts};
  }
  const comm::Layout layout(world, opts);  // flags alone: comm::Layout's rules (§3)
  if (a.rank >= world) ORIGAMI_USER_ERROR("--rank ", a.rank, " is outside a world of ", world, " ranks");
  if (mpi_rank != 0) return;
  if (a.json)
    print_json(layout, a.rank);
  else
    print_text(layout, a.rank);
}

}  // namespace

void add_groups_command(CLI::App& app) {
  auto args = std::make_shared<GroupsArgs>();
  CLI::App* cmd = app.add_subcommand("groups", "Print the dense and expert rank groups of a parallel layout");
  CLI::Option* config =
      cmd->add_option("--config", args->config, "TOML config: its [parallel] section and moe.num_experts");
  add_set_option(cmd, args->overrides)->needs(config);
  cmd->add_option("--world", args->world, "World size (default: the MPI job's size)")->check(CLI::Range(1, 1 << 20));
  std::vector<CLI::Option*> sizes = {
      cmd->add_option("--tp", args->layout.tp, "Tensor parallel size"),
      cmd->add_option("--cp", args->layout.cp, "Context parallel size"),
      cmd->add_option("--pp", args->layout.pp, "Pipeline parallel size"),
      cmd->add_option("--ep", args->layout.ep, "Expert parallel size"),
      cmd->add_option("--etp", args->layout.etp, "Expert tensor parallel size (default: --tp)"),
      cmd->add_option("--order", args->layout.order, "Axis order, fastest first (default tp-cp-ep-dp-pp)"),
      cmd->add_option("--experts", args->layout.num_experts, "Number of experts (checked against --ep)")};
  for (CLI::Option* o : sizes) o->excludes(config);
  args->etp_flag = sizes[4];
  cmd->add_option("--rank", args->rank, "Also print this rank's coordinates and groups")->check(CLI::Range(0, (1 << 20) - 1));
  cmd->add_flag("--json", args->json, "Print one JSON object: {\"dense\": {\"tp\": [[...]], ...}, \"expert\": {...}}");
  cmd->callback([args] { run_groups(*args); });
}

}  // namespace origami::tools
