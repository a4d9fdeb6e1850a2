#!/usr/bin/env python3
"""PyTorch twin of `origami bench kernels`: the same shapes in bf16 on CUDA.

Measures what PyTorch offers for the ops whose targets say "at least
PyTorch's speed", under the same keys as `origami bench kernels --json` so
tools/gpu_check.sh can put the two side by side:
  attention_forward   F.scaled_dot_product_attention(is_causal=True), GQA by
                      enable_gqa=True where this torch has it, else K/V
                      repeat_interleave'd to the q heads inside the timed call
                      (the "gqa" field says which);
  attention_backward  forward+backward minus forward (medians of each);
  grouped_gemm/gate_up.fwd  the experts' gate (or up) projection, 64 experts x
                      512 rows x 4096 -> 1536: torch.bmm over [64, 512, 4096] x
                      [64, 4096, 1536], and torch._grouped_mm over the stacked
                      rows with offsets where this torch has it (one entry per
                      impl);
  gemm/q.fwd          a 4096x4096x4096 model GEMM (x @ W.T, nn.Linear's shape);
beside a compute ceiling measured the same way: an 8192^3 bf16 torch.matmul.
Work per call as in bench kernels: GEMM 2MNK, causal attention forward
2*2*B*H*S^2*d/2, backward 2.5x forward.

Timing: warm-up, then samples of R calls between CUDA events (R makes a sample
last >= 10 ms), the median over samples.

Without CUDA (or without torch) it prints that it needs a GPU and exits 0, so
the check script runs everywhere; with --json it still writes an object with
"skipped" and no ops.

Usage: python3 tools/bench_kernels_torch.py [--shapes model|tiny]
           [--samples N] [--json PATH]
"""
import argparse
import json
import math
import statistics
import sys
import time

SHAPES = {
    # batch, seq, hidden, q heads, kv heads, head dim, experts, top-k, expert ffn, ceiling edge
    "model": dict(B=1, S=4096, D=4096, Hq=32, Hkv=8, hd=128, E=64, K=8, Fe=1536, ceiling_n=8192),
    "tiny": dict(B=1, S=256, D=256, Hq=4, Hkv=2, hd=64, E=8, K=2, Fe=128, ceiling_n=1024),
}
MIN_SAMPLE_S = 10e-3
MAX_REPEATS = 1000


def dims(*d):
    return "x".join(str(x) for x in d)


