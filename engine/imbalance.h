// Load-imbalance diagnostics over a run's metrics.jsonl (ARCHITECTURE.md §8):
// the statistics behind `origami imbalance` (tools/cmd_imbalance.cpp) — per
// MoE layer over a window of steps, across layers, over time — its alerts,
// and balanced expert placements (`moe.expert_placement`).
//
// The file is streamed (engine/imbalance_reader.cpp, simdjson): memory grows
// with steps × layers (a few numbers per layer per step) and layers ×
// experts, never with the file. Every statistic is defined here, once, so
// the terminal, --json and the HTML page print the same numbers.
//
// Definitions, per MoE layer over the selected steps S (n = |S|), with
// r[s][e] the tokens routed to expert e at step s (`tokens_per_expert`,
// before dropping), k[s][e] those kept, q[s][p] the kept tokens EP rank p
// received (`tokens_per_ep_rank`):
//   load_e = Σ_s r[s][e], mean = Σ_e load_e / E
//   utilization_e = load_e / mean            (min and max reported)
//   max_vio  = (max_e load_e − mean) / mean  (the window's global MaxVio)
//   cv       = population std_e(load_e) / mean
//   max_vio_batch = mean over s of (max_e r[s][e] − m_s) / m_s, m_s = Σ_e r[s][e] / E
//                                           (steps with no tokens left out)
//   dead     = experts with load_e = 0
//   share_e  = load_e / tokens, tokens = Σ_e load_e / top_k (each token
//              counts once per chosen expert): the fraction of the layer's
//              tokens expert e saw
//   dropped_fraction = 1 − Σ k / Σ r
//   EP balance for P ranks with owners o(e): Q_p = Σ_s q[s][p] (the run's
//   own EP size, measured) or Σ_s Σ_{o(e)=p} k[s][e] (a what-if P, contiguous
//   blocks): max_over_mean = max_p Q_p / mean_p Q_p; step_max_over_mean =
//   mean over s of the same per step; excess_tokens = mean over s of
//   (max_p − mean_p) of the step's rank loads.
// Across layers: p50/p90/p95 of max_vio and max_vio_batch with numpy's
// default (linear) interpolation. Trend: the mean of max_vio_batch over the
// first and the last `window` steps of S, per layer and averaged over layers.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace origami::imbalance {

struct Options {
  std::optional<int64_t> first_step, last_step;  // --steps A:B, both inclusive
  int64_t window = 0;          // trend window in steps; 0: max(1, n / 10)
  int64_t what_if_ep = 0;      // --ep N: also the balance over N EP ranks (contiguous blocks)
  double collapse_share = 0.5;  // alert: one expert saw more than this share of a layer's tokens
  double rise = 0.25;          // alert: last window's max_vio_batch above first · (1 + rise) (and + 0.05)
  int64_t heatmap_bins = 96;   // at most this many step bins per layer in the HTML heatmap
};

// What the run's config.toml (written beside metrics.jsonl) says, when present.
struct RunShape {
  bool known = false;
  int64_t hidden_size = 0, expert_ffn = 0, top_k = 0, etp = 1, ep = 1;
  int64_t num_experts = 0, num_layers = 0;
  std::function<bool(int64_t)> is_moe_layer;  // the config's rule for layer indices
  std::string load_balancing;  // "aux_loss", "none", ... (the run's moe.load_balancing)
  bool expert_bias = false;
  // Per MoE layer: the experts of each EP rank the run used (empty: contiguous).
  std::vector<std::pair<int64_t, std::vector<std::vector<int64_t>>>> placement;
};

struct EpBalance {
  int64_t ranks = 0;
  double max_over_mean = 0, step_max_over_mean = 0, excess_tokens = 0;
  std::vector<int64_t> rank_tokens;  // Q_p over the window
};

struct HotExpert {
  int64_t expert = 0;
  double share = 0;  // of the layer's tokens
};

// A per-step series thinned to at most Options::heatmap_bins points: each
// point the mean over its steps [first, last].
struct Series {
  std::vector<int64_t> first, last;
  std::vector<double> value;
};

struct LayerReport {
  int64_t layer = 0, experts = 0;
  std::vector<int64_t> routed, kept;  // load_e, Σ_s k[s][e]
  double utilization_min = 0, utilization_max = 0, max_vio = 0, cv = 0, max_vio_batch = 0;
  double dropped_fraction = 0;
  std::vector<int64_t> dead;
  std::vector<HotExpert> hottest;  // the three busiest, by load
  EpBalance ep, what_if;           // what_if.ranks = 0 without --ep
  double trend_first = 0, trend_last = 0;
  // HTML: utilization per (step bin, expert), the bins' step ranges; and
  // max/mean, EP max/mean and dropped fraction over steps.
  std::vector<int64_t> bin_first, bin_last;
  std::vector<std::vector<double>> heat;  // [bin][expert]
  Series max_over_mean, ep_max_over_mean, dropped;
};

