#!/usr/bin/env python3
"""Independent computation of `origami imbalance --json` statistics with numpy.

Reads a metrics.jsonl with the json module (not the engine's reader) and
computes each layer's statistics from their definitions (engine/imbalance.h),
written here from the definitions rather than from the C++ code:

    imbalance_reference.py METRICS.jsonl [--steps A:B] [--ep N] [--window W]

Prints {"layers": [...], "across_layers": ..., "trend": ...} with the same keys
as the --json output, for tests/test_cli_imbalance.cpp to compare to 1e-9.
"""
import argparse
import json

import numpy as np


def balance(q):
    """q: [steps, ranks] loads. Window max/mean, mean per-step max/mean, mean excess."""
    tot = q.sum(axis=0).astype(np.float64)
    out = {"ranks": int(q.shape[1]), "rank_tokens": [int(v) for v in q.sum(axis=0)]}
    out["max_over_mean"] = float(tot.max() / tot.mean()) if tot.sum() > 0 else 0.0
    sums = q.sum(axis=1)
    ok = sums > 0
    per = q[ok].astype(np.float64)
    means = per.mean(axis=1)
    out["step_max_over_mean"] = float(np.mean(per.max(axis=1) / means)) if ok.any() else 0.0
    out["excess_tokens"] = float(np.mean(per.max(axis=1) - means)) if ok.any() else 0.0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--steps", default="")
    ap.add_argument("--ep", type=int, default=0)
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=0)
    a = ap.parse_args()
    lo, hi = -1, 1 << 62
    if a.steps:
        x, y = a.steps.split(":")
        lo = int(x) if x else lo
        hi = int(y) if y else hi

    recs = []
    with open(a.metrics) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if lo <= r["step"] <= hi and r.get("moe"):
                    recs.append(r)
    n = len(recs)
    num_layers = len(recs[0]["moe"])
    top_k = a.top_k or round(sum(recs[0]["moe"][0]["tokens_per_expert"]) / recs[0]["tokens"])
    window = min(a.window, n) if a.window > 0 else max(1, n // 10)
    layers = []
    for li in range(num_layers):
        r = np.array([rec["moe"][li]["tokens_per_expert"] for rec in recs], dtype=np.int64)  # [n, E]
        k = np.array([rec["moe"][li]["kept_per_expert"] for rec in recs], dtype=np.int64)
        q = np.array([rec["moe"][li]["tokens_per_ep_rank"] for rec in recs], dtype=np.int64)
        E = r.shape[1]
        load = r.sum(axis=0).astype(np.float64)
        mean = load.mean()
        step_mean = r.mean(axis=1)
        vio = (r.max(axis=1) - step_mean) / step_mean  # no empty steps in the tests' files
        order = sorted(range(E), key=lambda e: (-load[e], e))[:3]
        L = {
            "layer": recs[0]["moe"][li]["layer"],
            "experts": E,
            "utilization_min": float(load.min() / mean),
            "utilization_max": float(load.max() / mean),
            "max_vio": float((load.max() - mean) / mean),
            "cv": float(load.std() / mean),
            "max_vio_batch": float(vio.mean()),
            "dead_experts": [e for e in range(E) if load[e] == 0],
            "hottest": [{"expert": e, "share": float(load[e] * top_k / load.sum())} for e in order],
            "dropped_fraction": float(1.0 - k.sum() / r.sum()),
            "ep": balance(q),
            "trend": {"first": float(vio[:window].mean()), "last": float(vio[n - window:].mean())},
        }
        if a.ep:
            per = E // a.ep
            w = np.stack([k[:, p * per:(p + 1) * per].sum(axis=1) for p in range(a.ep)], axis=1)
            L["what_if_ep"] = balance(w)
        layers.append(L)
    vios = np.array([L["max_vio"] for L in layers])
    batch = np.array([L["max_vio_batch"] for L in layers])
    out = {
        "steps": {"first": recs[0]["step"], "last": recs[-1]["step"], "count": n},
        "layers": layers,
        "across_layers": {
            "max_vio": {f"p{p}": float(np.percentile(vios, p)) for p in (50, 90, 95)},
            "max_vio_batch": {f"p{p}": float(np.percentile(batch, p)) for p in (50, 90, 95)},
        },
        "trend": {
            "window": window,
            "first": float(np.mean([L["trend"]["first"] for L in layers])),
            "last": float(np.mean([L["trend"]["last"] for L in layers])),
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
