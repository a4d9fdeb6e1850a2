// The self-contained HTML imbalance report (see imbalance.h). The page
// carries the reports as JSON (the --json form with the series) in a
// <script type="application/json"> block and draws itself: canvas heatmaps
// (a run of 64 layers × 256 experts × 96 bins is 1.6 M cells, too many for
// SVG elements), SVG lines and bars, tables whose cells hold each exact
// value in data-value beside the rounded text. Nothing is fetched: no
// network, no fonts, no libraries. Rendering ends by setting
// <body data-rendered="ok">; a script error sets data-error instead, so a
// headless browser can tell a drawn page from a broken one.
#include <string>

#include "engine/imbalance.h"

namespace origami::imbalance {

namespace {

constexpr const char* kHead = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Origami imbalance report</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d2330;background:#fafbfc}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #dde1e7;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.sub{color:#5b6475;margin-bottom:16px}
table{border-collapse:collapse;margin:6px 0 12px;background:#fff}
td,th{border:1px solid #dde1e7;padding:3px 8px;text-align:right;font-variant-numeric:tabular-nums}
th{background:#f0f2f5;font-weight:600}td.l,th.l{text-align:left}
.alerts li{margin:4px 0}.alert-collapse{color:#b42318}.alert-dead_experts{color:#b54708}.alert-rising_imbalance{color:#7a2e0e}
.ok{color:#067647}
.layer{display:grid;grid-template-columns:minmax(320px,1fr) minmax(320px,1fr);gap:8px 24px;background:#fff;border:1px solid #dde1e7;padding:10px;margin:10px 0}
.layer h3{grid-column:1/3;margin:0}
.panel .cap{color:#5b6475;font-size:12px}
canvas.heat{width:100%;height:160px;image-rendering:pixelated;border:1px solid #dde1e7}
svg{background:#fff}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}
pre{background:#fff;border:1px solid #dde1e7;padding:8px;overflow:auto}
</style></head>
<body>
<h1>Origami imbalance report</h1>
<div class="sub" id="subtitle"></div>
<h2>Alerts</h2><ul class="alerts" id="alerts"></ul>
<h2>Summary</h2><div id="summary"></div>
<div id="comparison"></div>
<div id="placement"></div>
<div id="layers"></div>
<script type="application/json" id="origami-data">)HTML";

constexpr const char* kTail = R"HTML(</script>
<script>
"use strict";
window.addEventListener("error", e => { document.body.dataset.error = String(e.message); });
const data = JSON.parse(document.getElementById("origami-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
function el(tag, attrs, parent, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(v, d) { return typeof v === "number" ? v.toFixed(d) : String(v); }
// A table row of numbers: each cell keeps its exact value in data-value.
function numRow(tr, key, value, digits) {
  const td = el("td", {"data-key": key, "data-value": String(value)}, tr, fmt(value, digits));
  return td;
}
function balancing(run) { return run.config ? run.config.load_balancing + (run.config.expert_bias ? " + expert_bias" : "") : "?"; }
function label(run) { return run.config ? run.path + " (" + balancing(run) + ")" : run.path; }

function drawAlerts() {
  const ul = document.getElementById("alerts");
  let n = 0;
  data.runs.forEach((run, r) => run.alerts.forEach(a => {
    const li = el("li", {"class": "alert alert-" + a.kind, "data-run": r, "data-kind": a.kind,
                         "data-layer": a.layer === undefined ? "" : a.layer}, ul,
                  (data.runs.length > 1 ? "[" + run.path + "] " : "") + a.message);
    n++;
  }));
  if (n === 0) el("li", {"class": "ok", "id": "healthy"}, ul, "No alerts: routing looks healthy.");
}

function drawSummary() {
  const div = document.getElementById("summary");
  const t = el("table", {"id": "summary-table"}, div);
  const h = el("tr", {}, t);
  for (const c of ["run", "steps", "MoE layers", "max_vio p50", "p90", "p95", "batch max_vio p50", "p90", "p95",
                   "trend first", "trend last", "busiest EP rank extra tokens/step", "extra expert compute s/step",
                   "extra all-to-all s/step (at most)", "step time s"])
    el("th", {"class": c === "run" ? "l" : ""}, h, c);
  data.runs.forEach((run, r) => {
    const tr = el("tr", {"data-run": r}, t);
    el("td", {"class": "l"}, tr, label(run));
    el("td", {}, tr, run.steps.first + "-" + run.steps.last + " (" + run.steps.count + ")");
    el("td", {}, tr, String(run.layers.length));
    const a = run.across_layers;
    numRow(tr, "max_vio.p50", a.max_vio.p50, 3); numRow(tr, "max_vio.p90", a.max_vio.p90, 3);
    numRow(tr, "max_vio.p95", a.max_vio.p95, 3);
    numRow(tr, "max_vio_batch.p50", a.max_vio_batch.p50, 3); numRow(tr, "max_vio_batch.p90", a.max_vio_batch.p90, 3);
    numRow(tr, "max_vio_batch.p95", a.max_vio_batch.p95, 3);
    numRow(tr, "trend.first", run.trend.first, 3); numRow(tr, "trend.last", run.trend.last, 3);
    numRow(tr, "cost.excess_tokens", run.cost.excess_tokens, 1);
    if (run.cost.compute_s !== undefined) numRow(tr, "cost.compute_s", run.cost.compute_s, 4); else el("td", {}, tr, "-");
    if (run.cost.a2a_s !== undefined) numRow(tr, "cost.a2a_s", run.cost.a2a_s, 4); else el("td", {}, tr, "-");
    numRow(tr, "cost.step_time_s", run.cost.step_time_s, 3);
  });
}

// An SVG line chart of series [{name, xs, ys}] over steps.
function lineChart(parent, series, yLabel, id) {
  const W = 460, H = 170, L = 44, B = 22, T = 8, R = 8;
  const svg = el("svg:svg", {"viewBox": "0 0 " + W + " " + H, "width": W, "height": H, "id": id}, parent);
  let xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity;
  for (const s of series) s.xs.forEach((x, i) => {
    xmin = Math.min(xmin, x); xmax = Math.max(xmax, x);
    if (isFinite(s.ys[i])) { ymin = Math.min(ymin, s.ys[i]); ymax = Math.max(ymax, s.ys[i]); }
  });
  if (!isFinite(ymin)) { ymin = 0; ymax = 1; }
  ymin = Math.min(ymin, 1); if (ymax - ymin < 1e-9) ymax = ymin + 1;
  if (xmax === xmin) xmax = xmin + 1;
  const sx = x => L + (x - xmin) / (xmax - xmin) * (W - L - R), sy = y => H - B - (y - ymin) / (ymax - ymin) * (H - B - T);
  el("svg:line", {"x1": L, "y1": H - B, "x2": W - R, "y2": H - B, "stroke": "#9aa3b2"}, svg);
  el("svg:line", {"x1": L, "y1": T, "x2": L, "y2": H - B, "stroke": "#9aa3b2"}, svg);
  for (const y of [ymin, (ymin + ymax) / 2, ymax])
    el("svg:text", {"x": L - 4, "y": sy(y) + 4, "text-anchor": "end", "font-size": 10, "fill": "#5b6475"}, svg, fmt(y, 2));
  for (const x of [xmin, xmax])
    el("svg:text", {"x": sx(x), "y": H - 6, "text-anchor": "middle", "font-size": 10, "fill": "#5b6475"}, svg, String(Math.round(x)));
  el("svg:text", {"x": L + 4, "y": T + 10, "font-size": 10, "fill": "#5b6475"}, svg, yLabel);
  series.forEach((s, k) => {
    const pts = s.xs.map((x, i) => isFinite(s.ys[i]) ? sx(x).toFixed(1) + "," + sy(s.ys[i]).toFixed(1) : null).filter(p => p);
    el("svg:polyline", {"points": pts.join(" "), "fill": "none", "stroke": s.color || COLORS[k % COLORS.length],
                        "stroke-width": 1.5, "data-series": s.name}, svg);
  });
  if (series.length > 1) {
    const lg = el("div", {"class": "legend"}, parent);
    series.forEach((s, k) => { el("span", {"style": "background:" + (s.color || COLORS[k % COLORS.length])}, lg); lg.appendChild(document.createTextNode(s.name)); });
  }
  return svg;
}
function mids(s) { return s.first.map((f, i) => (f + s.last[i]) / 2); }

function drawComparison() {
  if (data.runs.length < 2) return;
  const div = document.getElementById("comparison");
  el("h2", {}, div, "Run comparison");
  const t = el("table", {"id": "comparison-table"}, div);
  const h = el("tr", {}, t);
  for (const c of ["run", "load balancing", "max_vio p50", "p95", "mean EP max/mean", "dropped", "aux loss (mean)", "lm loss (last)"])
    el("th", {"class": c === "run" ? "l" : ""}, h, c);
  data.runs.forEach((run, r) => {
    const tr = el("tr", {"data-run": r}, t);
    el("td", {"class": "l"}, tr, run.path);
    el("td", {"class": "l"}, tr, balancing(run));
    numRow(tr, "max_vio.p50", run.across_layers.max_vio.p50, 3);
    numRow(tr, "max_vio.p95", run.across_layers.max_vio.p95, 3);
    const ep = run.layers.reduce((s, L) => s + L.ep.max_over_mean, 0) / run.layers.length;
    numRow(tr, "ep.max_over_mean.mean", ep, 3);
    const dr = run.layers.reduce((s, L) => s + L.dropped_fraction, 0) / run.layers.length;
    numRow(tr, "dropped_fraction.mean", dr, 4);
    numRow(tr, "losses.aux_loss_mean", run.losses.aux_loss_mean, 4);
    numRow(tr, "losses.lm_loss_last", run.losses.lm_loss_last, 4);
  });
  // Mean over layers of max/mean per step bin, one line per run.
  const series = data.runs.map(run => {
    const s0 = run.layers[0].max_over_mean_series;
    const ys = s0.value.map((_, i) => run.layers.reduce((s, L) => s + (L.max_over_mean_series.value[i] || 0), 0) / run.layers.length);
    return {name: run.path, xs: mids(s0), ys: ys};
  });
  lineChart(div, series, "expert load max/mean (mean over layers)", "comparison-chart");
}

function drawPlacement() {
  if (!data.placement) return;
  const div = document.getElementById("placement");
  el("h2", {}, div, "Placement advice (EP " + data.placement.ep + ")");
  el("p", {}, div, "Balanced packing of each layer's kept tokens over steps " + data.runs[0].steps.first + "-" +
     data.runs[0].steps.last + ": the busiest EP rank's share, before and after.");
  const t = el("table", {"id": "placement-table"}, div);
  const h = el("tr", {}, t);
  for (const c of ["layer", "before max/mean", "after max/mean", "experts per rank (after)"]) el("th", {"class": c.startsWith("experts") ? "l" : ""}, h, c);
  for (const lp of data.placement.layers) {
    const tr = el("tr", {"data-layer": lp.layer}, t);
    el("td", {}, tr, String(lp.layer));
    numRow(tr, "before_max_over_mean", lp.before_max_over_mean, 3);
    numRow(tr, "after_max_over_mean", lp.after_max_over_mean, 3);
    el("td", {"class": "l"}, tr, lp.after.map(r => "[" + r.join(", ") + "]").join(" "));
  }
  if (data.placement_toml) el("pre", {"id": "placement-toml"}, div, data.placement_toml);
}

// Utilization 0 → white, 1 → pale, ≥ 3 → dark red (ideal load is 1).
function heatColor(u) {
  const t = Math.max(0, Math.min(1, u / 3));
  return [Math.round(255 - 120 * t), Math.round(255 - 235 * t), Math.round(255 - 225 * t)];
}
function drawHeat(panel, L, id) {
  const bins = L.heatmap.utilization.length, E = L.experts;
  const c = el("canvas", {"class": "heat", "id": id, "width": Math.max(1, bins), "height": Math.max(1, E),
                           "data-layer": L.layer, "data-bins": bins, "data-experts": E}, panel);
  const g = c.getContext("2d"), img = g.createImageData(Math.max(1, bins), Math.max(1, E));
  let mx = 0;
  L.heatmap.utilization.forEach((row, b) => row.forEach((u, e) => {
    mx = Math.max(mx, u);
    const [R, G, Bc] = heatColor(u), o = 4 * (e * bins + b);
    img.data[o] = R; img.data[o + 1] = G; img.data[o + 2] = Bc; img.data[o + 3] = 255;
  }));
  g.putImageData(img, 0, 0);
  c.dataset.maxUtilization = String(mx);
  el("div", {"class": "cap"}, panel, "expert (rows, 0 at top) × steps " + L.heatmap.first[0] + "-" +
     L.heatmap.last[bins - 1] + " (columns); colour = load / ideal, white 0, dark red ≥ 3; max " + fmt(mx, 2));
}
function drawBars(panel, L, id) {
  const q = L.ep.rank_tokens, W = 460, H = 120, B = 18;
  const svg = el("svg:svg", {"viewBox": "0 0 " + W + " " + H, "width": W, "height": H, "id": id}, panel);
  const mean = q.reduce((a, b) => a + b, 0) / q.length, mx = Math.max(...q, 1);
  const bw = (W - 20) / q.length;
  q.forEach((v, p) => {
    const h = (H - B - 6) * v / mx;
    el("svg:rect", {"x": 10 + p * bw + 1, "y": H - B - h, "width": Math.max(1, bw - 2), "height": h,
                    "fill": v === mx && q.length > 1 ? "#dc2626" : "#2563eb", "class": "ep-bar", "data-rank": p,
                    "data-value": String(v)}, svg);
    if (q.length <= 32) el("svg:text", {"x": 10 + (p + 0.5) * bw, "y": H - 4, "text-anchor": "middle", "font-size": 10}, svg, String(p));
  });
  const my = H - B - (H - B - 6) * mean / mx;
  el("svg:line", {"x1": 8, "x2": W - 8, "y1": my, "y2": my, "stroke": "#111", "stroke-dasharray": "4 3"}, svg);
  el("div", {"class": "cap"}, panel, "kept tokens per EP rank over the window (" + q.length +
     " ranks; dashed: mean; red: busiest) — max/mean " + fmt(L.ep.max_over_mean, 3));
}

function drawLayers() {
  const root = document.getElementById("layers");
  data.runs.forEach((run, r) => {
    el("h2", {}, root, "Layers" + (data.runs.length > 1 ? " — " + run.path : ""));
    for (const L of run.layers) {
      const box = el("div", {"class": "layer", "id": "layer-" + r + "-" + L.layer, "data-run": r, "data-layer": L.layer}, root);
      el("h3", {}, box, "Layer " + L.layer + " · " + L.experts + " experts");
      const left = el("div", {"class": "panel"}, box), right = el("div", {"class": "panel"}, box);
      const t = el("table", {"class": "stats"}, left);
      const rows = [["utilization min", "utilization_min", L.utilization_min, 3],
                    ["utilization max", "utilization_max", L.utilization_max, 3],
                    ["max_vio", "max_vio", L.max_vio, 3], ["CV", "cv", L.cv, 3],
                    ["batch max_vio (mean over steps)", "max_vio_batch", L.max_vio_batch, 3],
                    ["dropped fraction", "dropped_fraction", L.dropped_fraction, 4],
                    ["EP max/mean (" + L.ep.ranks + " ranks)", "ep.max_over_mean", L.ep.max_over_mean, 3],
                    ["EP max/mean per step (mean)", "ep.step_max_over_mean", L.ep.step_max_over_mean, 3],
                    ["trend first window", "trend.first", L.trend.first, 3],
                    ["trend last window", "trend.last", L.trend.last, 3]];
      if (L.what_if_ep) rows.push(["what-if EP " + L.what_if_ep.ranks + " max/mean", "what_if_ep.max_over_mean", L.what_if_ep.max_over_mean, 3]);
      for (const [name, key, v, d] of rows) { const tr = el("tr", {}, t); el("th", {"class": "l"}, tr, name); numRow(tr, key, v, d); }
      const tr = el("tr", {}, t);
      el("th", {"class": "l"}, tr, "hottest (share of tokens)");
      el("td", {"data-key": "hottest", "data-value": JSON.stringify(L.hottest)}, tr,
         L.hottest.map(h => "#" + h.expert + " " + fmt(100 * h.share, 1) + "%").join(", "));
      const td = el("tr", {}, t);
      el("th", {"class": "l"}, td, "dead experts");
      el("td", {"data-key": "dead_experts", "data-value": JSON.stringify(L.dead_experts)}, td,
         L.dead_experts.length ? L.dead_experts.join(", ") : "none");
      drawBars(left, L, "bars-" + r + "-" + L.layer);
      drawHeat(right, L, "heat-" + r + "-" + L.layer);
      lineChart(right, [{name: "expert max/mean", xs: mids(L.max_over_mean_series), ys: L.max_over_mean_series.value},
                        {name: "EP rank max/mean", xs: mids(L.ep_max_over_mean_series), ys: L.ep_max_over_mean_series.value}],
                "max/mean over steps", "lines-" + r + "-" + L.layer);
      lineChart(right, [{name: "dropped", xs: mids(L.dropped_series), ys: L.dropped_series.value, color: "#d97706"}],
                "dropped fraction", "dropped-" + r + "-" + L.layer);
    }
  });
}

document.getElementById("subtitle").textContent = data.runs.map(r => r.path + ": steps " + r.steps.first + "-" +
  r.steps.last + ", " + r.layers.length + " MoE layers, top-" + r.top_k).join(" · ");
drawAlerts(); drawSummary(); drawComparison(); drawPlacement(); drawLayers();
document.body.dataset.rendered = "ok";
</script>
</body></html>
)HTML";

}  // namespace

std::string html_report(const std::vector<RunReport>& runs, const std::vector<LayerPlacement>* plan, int64_t ranks) {
  nlohmann::ordered_json data = {{"runs", nlohmann::ordered_json::array()}};
  for (const RunReport& r : runs) data["runs"].push_back(to_json(r, /*with_series=*/true));
  if (plan && !runs.empty()) {
    data["placement"] = to_json(*plan, ranks);
    data["placement_toml"] = placement_toml(runs.front(), *plan, ranks);
  }
  // Inside <script>, "</" could end the element early; "<\/" is the same JSON string.
  std::string json = data.dump();
  for (size_t at = 0; (at = json.find("</", at)) != std::string::npos; at += 3) json.replace(at, 2, "<\\/");
  return std::string(kHead) + json + kTail;
}

}  // namespace origami::imbalance
