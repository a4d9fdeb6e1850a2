// Imbalance statistics across layers, alerts, placements and the JSON form
// (see imbalance.h). The per-layer numbers come from the reader
// (engine/imbalance_reader.cpp); everything here works on a filled report.
#include "engine/imbalance.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <sstream>

#include "kernels/check.h"

namespace origami::imbalance {

double percentile(std::vector<double> x, double q) {
  ORIGAMI_CHECK(!x.empty(), "percentile of nothing");
  std::sort(x.begin(), x.end());
  const double pos = q / 100.0 * static_cast<double>(x.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos)), hi = std::min(x.size() - 1, lo + 1);
  return x[lo] + (x[hi] - x[lo]) * (pos - static_cast<double>(lo));
}

namespace {

std::string fixed(double v, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << v;
  return o.str();
}

std::string list(const std::vector<int64_t>& v, size_t most = 8) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < most; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  if (v.size() > most) s += ", … (" + std::to_string(v.size()) + " in all)";
  return s;
}

}  // namespace

void finish_report(RunReport& r, const Options& opt) {
  std::vector<double> vio, batch;
  double first = 0, last = 0;
  for (const LayerReport& L : r.layers) {
    vio.push_back(L.max_vio), batch.push_back(L.max_vio_batch);
    first += L.trend_first, last += L.trend_last;
  }
  if (r.layers.empty()) return;
  r.p50 = percentile(vio, 50), r.p90 = percentile(vio, 90), r.p95 = percentile(vio, 95);
  r.batch_p50 = percentile(batch, 50), r.batch_p90 = percentile(batch, 90), r.batch_p95 = percentile(batch, 95);
  r.trend_first = first / static_cast<double>(r.layers.size());
  r.trend_last = last / static_cast<double>(r.layers.size());

  const std::string steps = "steps " + std::to_string(r.first_step) + "-" + std::to_string(r.last_step);
  r.alerts.clear();
  for (const LayerReport& L : r.layers) {
    if (!L.hottest.empty() && L.hottest[0].share > opt.collapse_share)
      r.alerts.push_back({"collapse", L.layer,
                          "layer " + std::to_string(L.layer) + ": expert " + std::to_string(L.hottest[0].expert) +
                              " saw " + fixed(100 * L.hottest[0].share, 1) + "% of the layer's tokens in " + steps +
                              " (alert above " + fixed(100 * opt.collapse_share, 1) +
                              "%): routing is collapsing onto it"});
    if (!L.dead.empty())
      r.alerts.push_back({"dead_experts", L.layer,
                          "layer " + std::to_string(L.layer) + ": " + std::to_string(L.dead.size()) + " of " +
                              std::to_string(L.experts) + " experts received no tokens in " + steps + " (experts " +
                              list(L.dead) + ")"});
  }
  // Rising: the layers' mean batch MaxVio of the last window against the
  // first, when the windows do not overlap.
  if (r.steps >= 2 * r.window && r.trend_last > r.trend_first * (1 + opt.rise) &&
      r.trend_last - r.trend_first > 0.05) {
    std::vector<size_t> order(r.layers.size());
    std::iota(order.begin(), order.end(), 0);
    auto rise = [&](size_t i) { return r.layers[i].trend_last - r.layers[i].trend_first; };
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rise(a) > rise(b); });
    std::string worst;
    for (size_t i = 0; i < std::min<size_t>(3, order.size()); ++i) {
      const LayerReport& L = r.layers[order[i]];
      worst += (i ? ", " : "") + std::string("layer ") + std::to_string(L.layer) + " " + fixed(L.trend_first, 2) +
               " -> " + fixed(L.trend_last, 2);
    }
    r.alerts.push_back({"rising_imbalance", -1,
                        "imbalance is rising: mean batch MaxVio over layers " + fixed(r.trend_first, 3) +
                            " in the first " + std::to_string(r.window) + " steps, " + fixed(r.trend_last, 3) +
                            " in the last " + std::to_string(r.window) + " (alert above +" +
                            fixed(100 * opt.rise, 0) + "%); most: " + worst});
  }
}

std::vector<std::vector<int64_t>> contiguous_placement(int64_t experts, int64_t ranks) {
  std::vector<std::vector<int64_t>> p(ranks);
  for (int64_t e = 0; e < experts; ++e) p[e / (experts / ranks)].push_back(e);
  return p;
}

double placement_max_over_mean(const std::vector<int64_t>& load, const std::vector<std::vector<int64_t>>& placement) {
  double total = 0, mx = 0;
  for (const std::vector<int64_t>& rank : placement) {
    double s = 0;
    for (int64_t e : rank) s += static_cast<double>(load[e]);
    total += s, mx = std::max(mx, s);
  }
  return total > 0 ? mx / (total / static_cast<double>(placement.size())) : 0.0;
}

