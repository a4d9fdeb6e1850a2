#!/usr/bin/env python3
"""PyTorch eager twin of `origami train` for the GPU check's tokens/s ratio.

Builds the model an Origami config describes (ARCHITECTURE.md §4: pre-norm
decoder, RMSNorm, GQA attention with rotate-half RoPE, SwiGLU MLPs, MoE
layers with a softmax or sigmoid top-k router, optional shared expert,
untied LM head, no biases) the way an eager PyTorch user writes it — nn.Linear
weights, F.scaled_dot_product_attention(is_causal=True), experts applied by
sorting the routed token slots by expert and running each expert's SwiGLU on
its rows, torch.optim.AdamW (fused where this torch has it) — and trains it
on random token windows of the config's shape, timing each step between
CUDA synchronizations. Same FLOP budget per token as origami (dropless
routing; no auxiliary loss: its cost is negligible either way; the expert
bias of aux-loss-free balancing starts at zero and is left out).

--fit: when the model runs out of GPU memory, try again with one layer
fewer, down to one; the result names the layer count that ran ("layers")
and the ones that did not ("oom_layers"), so a caller can time origami at
that count for a like-for-like ratio. --layers N sets the count outright.
--device cpu trains on the CPU (and torch 1.x, whose missing
scaled_dot_product_attention is replaced by the same causal softmax
written out): the test suite's check that the twin runs. --device meta
builds the model without memory and reports its parameter count only.

Precision: fp32 (the default) or bf16 (fp32 parameters and moments, bf16
autocast), the GPU check's choice beside origami's bf16 recipe.

Output: one JSON object {config, precision, steps, tokens_per_step,
step_s (median of the timed steps), tokens_per_s, peak_memory_bytes,
alloc_retries (the caching allocator's, a sign of memory pressure), params,
layers, final_loss}; or {"skipped": why} without CUDA or torch
(exit 0), or {"error": ...} with exit 1 when the model does not fit (CUDA
out of memory, however the library reports it) or anything else fails, so
a caller always has a result to read.

Usage: python3 tools/train_torch.py CONFIG.toml [--steps N] [--warmup N]
           [--global-batch N] [--precision fp32|bf16] [--layers N] [--fit]
           [--device cuda|cpu|meta] [--json PATH]
"""
import argparse
import gc
import json
import math
import statistics
import sys
import time


def read_toml(path):
    """The config's sections as dicts: tomllib where Python has it, else the
    flat key = value subset origami's shipped configs use."""
    try:
        import tomllib
        with open(path, "rb") as f:
            return tomllib.load(f)
    except ImportError:
        pass
    doc = {}
    section = doc
    with open(path) as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("[") and line.endswith("]"):
                section = doc.setdefault(line[1:-1].strip(), {})
                continue
            key, _, value = line.partition("=")
            value = value.strip()
            if value.startswith('"'):
                v = value.strip('"')
            elif value in ("true", "false"):
                v = value == "true"
            else:
                try:
                    v = int(value)
                except ValueError:
                    try:
                        v = float(value)
                    except ValueError:
                        v = value
            section[key.strip()] = v
    return doc


def shape_of(doc):
    """The model and batch a config describes; a key it leaves out takes
    origami's default (engine/config.h, kernels/moe_ops.h)."""
    m, e, t = doc.get("model", {}), doc.get("moe", {}), doc.get("training", {})
    d = dict(V=m.get("vocab_size", 257), D=m.get("hidden_size", 128), L=m.get("num_layers", 2),
             Hq=m.get("num_heads", 4), Hkv=m.get("num_kv_heads", 4), F=m.get("ffn_hidden_size", 384),
             theta=float(m.get("rope_theta", 10000.0)), eps=float(m.get("norm_eps", 1e-5)),
             E=e.get("num_experts", 0), K=e.get("top_k", 2), first_dense=e.get("first_dense_layers", 0),
             freq=e.get("layer_freq", 1), Fs=e.get("shared_expert_hidden_size", 0),
             score=e.get("score_function", "softmax"), normalize=e.get("normalize_topk", False),
             scaling=float(e.get("topk_scaling", 1.0)), S=t.get("seq_len", 64), B=t.get("global_batch", 8),
             mb=t.get("micro_batch", 8))
    d["Fe"] = e.get("ffn_hidden_size", 0) or d["F"]
    return d


