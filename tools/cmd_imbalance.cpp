// `origami imbalance RUN [RUN...]`: the load-imbalance report of runs'
// metrics.jsonl (engine/imbalance.h defines every number), as a terminal
// report or --json, optionally a self-contained HTML page, and with --place
// a balanced `moe.expert_placement` for --ep N ranks. Exit status: 0
// healthy, 1 when an alert fired (a job script can react), 2 bad input.
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "engine/files.h"
#include "engine/imbalance.h"
#include "kernels/check.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

namespace im = origami::imbalance;

struct Args {
  std::vector<std::string> runs;
  std::string steps, html, out;
  int64_t window = 0, ep = 0;
  bool json = false, place = false;
  double collapse_share = 0.5, rise = 0.25;
};

// "A:B", "A:", ":B" or "A": steps A through B, both included.
void parse_steps(const std::string& text, im::Options& opt) {
  auto number = [&](const std::string& s) -> int64_t {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (s.empty() || used != s.size() || v < 0)
      ORIGAMI_USER_ERROR("--steps ", shorten(text), ": '", shorten(s), "' is not a step number (A:B, A:, :B or A)");
    return v;
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    opt.first_step = opt.last_step = number(text);
    return;
  }
  const std::string a = text.substr(0, colon), b = text.substr(colon + 1);
  if (!a.empty()) opt.first_step = number(a);
  if (!b.empty()) opt.last_step = number(b);
  if (opt.first_step && opt.last_step && *opt.first_step > *opt.last_step)
    ORIGAMI_USER_ERROR("--steps ", text, ": the first step is after the last");
}