std::vector<std::vector<int64_t>> balanced_placement(const std::vector<int64_t>& load, int64_t ranks) {
  const int64_t E = static_cast<int64_t>(load.size());
  ORIGAMI_CHECK(ranks > 0 && E % ranks == 0, "balanced_placement: ", E, " experts over ", ranks, " ranks");
  const int64_t per = E / ranks;
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return load[a] > load[b]; });
  std::vector<std::vector<int64_t>> p(ranks);
  std::vector<int64_t> sum(ranks, 0);
  for (int64_t e : order) {
    int64_t best = -1;
    for (int64_t q = 0; q < ranks; ++q)
      if (static_cast<int64_t>(p[q].size()) < per && (best < 0 || sum[q] < sum[best])) best = q;
    p[best].push_back(e);
    sum[best] += load[e];
  }
  // Swaps between the busiest rank and another while one lowers the pair's
  // maximum below the busiest load (each accepted swap strictly lowers it,
  // or leaves fewer ranks at it: the loop ends).
  for (int64_t iter = 0; iter < E * E; ++iter) {
    const int64_t hot = std::max_element(sum.begin(), sum.end()) - sum.begin();
    int64_t best_q = -1;
    size_t best_i = 0, best_j = 0;
    int64_t best_max = sum[hot];
    for (int64_t q = 0; q < ranks; ++q) {
      if (q == hot) continue;
      for (size_t i = 0; i < p[hot].size(); ++i)
        for (size_t j = 0; j < p[q].size(); ++j) {
          const int64_t d = load[p[hot][i]] - load[p[q][j]];
          if (d <= 0) continue;
          const int64_t m = std::max(sum[hot] - d, sum[q] + d);
          if (m < best_max) best_max = m, best_q = q, best_i = i, best_j = j;
        }
    }
    if (best_q < 0) break;
    const int64_t d = load[p[hot][best_i]] - load[p[best_q][best_j]];
    std::swap(p[hot][best_i], p[best_q][best_j]);
    sum[hot] -= d, sum[best_q] += d;
  }
  for (std::vector<int64_t>& rank : p) std::sort(rank.begin(), rank.end());
  return p;
}

std::vector<LayerPlacement> advise_placement(const RunReport& run, int64_t ranks) {
  std::vector<LayerPlacement> plan;
  for (const LayerReport& L : run.layers) {
    if (ranks <= 0 || L.experts % ranks != 0)
      ORIGAMI_USER_ERROR("--place --ep ", ranks, ": layer ", L.layer, "'s ", L.experts, " experts do not split over ",
                         ranks, " EP ranks (", run.path, ")");
    LayerPlacement lp;
    lp.layer = L.layer;
    lp.before = contiguous_placement(L.experts, ranks);
    if (run.shape.ep == ranks)
      for (const auto& [layer, placed] : run.shape.placement) {
        if (layer != L.layer) continue;
        // The config's rules made it a permutation of [0, moe.num_experts),
        // and the reader refused a config whose expert count is not the records'.
        int64_t placed_experts = 0;
        for (const std::vector<int64_t>& r : placed) placed_experts += static_cast<int64_t>(r.size());
        ORIGAMI_CHECK(placed_experts == L.experts, "layer ", layer, ": the run's placement holds ", placed_experts,
                      " experts, its records ", L.experts);
        lp.before = placed, lp.before_from_run = true;
      }
    lp.after = balanced_placement(L.kept, ranks);
    lp.before_max_over_mean = placement_max_over_mean(L.kept, lp.before);
    lp.after_max_over_mean = placement_max_over_mean(L.kept, lp.after);
    plan.push_back(std::move(lp));
  }
  return plan;
}

std::string placement_toml(const RunReport& run, const std::vector<LayerPlacement>& plan, int64_t ranks) {
  std::ostringstream o;
  o << "# Expert placement from `origami imbalance --place --ep " << ranks << "`: kept tokens of steps "
    << run.first_step << "-" << run.last_step << " of " << run.path << ".\n"
    << "# Apply on resume: origami train CONFIG --set checkpoint.load=latest --set moe.expert_placement=FILE\n"
    << "# Predicted per-EP-rank max/mean over those steps, before -> after:\n";
  for (const LayerPlacement& lp : plan)
    o << "#   layer " << lp.layer << ": " << fixed(lp.before_max_over_mean, 3) << " ("
      << (lp.before_from_run ? "the run's placement" : "contiguous") << ") -> " << fixed(lp.after_max_over_mean, 3)
      << "\n";
  o << "[moe.expert_placement]\nep = " << ranks << "\n\n[moe.expert_placement.layers]\n";
  for (const LayerPlacement& lp : plan) {
    o << lp.layer << " = [";
    for (size_t p = 0; p < lp.after.size(); ++p) {
      o << (p ? ", [" : "[");
      for (size_t i = 0; i < lp.after[p].size(); ++i) o << (i ? ", " : "") << lp.after[p][i];
      o << "]";
    }
    o << "]\n";
  }
  return o.str();
}