def causal_attention(torch, q, k, v):
    """softmax(q·kᵀ/√d + causal mask)·v: what scaled_dot_product_attention
    computes, for a torch without it (1.x)."""
    S = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def build(torch, s, device):
    """The model, its parameters made on `device` (initialized there: no
    host copy of a GPU-sized model; on meta nothing is allocated)."""
    nn, F = torch.nn, torch.nn.functional
    hd = s["D"] // s["Hq"]
    on = dict(device=device)
    sdpa = getattr(F, "scaled_dot_product_attention", None)

    def linear(i, o):
        return nn.Linear(i, o, bias=False, **on)

    class RMSNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n, **on))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + s["eps"])).to(x.dtype) * self.weight

    def swiglu(d, f):
        return nn.ModuleDict(dict(gate=linear(d, f), up=linear(d, f), down=linear(f, d)))

    def run_swiglu(m, x):
        return m["down"](F.silu(m["gate"](x)) * m["up"](x))

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = linear(s["D"], s["Hq"] * hd)
            self.k = linear(s["D"], s["Hkv"] * hd)
            self.v = linear(s["D"], s["Hkv"] * hd)
            self.o = linear(s["Hq"] * hd, s["D"])

        def forward(self, x, cos, sin):
            B, S, _ = x.shape
            q = self.q(x).view(B, S, s["Hq"], hd).transpose(1, 2)
            k = self.k(x).view(B, S, s["Hkv"], hd).transpose(1, 2)
            v = self.v(x).view(B, S, s["Hkv"], hd).transpose(1, 2)

            # In q's dtype (bf16 under autocast), as Hugging Face's Llama
            # does: fp32 tables would promote q and k to fp32 and the GQA
            # copies with them, a slowdown of the twin's own making.
            c, sn = cos.to(q.dtype), sin.to(q.dtype)

            def rope(t):
                a, b = t[..., : hd // 2], t[..., hd // 2:]
                return t * c + torch.cat((-b, a), dim=-1) * sn

            q, k = rope(q), rope(k)
            rep = s["Hq"] // s["Hkv"]
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = sdpa(q, k, v, is_causal=True) if sdpa else causal_attention(torch, q, k, v)
            return self.o(o.transpose(1, 2).reshape(B, S, s["Hq"] * hd))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = linear(s["D"], s["E"])
            self.experts = nn.ModuleList(swiglu(s["D"], s["Fe"]) for _ in range(s["E"]))
            self.shared = swiglu(s["D"], s["Fs"]) if s["Fs"] else None

        def forward(self, x):
            B, S, D = x.shape
            xt = x.reshape(-1, D)
            logits = self.gate(xt).float()
            scores = logits.softmax(-1) if s["score"] == "softmax" else logits.sigmoid()
            w, idx = scores.topk(s["K"], dim=-1)
            if s["normalize"]:
                w = w / w.sum(-1, keepdim=True)
            w = (w * s["scaling"]).to(x.dtype)
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)
            token = order // s["K"]
            counts = torch.bincount(flat, minlength=s["E"]).tolist()  # the host sync every eager MoE has
            rows = xt[token]
            # Split, then concatenate (Megatron's SequentialMLP): writing each
            # expert's rows into slices of one buffer would make backward copy
            # that whole buffer's gradient once per expert.
            out_rows = torch.cat([run_swiglu(self.experts[e], chunk)
                                  for e, chunk in enumerate(rows.split(counts)) if chunk.shape[0]])
            out_rows = out_rows * w.reshape(-1)[order].unsqueeze(-1)
            y = torch.zeros_like(xt).index_add_(0, token, out_rows)
            if self.shared is not None:
                y = y + run_swiglu(self.shared, xt)
            return y.view(B, S, D)

    class Block(nn.Module):
        def __init__(self, l):
            super().__init__()
            self.attn_norm, self.attn = RMSNorm(s["D"]), Attention()
            self.mlp_norm = RMSNorm(s["D"])
            is_moe = s["E"] > 0 and l >= s["first_dense"] and (l - s["first_dense"]) % s["freq"] == 0
            self.moe = MoE() if is_moe else None
            self.mlp = None if is_moe else swiglu(s["D"], s["F"])

        def forward(self, h, cos, sin):
            h = h + self.attn(self.attn_norm(h), cos, sin)
            m = self.mlp_norm(h)
            return h + (self.moe(m) if self.moe is not None else run_swiglu(self.mlp, m))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(s["V"], s["D"], **on)
            self.layers = nn.ModuleList(Block(l) for l in range(s["L"]))
            self.norm = RMSNorm(s["D"])
            self.head = linear(s["D"], s["V"])
            inv = s["theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
            ang = torch.arange(s["S"], dtype=torch.float64)[:, None] * inv[None, :]
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos().float().to(device), persistent=False)
            self.register_buffer("sin", ang.sin().float().to(device), persistent=False)

        def forward(self, ids, targets):
            h = self.embed(ids)
            cos, sin = self.cos.to(h.dtype), self.sin.to(h.dtype)
            for layer in self.layers:
                h = layer(h, cos, sin)
            logits = self.head(self.norm(h)).float()
            return F.cross_entropy(logits.view(-1, s["V"]), targets.reshape(-1))  # a strided slice of the windows

    return Model()