struct Alert {
  std::string kind;  // "collapse", "dead_experts", "rising_imbalance"
  int64_t layer = -1;
  std::string message;
};

struct Cost {
  // Per step, mean over S, summed over MoE layers: what the busiest EP rank
  // does beyond the mean rank.
  double excess_tokens = 0;
  bool timed = false;          // the run logged what time needs (config.toml, gflops)
  double compute_s = 0;        // its extra expert FLOPs at the step's measured GFLOP/s
  double a2a_bytes = 0;        // its extra all-to-all bytes (dispatch + combine, forward + backward)
  bool a2a_timed = false;      // the run logged the ep group's all-to-all seconds
  double a2a_s = 0;            // those bytes at the run's measured all-to-all rate
  // Both times are upper bounds: rank 0's GFLOP/s and all-to-all seconds
  // include its waits for slower ranks.
  double step_time_s = 0;      // mean measured step time, for scale
};

struct RunReport {
  std::string path;   // the metrics.jsonl read
  int64_t records = 0;           // step records in the file
  int64_t steps = 0, first_step = 0, last_step = 0;  // the selection S
  int64_t window = 0;
  int64_t top_k = 1;  // the config's, else slots per token of the first record
  RunShape shape;
  std::vector<LayerReport> layers;
  double p50 = 0, p90 = 0, p95 = 0;                    // of max_vio across layers
  double batch_p50 = 0, batch_p90 = 0, batch_p95 = 0;  // of max_vio_batch
  double trend_first = 0, trend_last = 0;              // mean over layers
  Cost cost;
  double mean_aux_loss = 0, first_lm_loss = 0, last_lm_loss = 0;
  std::vector<Alert> alerts;
  std::vector<std::string> notes;  // how the run's config was read (a resume under another EP size)
};

// Reads RUN (a run directory holding metrics.jsonl, or the file itself) and
// summarizes it. UserError naming file:line for a malformed line, a record
// without `step`, steps that do not increase, a MoE record of the wrong
// shape; naming the file for a run without MoE records or an empty
// selection. A final line without its newline that does not parse is a
// record still being written: skipped.
RunReport analyze(const std::string& run, const Options& opt);
// The across-layer statistics, the trend and the alerts of a report whose
// layers are filled (analyze calls it; tests build reports by hand).
void finish_report(RunReport& r, const Options& opt);

// numpy.percentile(x, q) with the default linear interpolation; x not empty.
double percentile(std::vector<double> x, double q);

// A balanced placement of one layer's experts on `ranks` EP ranks, E/ranks
// each (DeepSeek EPLB's balanced packing): experts by load descending, each
// to the least-loaded rank with a free slot; then pairwise swaps while one
// lowers the busiest rank. Each rank's experts ascending.
std::vector<std::vector<int64_t>> balanced_placement(const std::vector<int64_t>& load, int64_t ranks);
// The contiguous placement: rank p holds [p·E/ranks, (p+1)·E/ranks).
std::vector<std::vector<int64_t>> contiguous_placement(int64_t experts, int64_t ranks);
// max_p / mean_p of Σ load over each rank's experts.
double placement_max_over_mean(const std::vector<int64_t>& load, const std::vector<std::vector<int64_t>>& placement);

struct LayerPlacement {
  int64_t layer = 0;
  std::vector<std::vector<int64_t>> before, after;  // before: the run's (when its ep matches) or contiguous
  bool before_from_run = false;
  double before_max_over_mean = 0, after_max_over_mean = 0;
};
// For every MoE layer, the window's kept loads placed over `ranks`.
std::vector<LayerPlacement> advise_placement(const RunReport& run, int64_t ranks);
// The `[moe.expert_placement]` TOML the trainer reads (engine/config.cpp).
std::string placement_toml(const RunReport& run, const std::vector<LayerPlacement>& plan, int64_t ranks);

nlohmann::ordered_json to_json(const RunReport& r, bool with_series);
nlohmann::ordered_json to_json(const std::vector<LayerPlacement>& plan, int64_t ranks);

// The self-contained page (inline CSS, JS and SVG; nothing fetched).
std::string html_report(const std::vector<RunReport>& runs, const std::vector<LayerPlacement>* plan, int64_t ranks);

}  // namespace origami::imbalance