namespace {

nlohmann::ordered_json to_json(const EpBalance& b) {
  return {{"ranks", b.ranks},
          {"max_over_mean", b.max_over_mean},
          {"step_max_over_mean", b.step_max_over_mean},
          {"excess_tokens", b.excess_tokens},
          {"rank_tokens", b.rank_tokens}};
}

nlohmann::ordered_json to_json(const Series& s) {
  return {{"first", s.first}, {"last", s.last}, {"value", s.value}};
}

}  // namespace

nlohmann::ordered_json to_json(const RunReport& r, bool with_series) {
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (const LayerReport& L : r.layers) {
    nlohmann::ordered_json hot = nlohmann::ordered_json::array();
    for (const HotExpert& h : L.hottest) hot.push_back({{"expert", h.expert}, {"share", h.share}});
    nlohmann::ordered_json j = {{"layer", L.layer},
                                {"experts", L.experts},
                                {"utilization_min", L.utilization_min},
                                {"utilization_max", L.utilization_max},
                                {"max_vio", L.max_vio},
                                {"cv", L.cv},
                                {"max_vio_batch", L.max_vio_batch},
                                {"dead_experts", L.dead},
                                {"hottest", hot},
                                {"dropped_fraction", L.dropped_fraction},
                                {"ep", to_json(L.ep)}};
    if (L.what_if.ranks > 0) j["what_if_ep"] = to_json(L.what_if);
    j["trend"] = {{"first", L.trend_first}, {"last", L.trend_last}};
    j["tokens_per_expert"] = L.routed;
    j["kept_per_expert"] = L.kept;
    if (with_series) {
      j["heatmap"] = {{"first", L.bin_first}, {"last", L.bin_last}, {"utilization", L.heat}};
      j["max_over_mean_series"] = to_json(L.max_over_mean);
      j["ep_max_over_mean_series"] = to_json(L.ep_max_over_mean);
      j["dropped_series"] = to_json(L.dropped);
    }
    layers.push_back(std::move(j));
  }
  nlohmann::ordered_json alerts = nlohmann::ordered_json::array();
  for (const Alert& a : r.alerts) {
    nlohmann::ordered_json j = {{"kind", a.kind}, {"message", a.message}};
    if (a.layer >= 0) j["layer"] = a.layer;
    alerts.push_back(std::move(j));
  }
  nlohmann::ordered_json cost = {{"excess_tokens", r.cost.excess_tokens}, {"step_time_s", r.cost.step_time_s}};
  if (r.cost.timed) {
    cost["compute_s"] = r.cost.compute_s;
    cost["a2a_bytes"] = r.cost.a2a_bytes;
    if (r.cost.a2a_timed) cost["a2a_s"] = r.cost.a2a_s;
  }
  nlohmann::ordered_json j = {
      {"path", r.path},
      {"records", r.records},
      {"steps", {{"first", r.first_step}, {"last", r.last_step}, {"count", r.steps}}},
      {"top_k", r.top_k},
      {"layers", layers},
      {"across_layers",
       {{"max_vio", {{"p50", r.p50}, {"p90", r.p90}, {"p95", r.p95}}},
        {"max_vio_batch", {{"p50", r.batch_p50}, {"p90", r.batch_p90}, {"p95", r.batch_p95}}}}},
      {"trend", {{"window", r.window}, {"first", r.trend_first}, {"last", r.trend_last}}},
      {"cost", cost},
      {"losses", {{"aux_loss_mean", r.mean_aux_loss}, {"lm_loss_first", r.first_lm_loss}, {"lm_loss_last", r.last_lm_loss}}},
      {"alerts", alerts},
      {"healthy", r.alerts.empty()},
      {"notes", r.notes}};
  if (r.shape.known)
    j["config"] = {{"load_balancing", r.shape.load_balancing}, {"expert_bias", r.shape.expert_bias},
                   {"ep", r.shape.ep}, {"placement", !r.shape.placement.empty()}};
  return j;
}

nlohmann::ordered_json to_json(const std::vector<LayerPlacement>& plan, int64_t ranks) {
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (const LayerPlacement& lp : plan)
    layers.push_back({{"layer", lp.layer},
                      {"before", lp.before},
                      {"before_from_run", lp.before_from_run},
                      {"after", lp.after},
                      {"before_max_over_mean", lp.before_max_over_mean},
                      {"after_max_over_mean", lp.after_max_over_mean}});
  return {{"ep", ranks}, {"layers", layers}};
}

}  // namespace origami::imbalance