def train(torch, s, dev, a):
    """Builds the model on dev and times a.steps steps after a.warmup; the
    result's fields (see the module doc)."""
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = build(torch, s, dev)
    out = {"params": sum(p.numel() for p in model.parameters()), "layers": s["L"]}
    opt = None
    if cuda:
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        except (TypeError, RuntimeError):
            pass
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    micro = min(s["mb"], s["B"])  # --global-batch below the config's micro-batch: one micro-batch of it
    accum = max(1, s["B"] // micro)
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(a.warmup + a.steps):
        if cuda and step == a.warmup:  # alloc_retries: the timed steps' alone
            torch.cuda.reset_accumulated_memory_stats(dev)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            tok = torch.randint(0, s["V"], (micro, s["S"] + 1), device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
                loss = model(tok[:, :-1], tok[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    out.update(step_s=step_s, tokens_per_s=s["B"] * s["S"] / step_s,
               peak_memory_bytes=torch.cuda.max_memory_allocated(dev) if cuda else 0,
               alloc_retries=torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) if cuda else 0,
               final_loss=float(loss) * accum)
    return out


def is_out_of_memory(torch, e):
    """Out of device memory, as PyTorch's allocator says it
    (torch.cuda.OutOfMemoryError) or as a library reports it from inside a
    kernel call (a RuntimeError: cuBLAS's workspace, a CUDA launch)."""
    if isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())):  # torch >= 1.13
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text for m in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=0, help="samples per step (default: the config's)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the config's)")
    ap.add_argument("--fit", action="store_true", help="on CUDA out of memory, retry with one layer fewer")
    ap.add_argument("--device", choices=("cuda", "cpu", "meta"), default="cuda")
    ap.add_argument("--json", help="write the result object here too")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0 or a.global_batch < 0 or a.layers < 0:
        ap.error("--steps must be >= 1; --warmup, --global-batch and --layers >= 0")

    def emit(obj, status=0):
        text = json.dumps(obj)
        print(text)
        if a.json:
            with open(a.json, "w") as f:
                f.write(text + "\n")
        sys.exit(status)

    try:
        import torch
    except ImportError:
        emit({"config": a.config, "skipped": "no torch"})
    s = shape_of(read_toml(a.config))
    if a.global_batch:
        s["B"] = a.global_batch
    if a.layers:
        s["L"] = a.layers
    result = {"config": a.config, "torch": torch.__version__}
    if a.device == "meta":  # the parameter count alone
        model = build(torch, s, torch.device("meta"))
        result.update(params=sum(p.numel() for p in model.parameters()), layers=s["L"])
        emit(result)
    if a.device == "cuda" and not torch.cuda.is_available():
        emit({"config": a.config, "skipped": "no CUDA device"})
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    result.update(precision=a.precision, steps=a.steps, tokens_per_step=s["B"] * s["S"])
    oom_layers = []
    while True:
        oom = None
        try:
            result.update(train(torch, s, dev, a))
        except Exception as e:  # noqa: BLE001 — every failure becomes the JSON result
            first = str(e).split("\n")[0]
            if not is_out_of_memory(torch, e):
                result["error"] = f"{type(e).__name__}: {first}"[:500]
                emit(result, 1)
            oom = "CUDA out of memory: " + first
        if oom is None:
            break
        # Outside the handler: the traceback (and with it the model and the
        # optimizer state) is gone, so the memory can go back.
        gc.collect()
        torch.cuda.empty_cache()
        oom_layers.append(s["L"])
        result["oom_layers"] = oom_layers
        if not a.fit or s["L"] <= 1:
            result["error"] = oom
            emit(result, 1)
        s["L"] -= 1
    if not math.isfinite(result["final_loss"]):
        result["error"] = "non-finite loss"
        emit(result, 1)
    emit(result)


if __name__ == "__main__":
    main()