class Timer:
    def __init__(self, torch, samples, warmup):
        self.torch, self.samples, self.warmup = torch, samples, warmup

    def seconds_per_call(self, fn):
        """Median seconds per call of fn: warm-up, a probe call sizing R, samples of R calls."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        probe = start.elapsed_time(end) / 1e3
        repeats = int(min(MAX_REPEATS, max(1, math.ceil(MIN_SAMPLE_S / max(probe, 1e-9)))))
        samples = []
        for _ in range(self.samples):
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / repeats)
        return statistics.median_high(samples), repeats  # the upper middle, as tools' median()


def entry(key, op, impl, shape, seconds, repeats, flops, ceiling_tflops, **extra):
    tflops = flops / seconds / 1e12
    e = dict(key=key, op=op, impl=impl, shape=shape, dtype="bf16", ms=seconds * 1e3, repeats=repeats,
             flops=flops, tflops=tflops, fraction_of_ceiling=tflops / ceiling_tflops)
    e.update(extra)
    return e


def bench_attention(torch, timer, s, ceiling, out):
    F = torch.nn.functional
    B, S, Hq, Hkv, hd = s["B"], s["S"], s["Hq"], s["Hkv"], s["hd"]
    shape = f"B{B} S{S} H{Hq}/{Hkv} d{hd} causal"
    fwd_flops = 2.0 * 2.0 * B * Hq * S * S * hd / 2.0
    opts = dict(device="cuda", dtype=torch.bfloat16)
    # SDPA's layout is [B, H, S, d] (bench kernels' tensors are [B, S, H, d]: same work).
    q = torch.randn(B, Hq, S, hd, **opts, requires_grad=True)
    k = torch.randn(B, Hkv, S, hd, **opts, requires_grad=True)
    v = torch.randn(B, Hkv, S, hd, **opts, requires_grad=True)
    dout = torch.randn(B, Hq, S, hd, **opts)
    try:
        F.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=True, enable_gqa=True)
        gqa = "enable_gqa"

        def attend():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except (TypeError, RuntimeError):
        gqa = "repeat_interleave"

        def attend():
            g = Hq // Hkv
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                                  is_causal=True)

    def forward():  # the training forward (it keeps what backward needs), as bench kernels' writes lse
        attend()

    def forward_backward():
        q.grad = k.grad = v.grad = None
        attend().backward(dout)

    t_fwd, r_fwd = timer.seconds_per_call(forward)
    t_all, r_all = timer.seconds_per_call(forward_backward)
    t_bwd = max(t_all - t_fwd, 1e-12)
    out.append(entry("attention_forward", "attention_forward", "sdpa", shape, t_fwd, r_fwd, fwd_flops, ceiling,
                     gqa=gqa))
    out.append(entry("attention_backward", "attention_backward", "sdpa", shape, t_bwd, r_all, 2.5 * fwd_flops, ceiling,
                     gqa=gqa, forward_backward_ms=t_all * 1e3))


def bench_grouped(torch, timer, s, ceiling, out, notes):
    E, D, F = s["E"], s["D"], s["Fe"]
    rows = s["B"] * s["S"] * s["K"] // E
    shape = f"{E}x({dims(rows, F, D)})"
    flops = 2.0 * E * rows * F * D
    opts = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(E, rows, D, **opts)
    w = torch.randn(E, D, F, **opts)
    t, r = timer.seconds_per_call(lambda: torch.bmm(x, w))
    out.append(entry("grouped_gemm/gate_up.fwd", "grouped_gemm", "bmm", shape, t, r, flops, ceiling))
    if not hasattr(torch, "_grouped_mm"):
        notes.append("torch._grouped_mm: not in this torch")
        return
    # The experts' layout: rows stacked [N, D], W1 [E, F, D] (bench kernels'
    # trans_w = yes), so mat_b = W1ᵀ per expert, [E, D, F] with D contiguous,
    # which is the layout _grouped_mm wants for its second operand.
    x2 = x.reshape(E * rows, D)
    w1 = torch.randn(E, F, D, **opts).transpose(-2, -1)
    offs = torch.arange(rows, E * rows + 1, rows, device="cuda", dtype=torch.int32)
    try:
        torch._grouped_mm(x2, w1, offs=offs)
        torch.cuda.synchronize()
    except Exception as e:  # unsupported device, dtype or layout: say why, keep the rest
        notes.append(f"torch._grouped_mm: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return
    t, r = timer.seconds_per_call(lambda: torch._grouped_mm(x2, w1, offs=offs))
    out.append(entry("grouped_gemm/gate_up.fwd", "grouped_gemm", "_grouped_mm", shape, t, r, flops, ceiling))


def bench_gemm(torch, timer, s, ceiling, out):
    T, D, N = s["B"] * s["S"], s["D"], s["Hq"] * s["hd"]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    x, w = torch.randn(T, D, **opts), torch.randn(N, D, **opts)
    t, r = timer.seconds_per_call(lambda: torch.matmul(x, w.t()))
    out.append(entry("gemm/q.fwd", "gemm", "matmul", dims(T, N, D), t, r, 2.0 * T * N * D, ceiling))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="model")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", metavar="PATH", help="write the results as one JSON object")
    a = ap.parse_args()
    if a.samples < 1 or a.warmup < 0:
        ap.error("--samples must be >= 1 and --warmup >= 0")

    def write(obj):
        if a.json:
            with open(a.json, "w") as f:
                json.dump(obj, f, indent=1)
                f.write("\n")

    try:
        import torch
    except ImportError:
        print("bench_kernels_torch: needs PyTorch with a CUDA GPU (torch is not installed); nothing measured")
        write(dict(bench="kernels_torch", skipped="torch is not installed", ops=[]))
        return 0
    if not torch.cuda.is_available():
        print(f"bench_kernels_torch: needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is "
              "False); nothing measured")
        write(dict(bench="kernels_torch", torch=torch.__version__, skipped="no CUDA device", ops=[]))
        return 0

    s = SHAPES[a.shapes]
    torch.manual_seed(0)
    timer = Timer(torch, a.samples, a.warmup)
    n = s["ceiling_n"]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    ca, cb = torch.randn(n, n, **opts), torch.randn(n, n, **opts)
    # The GPU's clocks ramp up under load: a quarter second of the ceiling's
    # GEMM first, as origami's bench does, so neither ceiling is timed cold.
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.25:
        torch.matmul(ca, cb)
        torch.cuda.synchronize()
    t_ceil, _ = timer.seconds_per_call(lambda: torch.matmul(ca, cb))
    ceiling = 2.0 * n ** 3 / t_ceil / 1e12
    del ca, cb

    ops, notes = [], []
    bench_gemm(torch, timer, s, ceiling, ops)
    bench_grouped(torch, timer, s, ceiling, ops, notes)
    bench_attention(torch, timer, s, ceiling, ops)

    name = torch.cuda.get_device_name(0)
    result = dict(bench="kernels_torch", torch=torch.__version__, device="cuda:0", device_name=name, shapes=a.shapes,
                  dtype="bf16", samples=a.samples,
                  ceilings=dict(gemm_shape=dims(n, n, n), gemm_dtype="bf16", gemm_ms=t_ceil * 1e3,
                                gemm_tflops=ceiling),
                  ops=ops, notes=notes)
    write(result)
    print(f"bench_kernels_torch: {name}, torch {torch.__version__}, {a.shapes} shapes, bf16, "
          f"median of {a.samples} samples")
    print(f"  compute ceiling  matmul {dims(n, n, n)} bf16: {t_ceil * 1e3:.3f} ms, {ceiling:.2f} TFLOP/s")
    print(f"  {'key':<27} {'impl':<12} {'shape':<27} {'ms':>10} {'TFLOP/s':>9} {'%ceil':>7}")
    for e in ops:
        print(f"  {e['key']:<27} {e['impl']:<12} {e['shape']:<27} {e['ms']:10.4f} {e['tflops']:9.2f} "
              f"{100 * e['fraction_of_ceiling']:6.1f}%" + (f"  gqa: {e['gqa']}" if "gqa" in e else ""))
    for note in notes:
        print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