std::string f(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string bytes_text(double b) {
  if (b >= 1e9) return f(b / 1e9, 2) + " GB";
  if (b >= 1e6) return f(b / 1e6, 2) + " MB";
  return f(b / 1e3, 1) + " kB";
}

void print_report(std::FILE* out, const im::RunReport& r) {
  const im::LayerReport& L0 = r.layers.front();
  std::fprintf(out, "%s: steps %lld-%lld (%lld of %lld records), %zu MoE layers x %lld experts, top-%lld, EP %lld\n",
              r.path.c_str(), static_cast<long long>(r.first_step), static_cast<long long>(r.last_step),
              static_cast<long long>(r.steps), static_cast<long long>(r.records), r.layers.size(),
              static_cast<long long>(L0.experts), static_cast<long long>(r.top_k), static_cast<long long>(L0.ep.ranks));
  if (r.shape.known)
    std::fprintf(out, "  config: load_balancing %s%s%s\n", r.shape.load_balancing.c_str(),
                r.shape.expert_bias ? " + expert_bias" : "", r.shape.placement.empty() ? "" : ", moe.expert_placement");
  for (const std::string& note : r.notes) std::fprintf(out, "  note: %s\n", note.c_str());
  const bool what_if = L0.what_if.ranks > 0;
  std::fprintf(out, "  %5s %8s %8s %8s %6s %9s %5s  %-27s %8s %12s%s\n", "layer", "util min", "util max", "max_vio", "CV",
              "batch vio", "dead", "hottest (share of tokens)", "dropped", "EP max/mean",
              what_if ? ("  EP" + std::to_string(L0.what_if.ranks) + " what-if").c_str() : "");
  for (const im::LayerReport& L : r.layers) {
    std::string hot;
    for (const im::HotExpert& h : L.hottest) hot += (hot.empty() ? "#" : " #") + std::to_string(h.expert) + " " + f(100 * h.share, 1) + "%";
    const std::string ep = L.ep.ranks > 1 ? f(L.ep.max_over_mean, 3) : "-";
    std::fprintf(out, "  %5lld %8.3f %8.3f %8.3f %6.3f %9.3f %5zu  %-27s %8.4f %12s", static_cast<long long>(L.layer),
                L.utilization_min, L.utilization_max, L.max_vio, L.cv, L.max_vio_batch, L.dead.size(), hot.c_str(),
                L.dropped_fraction, ep.c_str());
    if (what_if) std::fprintf(out, "  %11.3f", L.what_if.max_over_mean);
    std::fprintf(out, "\n");
  }
  std::fprintf(out, "  across layers: max_vio p50 %.3f p90 %.3f p95 %.3f | batch max_vio p50 %.3f p90 %.3f p95 %.3f\n", r.p50,
              r.p90, r.p95, r.batch_p50, r.batch_p90, r.batch_p95);
  const double change = r.trend_first > 0 ? 100 * (r.trend_last / r.trend_first - 1) : 0;
  std::fprintf(out, "  trend: mean batch max_vio %.3f over the first %lld steps -> %.3f over the last %lld (%+.0f%%)\n",
              r.trend_first, static_cast<long long>(r.window), r.trend_last, static_cast<long long>(r.window), change);
  if (L0.ep.ranks > 1) {
    std::string cost = "  cost per step: the busiest EP rank gets " + f(r.cost.excess_tokens, 1) +
                       " more tokens than the mean rank (summed over layers)";
    if (r.cost.timed) {
      // Rank 0's GFLOP/s and all-to-all seconds include its waits for slower
      // ranks, so both times are upper bounds of the busiest rank's extra.
      cost += ": ~" + f(r.cost.compute_s, 4) + " s more expert compute (" +
              f(100 * r.cost.compute_s / std::max(1e-12, r.cost.step_time_s), 1) + "% of the " +
              f(r.cost.step_time_s, 3) + " s step, at the run's GFLOP/s) and " + bytes_text(r.cost.a2a_bytes) +
              " more all-to-all traffic";
      if (r.cost.a2a_timed)
        cost += " (<= " + f(r.cost.a2a_s, 4) + " s at the run's all-to-all rate, whose time includes waits for slower ranks)";
    } else {
      cost += " (no config.toml beside the metrics: no time estimate)";
    }
    std::fprintf(out, "%s\n", cost.c_str());
  } else {
    std::fprintf(out, "  cost: one EP rank holds every expert; imbalance costs no straggler here (see --ep N for a what-if)\n");
  }
  if (r.alerts.empty()) std::fprintf(out, "  healthy: no alerts\n");
  for (const im::Alert& a : r.alerts) std::fprintf(out, "  ALERT %s\n", a.message.c_str());
}

void print_placement(std::FILE* out, const std::vector<im::LayerPlacement>& plan, int64_t ranks,
                     const std::string& run) {
  std::fprintf(out, "placement for EP %lld from %s (predicted per-EP-rank max/mean of kept tokens over the window):\n",
              static_cast<long long>(ranks), run.c_str());
  for (const im::LayerPlacement& lp : plan) {
    std::string ranks_text;
    for (const auto& r : lp.after) {
      ranks_text += ranks_text.empty() ? "[" : " [";
      for (size_t i = 0; i < r.size(); ++i) ranks_text += (i ? "," : "") + std::to_string(r[i]);
      ranks_text += "]";
    }
    std::fprintf(out, "  layer %lld: %.3f (%s) -> %.3f  %s\n", static_cast<long long>(lp.layer), lp.before_max_over_mean,
                lp.before_from_run ? "run's placement" : "contiguous", lp.after_max_over_mean, ranks_text.c_str());
  }
}

// The files a report reads: each RUN's metrics.jsonl and the config.toml
// beside it (read_shape).
std::vector<std::pair<std::filesystem::path, std::string>> input_files(const Args& a) {
  namespace fs = std::filesystem;
  std::vector<std::pair<fs::path, std::string>> inputs;
  for (const std::string& run : a.runs) {
    std::error_code ec;
    const fs::path metrics = fs::is_directory(run, ec) ? fs::path(run) / "metrics.jsonl" : fs::path(run);
    inputs.emplace_back(metrics, "the metrics of RUN " + run);
    inputs.emplace_back(metrics.parent_path() / "config.toml", "the config beside RUN " + run);
  }
  return inputs;
}

// --html and --out name files of their own: an output that is an input
// (`--html run/metrics.jsonl`) would replace the run's records, one that is
// the other output would keep only the last written. Compared as resolved
// paths (symbolic links followed, `..` folded), before anything is read.
void check_outputs_apart(const Args& a) {
  namespace fs = std::filesystem;
  auto resolved = [](const std::string& p) {
    std::error_code ec;
    const fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
    return ec ? fs::absolute(p).lexically_normal() : r;
  };
  const auto inputs = input_files(a);
  for (const auto& [option, path] : {std::pair<const char*, std::string>{"--html", a.html}, {"--out", a.out}}) {
    if (path.empty()) continue;
    for (const auto& [input, what] : inputs)
      if (resolved(path) == resolved(input.string()))
        ORIGAMI_USER_ERROR(option, " ", path, ": is ", what, " (rule: an output names a file of its own, never one "
                           "the report reads)");
  }
  if (!a.html.empty() && !a.out.empty() && resolved(a.html) == resolved(a.out))
    ORIGAMI_USER_ERROR("--html ", a.html, " and --out ", a.out, ": the same file (rule: each output its own file)");
}

int run_imbalance(const Args& a) {
  im::Options opt;
  if (!a.steps.empty()) parse_steps(a.steps, opt);
  opt.window = a.window;
  opt.what_if_ep = a.ep;
  opt.collapse_share = a.collapse_share;
  opt.rise = a.rise;
  if (a.place && a.ep <= 0) ORIGAMI_USER_ERROR("--place needs --ep N: the EP size to place the experts on");
  if (!a.out.empty() && !a.place) ORIGAMI_USER_ERROR("--out writes the placement: it needs --place");
  check_outputs_apart(a);
  // --place without --out prints the placement, and stdout is then the
  // placement TOML alone (`> placement.toml` gives a file the config takes):
  // the report goes to stderr.
  std::FILE* report = a.place && a.out.empty() && !a.json ? stderr : stdout;

  std::vector<im::RunReport> reports;
  for (const std::string& run : a.runs) reports.push_back(im::analyze(run, opt));
  std::vector<im::LayerPlacement> plan;
  if (a.place) plan = im::advise_placement(reports.front(), a.ep);

  if (a.json) {
    nlohmann::ordered_json j = {{"runs", nlohmann::ordered_json::array()}};
    for (const im::RunReport& r : reports) j["runs"].push_back(im::to_json(r, /*with_series=*/false));
    if (a.place) {
      j["placement"] = im::to_json(plan, a.ep);
      j["placement"]["run"] = reports.front().path;  // with several RUNs, the first's loads
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    for (const im::RunReport& r : reports) print_report(report, r);
    if (reports.size() > 1) {
      std::fprintf(report, "comparison:\n  %-40s %-22s %9s %9s %12s %10s\n", "run", "load balancing", "vio p50", "vio p95",
                  "EP max/mean", "aux loss");
      for (const im::RunReport& r : reports) {
        double ep = 0;
        for (const im::LayerReport& L : r.layers) ep += L.ep.max_over_mean / static_cast<double>(r.layers.size());
        const std::string lb = !r.shape.known ? "?" : r.shape.load_balancing + (r.shape.expert_bias ? " + expert_bias" : "");
        std::fprintf(report, "  %-40s %-22s %9.3f %9.3f %12.3f %10.4f\n", shorten(r.path, 40).c_str(), lb.c_str(), r.p50,
                    r.p95, ep, r.mean_aux_loss);
      }
    }
    if (a.place) print_placement(report, plan, a.ep, reports.front().path);
  }
  if (a.place) {
    const std::string toml = im::placement_toml(reports.front(), plan, a.ep);
    if (a.out.empty()) {
      if (!a.json) std::printf("%s", toml.c_str());
    } else {
      OutputFile out(a.out, OutputFile::Mode::truncate);
      out.write(toml);
      out.close();
      if (!a.json) std::fprintf(report, "wrote %s (apply with --set moe.expert_placement=%s)\n", a.out.c_str(), a.out.c_str());
    }
  }
  if (!a.html.empty()) {
    OutputFile out(a.html, OutputFile::Mode::truncate);
    out.write(im::html_report(reports, a.place ? &plan : nullptr, a.ep));
    out.close();
    if (!a.json) std::fprintf(report, "wrote %s\n", a.html.c_str());
  }
  for (const im::RunReport& r : reports)
    if (!r.alerts.empty()) return 1;
  return 0;
}

}  // namespace

void add_imbalance_command(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("imbalance", "Expert load-imbalance report of runs' metrics.jsonl");
  cmd->add_option("runs", args->runs, "Run directories (holding metrics.jsonl) or metrics.jsonl files")->required();
  cmd->add_option("--steps", args->steps, "Steps A:B (both included; A: or :B open-ended)");
  cmd->add_option("--window", args->window, "Trend window in steps (default: a tenth of the selection)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--ep", args->ep, "What-if EP size (contiguous experts); with --place, the EP size to place on")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--html", args->html, "Write a self-contained HTML report here");
  cmd->add_flag("--json", args->json, "Print the statistics as JSON instead of the terminal report");
  cmd->add_flag("--place", args->place, "Advise a balanced moe.expert_placement for --ep N ranks (from the first RUN)");
  cmd->add_option("--out", args->out, "With --place: write the placement TOML here (default: print it)");
  cmd->add_option("--collapse-share", args->collapse_share,
                  "Alert when one expert sees more than this share of a layer's tokens")
      ->check(finite_in(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--rise", args->rise, "Alert when the last window's imbalance exceeds the first's by this fraction")
      ->check(finite_positive())
      ->capture_default_str();
  cmd->callback([args, &exit_status] {
    require_one_process("imbalance");
    exit_status = run_imbalance(*args);
  });
}

}  // namespace origami::tools
