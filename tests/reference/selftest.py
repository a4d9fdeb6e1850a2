#!/usr/bin/python3
"""Self-test of tests/reference/reference.py, independent of Origami.

Writes .idx/.bin and safetensors files with plain numpy, checks the parsers
read them back, checks the vectorized torch model (dense and MoE: softmax /
sigmoid routing, top-k renormalization and scaling, group-limited routing,
expert bias, shared expert, dense/MoE layer interleaving) against a naive
per-token numpy loop, checks the LR schedule, and checks that malformed inputs
exit 2.
Prints "N passed, 0 failed" and exits 0 when everything holds.

Run: /usr/bin/python3 tests/reference/selftest.py
"""
import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference as ref  # noqa: E402

PASSED = []


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def write_idx(prefix, seqs, dtype_code=8, np_dtype=np.uint16, docs=None):
    sizes = np.array([len(s) for s in seqs], dtype="<i4")
    itemsize = np.dtype(np_dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<i8") * itemsize
    if docs is None:
        docs = np.arange(len(seqs) + 1, dtype="<i8")
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=np.dtype(np_dtype).newbyteorder("<")).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<QQ", len(seqs), len(docs)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(docs, dtype="<i8").tobytes())


def write_safetensors(path, tensors, dtype="F32"):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        if dtype == "BF16":
            b = (np.asarray(arr, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            b = np.asarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def random_model(rng, V=37, D=16, F=24, L=2, nh=4, nkv=2, theta=10000.0, eps=1e-5):
    hd = D // nh
    cfg = {"vocab_size": V, "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "rms_norm_eps": eps, "rope_theta": theta, "tie_word_embeddings": False}
    w = {"model.embed_tokens.weight": rng.normal(0, 1, (V, D)),
         "model.norm.weight": 1 + 0.1 * rng.normal(size=D),
         "lm_head.weight": rng.normal(0, 0.3, (V, D))}
    for l in range(L):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=D)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=D)
        w[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.4, (nh * hd, D))
        w[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.4, (nkv * hd, D))
        w[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.3, (nkv * hd, D))
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.3, (D, nh * hd))
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.3, (F, D))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, 0.3, (F, D))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, 0.3, (D, F))
    w = {k: v.astype(np.float32).astype(np.float64) for k, v in w.items()}
    return cfg, w


MOE_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
                "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                "shared_expert_intermediate_size": 0}


def random_moe_model(rng, L=3, bias=False, router_std=1.0, **moe):
    """A Mixtral-named model whose MoE fields are MOE_DEFAULTS updated by `moe`."""
    cfg, w = random_model(rng, L=L)
    m = dict(MOE_DEFAULTS, **moe)
    cfg.update(m)
    cfg.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "router_aux_loss_coef": 0.0,
                "expert_bias": bias})
    D, E, Fe, Fs = cfg["hidden_size"], m["num_local_experts"], m["moe_intermediate_size"], \
        m["shared_expert_intermediate_size"]
    for l in range(L):
        if not (l >= m["first_k_dense_replace"] and (l - m["first_k_dense_replace"]) % m["moe_layer_freq"] == 0):
            continue
        p = f"model.layers.{l}."
        for k in ("gate_proj", "up_proj", "down_proj"):
            del w[p + f"mlp.{k}.weight"]
        b = p + "block_sparse_moe."
        w[b + "gate.weight"] = rng.normal(0, router_std, (E, D))
        for e in range(E):
            w[b + f"experts.{e}.w1.weight"] = rng.normal(0, 0.3, (Fe, D))
            w[b + f"experts.{e}.w3.weight"] = rng.normal(0, 0.3, (Fe, D))
            w[b + f"experts.{e}.w2.weight"] = rng.normal(0, 0.3, (D, Fe))
        if Fs:
            w[b + "shared_expert.gate_proj.weight"] = rng.normal(0, 0.3, (Fs, D))
            w[b + "shared_expert.up_proj.weight"] = rng.normal(0, 0.3, (Fs, D))
            w[b + "shared_expert.down_proj.weight"] = rng.normal(0, 0.3, (D, Fs))
        if bias:
            w[b + "expert_bias"] = rng.normal(0, 0.2, E)
    w = {k: np.asarray(v).astype(np.float32).astype(np.float64) for k, v in w.items()}
    return cfg, w


def naive_is_moe(cfg, l):
    if cfg.get("model_type") != "mixtral":
        return False
    f = cfg["first_k_dense_replace"]
    return l >= f and (l - f) % cfg["moe_layer_freq"] == 0


def naive_swiglu(x, wg, wu, wd):
    g = wg @ x
    return wd @ (g / (1 + np.exp(-g)) * (wu @ x))


def naive_route(cfg, z, bias):
    """One token: returns [(expert, weight)], written from the spec with plain Python sorting."""
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    G, TG = cfg["n_group"], cfg["topk_group"]
    if cfg["scoring_func"] == "softmax":
        ez = [math.exp(v - max(z)) for v in z]
        s = [v / sum(ez) for v in ez]
    else:
        s = [1 / (1 + math.exp(-v)) for v in z]
    sel = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(E)]
    eligible = list(range(E))
    if G > 1:
        n = E // G
        gscore = [sum(sorted(sel[g * n:(g + 1) * n], reverse=True)[:k // TG]) for g in range(G)]
        kept = sorted(range(G), key=lambda g: (-gscore[g], g))[:TG]
        eligible = [e for e in range(E) if e // n in kept]
    chosen = sorted(eligible, key=lambda e: (-sel[e], e))[:k]
    p = [s[e] for e in chosen]
    if cfg["norm_topk_prob"]:
        tot = sum(p)
        p = [v / (tot + 1e-20) for v in p]
    return [(e, v * cfg["routed_scaling_factor"]) for e, v in zip(chosen, p)]


def naive_mlp(cfg, w, l, m):
    p = f"model.layers.{l}."
    if not naive_is_moe(cfg, l):
        return naive_swiglu(m, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    b = p + "block_sparse_moe."
    out = np.zeros_like(m)
    for e, pe in naive_route(cfg, w[b + "gate.weight"] @ m, w.get(b + "expert_bias")):
        out += pe * naive_swiglu(m, w[b + f"experts.{e}.w1.weight"], w[b + f"experts.{e}.w3.weight"],
                                 w[b + f"experts.{e}.w2.weight"])
    if cfg.get("shared_expert_intermediate_size", 0):
        out += naive_swiglu(m, w[b + "shared_expert.gate_proj.weight"], w[b + "shared_expert.up_proj.weight"],
                            w[b + "shared_expert.down_proj.weight"])
    return out


def save_model(d, cfg, w, dtype="F32"):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(os.path.join(d, "model.safetensors"), w, dtype)


def naive_loss(cfg, w, tokens):
    """Per-token loops in numpy; rotate-half RoPE written element-wise."""
    D, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, theta, L = D // nh, cfg["rms_norm_eps"], cfg["rope_theta"], cfg["num_hidden_layers"]
    total, count = 0.0, 0
    for row in tokens:
        ids, tgt = row[:-1], row[1:]
        S = len(ids)

        def norm(x, g):
            return x / math.sqrt(float(np.mean(x * x)) + eps) * g

        def rot(x, pos):
            out = np.empty_like(x)
            for i in range(hd // 2):
                c, s = math.cos(pos * theta ** (-2.0 * i / hd)), math.sin(pos * theta ** (-2.0 * i / hd))
                out[i] = x[i] * c - x[i + hd // 2] * s
                out[i + hd // 2] = x[i + hd // 2] * c + x[i] * s
            return out

        h = [w["model.embed_tokens.weight"][t].copy() for t in ids]
        for l in range(L):
            p = f"model.layers.{l}."
            Q, K, Vv = [], [], []
            for t in range(S):
                a = norm(h[t], w[p + "input_layernorm.weight"])
                q = w[p + "self_attn.q_proj.weight"] @ a
                k = w[p + "self_attn.k_proj.weight"] @ a
                v = w[p + "self_attn.v_proj.weight"] @ a
                Q.append([rot(q[j * hd:(j + 1) * hd], t) for j in range(nh)])
                K.append([rot(k[j * hd:(j + 1) * hd], t) for j in range(nkv)])
                Vv.append([v[j * hd:(j + 1) * hd] for j in range(nkv)])
            new_h = []
            for t in range(S):
                o = np.zeros(nh * hd)
                for j in range(nh):
                    kv = j // (nh // nkv)
                    sc = np.array([Q[t][j] @ K[u][kv] / math.sqrt(hd) for u in range(t + 1)])
                    pr = np.exp(sc - sc.max())
                    pr /= pr.sum()
                    o[j * hd:(j + 1) * hd] = sum(pr[u] * Vv[u][kv] for u in range(t + 1))
                x = h[t] + w[p + "self_attn.o_proj.weight"] @ o
                m = norm(x, w[p + "post_attention_layernorm.weight"])
                x = x + naive_mlp(cfg, w, l, m)
                new_h.append(x)
            h = new_h
        for t in range(S):
            z = w["lm_head.weight"] @ norm(h[t], w["model.norm.weight"])
            zmax = z.max()
            total += zmax + math.log(np.exp(z - zmax).sum()) - z[tgt[t]]
            count += 1
    return total / count


def run_ref(args, subprocess_=False):
    """reference.py's CLI: in-process (fast), or as a real subprocess."""
    if subprocess_:
        p = subprocess.run([sys.executable, os.path.join(HERE, "reference.py")] + args,
                           capture_output=True, text=True)
        return p.returncode, p.stdout, p.stderr
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = ref.main(args)
        except SystemExit as e:  # argparse errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_idx(tmp):
    rng = np.random.default_rng(1)
    seqs = [np.append(rng.integers(0, 256, n), 256) for n in (5, 40, 17)]
    write_idx(os.path.join(tmp, "d16"), seqs)
    got, docs = ref.read_indexed_dataset(os.path.join(tmp, "d16"))
    check(len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, seqs)), "uint16 idx round trip")
    check(docs.tolist() == [0, 1, 2, 3], "doc_idx")
    write_idx(os.path.join(tmp, "d32"), seqs, 4, np.int32)
    got, _ = ref.read_indexed_dataset(os.path.join(tmp, "d32"))
    check(all(np.array_equal(a, b) for a, b in zip(got, seqs)), "int32 idx round trip")
    stream = ref.token_stream(os.path.join(tmp, "d16"), 257)
    check(np.array_equal(stream, np.concatenate(seqs)), "stream is the concatenation")
    S = 8
    win = ref.windows(stream, S, 0, (len(stream) - 1) // S)
    for i in range(win.shape[0]):
        check(np.array_equal(win[i], stream[i * S:i * S + S + 1]), f"window {i}")
    check(win[1][0] == win[0][-1], "windows overlap by one token")
    try:
        ref.windows(stream, S, 0, (len(stream) - 1) // S + 1)
        check(False, "too many windows accepted")
    except ref.InputError:
        pass
    try:
        ref.token_stream(os.path.join(tmp, "d16"), 200)
        check(False, "out-of-vocab tokens accepted")
    except ref.InputError:
        pass
    PASSED.append("idx")


def test_safetensors(tmp):
    rng = np.random.default_rng(2)
    t = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b.c": rng.normal(size=(7,)).astype(np.float32)}
    write_safetensors(os.path.join(tmp, "t.safetensors"), t)
    got = ref.read_safetensors(os.path.join(tmp, "t.safetensors"))
    check(set(got) == {"a", "b.c"}, "names")
    check(all(np.array_equal(got[k], t[k].astype(np.float64)) for k in t), "F32 values")
    check(got["a"].dtype == np.float64 and got["a"].shape == (3, 5), "dtype/shape")
    write_safetensors(os.path.join(tmp, "b.safetensors"), t, "BF16")
    got = ref.read_safetensors(os.path.join(tmp, "b.safetensors"))
    check(np.allclose(got["a"], t["a"], rtol=1e-2), "BF16 values")
    PASSED.append("safetensors")


def test_model_vs_naive(tmp):
    import torch
    rng = np.random.default_rng(3)
    cfg, w = random_model(rng)
    save_model(os.path.join(tmp, "m"), cfg, w)
    hp, w2 = ref.read_model_dir(os.path.join(tmp, "m"))
    check(all(np.array_equal(w[k], w2[k]) for k in w), "model round trip")
    toks = rng.integers(0, cfg["vocab_size"], (3, 10))
    ours = ref.lm_loss(torch, hp, ref.to_torch(torch, w2), toks).item()
    naive = naive_loss(cfg, w, toks)
    check(abs(ours - naive) <= 1e-10 * abs(naive), f"torch {ours!r} vs naive {naive!r}")
    # MHA and MQA too (GQA mapping j // (nh/nkv)).
    for nkv in (4, 1):
        cfg, w = random_model(rng, nkv=nkv)
        hp = {"V": cfg["vocab_size"], "D": 16, "F": 24, "L": 2, "nh": 4, "nkv": nkv, "hd": 4,
              "eps": cfg["rms_norm_eps"], "theta": cfg["rope_theta"]}
        ours = ref.lm_loss(torch, hp, ref.to_torch(torch, w), toks).item()
        naive = naive_loss(cfg, w, toks)
        check(abs(ours - naive) <= 1e-10 * abs(naive), f"nkv={nkv}: torch {ours!r} vs naive {naive!r}")
    PASSED.append("model")


MOE_VARIANTS = [
    ("softmax", {}),
    ("softmax norm", {"norm_topk_prob": True}),
    ("sigmoid norm x2.5", {"scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    ("sigmoid raw", {"scoring_func": "sigmoid"}),
    ("shared expert", {"shared_expert_intermediate_size": 10}),
    ("groups 4/2 top-2", {"n_group": 4, "topk_group": 2}),
    ("groups 4/2 top-4 sigmoid", {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "scoring_func": "sigmoid",
                                  "norm_topk_prob": True}),
    ("groups 2/1 top-3", {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3}),
    ("top-1 freq 2 first 0", {"num_experts_per_tok": 1, "first_k_dense_replace": 0, "moe_layer_freq": 2}),
]


def test_moe_vs_naive(tmp):
    import torch
    rng = np.random.default_rng(5)
    for label, moe in MOE_VARIANTS:
        for bias in (False, True):
            cfg, w = random_moe_model(rng, bias=bias, **moe)
            d = os.path.join(tmp, "moe-" + label.replace(" ", "_") + ("-b" if bias else ""))
            save_model(d, cfg, w)
            hp, w2 = ref.read_model_dir(d)
            check(hp["moe"] is not None and all(np.array_equal(w[k], w2[k]) for k in w), f"{label}: round trip")
            P = ref.to_torch(torch, w2)
            # The MoE block alone, on random rows, against the per-token loop.
            for l in range(cfg["num_hidden_layers"]):
                if not naive_is_moe(cfg, l):
                    continue
                x = rng.normal(0, 1, (40, cfg["hidden_size"]))
                ours = ref.moe_mlp(torch, hp["moe"], P, f"model.layers.{l}.block_sparse_moe.",
                                   torch.tensor(x)).numpy()
                naive = np.stack([naive_mlp(cfg, w, l, row) for row in x])
                err = np.max(np.abs(ours - naive)) / np.max(np.abs(naive))
                check(err <= 1e-12, f"{label} bias={bias} layer {l}: moe block rel err {err}")
            # The whole model.
            toks = rng.integers(0, cfg["vocab_size"], (2, 9))
            ours = ref.lm_loss(torch, hp, P, toks).item()
            naive = naive_loss(cfg, w, toks)
            check(abs(ours - naive) <= 1e-10 * abs(naive), f"{label} bias={bias}: torch {ours!r} vs naive {naive!r}")
    PASSED.append("moe")


def test_moe_routing_details():
    import torch
    mo = dict(E=4, k=2, Fe=1, score="softmax", norm=False, scale=1.0, first=0, freq=1, G=1, TG=1, Fs=0)
    # Ties go to the lower expert index (equal logits -> equal scores).
    z = torch.tensor([[0.5, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    idx, p, s = ref.route(torch, mo, z)
    check(idx.tolist() == [[1, 2], [0, 1]], f"ties: {idx.tolist()}")
    check(torch.allclose(p, s.gather(1, idx)), "weights are the scores at the chosen experts")
    # The bias steers selection but the weights stay the unbiased scores.
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    idx, p, s = ref.route(torch, mo, z, bias)
    check(idx.tolist() == [[3, 0]], f"bias selection: {idx.tolist()}")
    check(abs(p[0, 0].item() - s[0, 3].item()) < 1e-15 and abs(p[0, 1].item() - s[0, 0].item()) < 1e-15,
          "bias does not enter the weights")
    # normalize + scale: weights sum to the scale.
    idx, p, _ = ref.route(torch, dict(mo, score="sigmoid", norm=True, scale=2.0), z)
    check(abs(p.sum().item() - 2.0) < 1e-12, f"normalized x2 sums to {p.sum().item()}")
    # Groups: {0,1} {2,3}; group 1 holds the best pair-sum though expert 0 is the best single expert.
    z = torch.tensor([[5.0, -5.0, 4.0, 4.0]], dtype=torch.float64)
    idx, _, _ = ref.route(torch, dict(mo, score="sigmoid", G=2, TG=1), z)
    check(sorted(idx[0].tolist()) == [2, 3], f"group-limited: {idx.tolist()}")
    idx, _, _ = ref.route(torch, dict(mo, score="sigmoid"), z)
    check(idx[0].tolist() == [0, 2], f"ungrouped: {idx.tolist()}")
    # Group score = sum of the top k/TG in the group (k=2, TG=2 -> the top 1 of each group).
    idx, _, _ = ref.route(torch, dict(mo, score="sigmoid", G=2, TG=2), z)
    check(idx[0].tolist() == [0, 2], f"two groups kept: {idx.tolist()}")
    PASSED.append("moe-routing")


def test_lr():
    c = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "decay_steps": 0, "total_steps": 14}
    check(abs(ref.lr_at(1, c) - 0.25) < 1e-15 and abs(ref.lr_at(4, c) - 1.0) < 1e-15, "warmup")
    check(abs(ref.lr_at(9, c) - 0.55) < 1e-12, "cosine midpoint")
    check(abs(ref.lr_at(14, c) - 0.1) < 1e-15 and abs(ref.lr_at(20, c) - 0.1) < 1e-15, "floor")
    c = {"lr": 1.0, "min_lr": 0.0, "warmup_steps": 0, "decay_steps": 10, "total_steps": 1}
    check(abs(ref.lr_at(1, c) - (1 + math.cos(math.pi / 10)) / 2) < 1e-15, "no warmup, decay_steps")
    PASSED.append("lr")


def test_cli(tmp):
    rng = np.random.default_rng(4)
    cfg, w = random_model(rng, V=257)
    save_model(os.path.join(tmp, "before"), cfg, w)
    seqs = [np.append(rng.integers(0, 256, n), 256) for n in (50, 70)]
    write_idx(os.path.join(tmp, "data"), seqs)
    rc, out, err = run_ref(["eval", "--weights", os.path.join(tmp, "before"), "--data", os.path.join(tmp, "data"),
                            "--samples", "5", "--seq-len", "8", "--batch", "2"])
    check(rc == 0, f"eval failed: {err}")
    got = json.loads(out)["loss"]
    stream = np.concatenate(seqs)
    naive = naive_loss(cfg, w, np.stack([stream[i * 8:i * 8 + 9] for i in range(5)]))
    check(abs(got - naive) <= 1e-10 * naive, f"eval {got} vs naive {naive}")

    # A step compared with itself: after = what torch computes (written in F32).
    import torch
    hc = {"seq_len": 8, "global_batch": 4, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
          "weight_decay": 0.1, "clip_grad": 0.5, "warmup_steps": 0, "decay_steps": 10, "total_steps": 1,
          "min_lr": 1e-3}
    with open(os.path.join(tmp, "hp.json"), "w") as f:
        json.dump(hc, f)
    hp, _ = ref.read_model_dir(os.path.join(tmp, "before"))
    P = ref.to_torch(torch, w, requires_grad=True)
    names = sorted(P)
    ref.lm_loss(torch, hp, P, np.stack([stream[i * 8:i * 8 + 9] for i in range(4)])).backward()
    torch.nn.utils.clip_grad_norm_([P[n] for n in names], 0.5)
    opt = torch.optim.AdamW([{"params": [P[n] for n in names if P[n].dim() >= 2], "weight_decay": 0.1},
                             {"params": [P[n] for n in names if P[n].dim() < 2], "weight_decay": 0.0}],
                            lr=ref.lr_at(1, hc), betas=(0.9, 0.95), eps=1e-8)
    opt.step()
    save_model(os.path.join(tmp, "after"), cfg, {n: P[n].detach().numpy() for n in names})
    step_args = ["step", "--weights-before", os.path.join(tmp, "before"), "--weights-after",
                 os.path.join(tmp, "after"), "--data", os.path.join(tmp, "data"),
                 "--config-json", os.path.join(tmp, "hp.json")]
    rc, out, err = run_ref(step_args)
    check(rc == 0, f"step failed: {err}")
    r = json.loads(out)
    check(r["max_param_rel_err"] < 1e-6, f"self step error {r['max_param_rel_err']}")
    check(len(r["per_param"]) == len(w), "per_param covers every tensor")
    # Norm weights must not decay: an after-file whose norms were also decayed is caught.
    decayed = {n: P[n].detach().numpy().copy() for n in names}
    for n in names:
        if decayed[n].ndim == 1:
            decayed[n] *= 1 - ref.lr_at(1, hc) * 0.1
    save_model(os.path.join(tmp, "after_decayed"), cfg, decayed)
    rc, out, err = run_ref(step_args[:4] + [os.path.join(tmp, "after_decayed")] + step_args[5:])
    r = json.loads(out)
    check(rc == 0 and r["worst_param"].endswith("norm.weight") and r["max_param_rel_err"] > 1e-4,
          f"decayed norms not caught: {r['worst_param']} {r['max_param_rel_err']}")
    # A perturbed after-file must be detected and named.
    bad = {n: P[n].detach().numpy().copy() for n in names}
    bad["model.layers.1.mlp.up_proj.weight"] *= 1.01
    save_model(os.path.join(tmp, "after_bad"), cfg, bad)
    rc, out, err = run_ref(step_args[:4] + [os.path.join(tmp, "after_bad")] + step_args[5:])
    r = json.loads(out)
    check(rc == 0 and r["worst_param"] == "model.layers.1.mlp.up_proj.weight"
          and 0.005 < r["max_param_rel_err"] < 0.02, f"perturbation not found: {r['worst_param']}")

    # Malformed inputs: exit 2 with a message naming the file.
    with open(os.path.join(tmp, "bad.idx"), "wb") as f:
        f.write(b"NOTMAGIC\x00" + b"\x00" * 40)
    open(os.path.join(tmp, "bad.bin"), "wb").close()
    rc, _, err = run_ref(["eval", "--weights", os.path.join(tmp, "before"), "--data", os.path.join(tmp, "bad"),
                          "--samples", "1", "--seq-len", "8"], subprocess_=True)
    check(rc == 2 and "bad.idx" in err and "magic" in err, f"bad idx: rc {rc}, {err}")
    os.makedirs(os.path.join(tmp, "trunc"), exist_ok=True)
    with open(os.path.join(tmp, "trunc", "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(tmp, "before", "model.safetensors"), "rb") as f:
        blob = f.read()
    with open(os.path.join(tmp, "trunc", "model.safetensors"), "wb") as f:
        f.write(blob[:-100])
    rc, _, err = run_ref(["eval", "--weights", os.path.join(tmp, "trunc"), "--data", os.path.join(tmp, "data"),
                          "--samples", "1", "--seq-len", "8"])
    check(rc == 2 and "model.safetensors" in err, f"truncated safetensors: rc {rc}, {err}")
    rc, _, err = run_ref(["eval", "--weights", os.path.join(tmp, "before"), "--data", os.path.join(tmp, "data"),
                          "--samples", "1000", "--seq-len", "8"])
    check(rc == 2 and "windows" in err, f"too many samples: rc {rc}, {err}")
    with open(os.path.join(tmp, "hp_bad.json"), "w") as f:
        json.dump({"lr": 1}, f)
    rc, _, err = run_ref(step_args[:-1] + [os.path.join(tmp, "hp_bad.json")])
    check(rc == 2 and "missing keys" in err, f"bad config json: rc {rc}, {err}")
    PASSED.append("cli")


def test_moe_cli(tmp):
    rng = np.random.default_rng(6)
    cfg, w = random_moe_model(rng, bias=True, scoring_func="sigmoid", norm_topk_prob=True,
                              routed_scaling_factor=2.0, shared_expert_intermediate_size=8)
    cfg["vocab_size"] = 257
    w["model.embed_tokens.weight"] = rng.normal(0, 1, (257, 16)).astype(np.float32).astype(np.float64)
    w["lm_head.weight"] = rng.normal(0, 0.3, (257, 16)).astype(np.float32).astype(np.float64)
    d = os.path.join(tmp, "moe-cli")
    save_model(d, cfg, w)
    seqs = [np.append(rng.integers(0, 256, n), 256) for n in (40, 30)]
    write_idx(os.path.join(tmp, "moe-data"), seqs)
    eval_args = ["eval", "--weights", d, "--data", os.path.join(tmp, "moe-data"), "--samples", "6",
                 "--seq-len", "8", "--batch", "4"]
    rc, out, err = run_ref(eval_args)
    check(rc == 0, f"moe eval failed: {err}")
    stream = np.concatenate(seqs)
    naive = naive_loss(cfg, w, np.stack([stream[i * 8:i * 8 + 9] for i in range(6)]))
    got = json.loads(out)["loss"]
    check(abs(got - naive) <= 1e-10 * naive, f"moe eval {got} vs naive {naive}")

    def expect_bad(mutate_cfg, mutate_w, fragment, what):
        c2, w2 = json.loads(json.dumps(cfg)), dict(w)
        mutate_cfg(c2)
        mutate_w(w2)
        d2 = os.path.join(tmp, "moe-bad")
        save_model(d2, c2, w2)
        rc, _, err = run_ref(eval_args[:2] + [d2] + eval_args[3:])
        check(rc == 2 and fragment in err, f"{what}: rc {rc}, {err}")

    keep = lambda x: None  # noqa: E731
    expect_bad(lambda c: c.update(scoring_func="relu"), keep, "scoring_func", "bad scoring_func")
    expect_bad(lambda c: c.update(n_group=3), keep, "n_group", "groups not dividing experts")
    expect_bad(lambda c: c.update(n_group=4, topk_group=1, num_experts_per_tok=4), keep, "topk_group", "top-k unreachable")
    expect_bad(lambda c: c.pop("num_local_experts"), keep, "num_local_experts", "missing num_local_experts")
    expect_bad(keep, lambda t: t.pop("model.layers.2.block_sparse_moe.experts.7.w2.weight"),
               "experts.7.w2.weight", "missing expert tensor")
    expect_bad(keep, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((24, 16))}),
               "model.layers.1.mlp.up_proj.weight", "dense tensor in an MoE layer")
    expect_bad(lambda c: c.update(shared_expert_intermediate_size=0), keep, "shared_expert",
               "shared expert tensors without shared_expert_intermediate_size")
    expect_bad(keep, lambda t: t.update({"model.layers.1.block_sparse_moe.expert_bias": np.zeros(5)}),
               "expert_bias has shape", "bias of the wrong size")
    # step refuses a model trained with auxiliary losses.
    cfg_aux = dict(cfg, router_aux_loss_coef=0.01, expert_bias=False)
    save_model(os.path.join(tmp, "moe-aux"), cfg_aux, w)
    with open(os.path.join(tmp, "moe-hp.json"), "w") as f:
        json.dump({"seq_len": 8, "global_batch": 2, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                   "weight_decay": 0.1, "clip_grad": 0.0, "warmup_steps": 0, "decay_steps": 0, "total_steps": 1,
                   "min_lr": 0.0}, f)
    rc, _, err = run_ref(["step", "--weights-before", os.path.join(tmp, "moe-aux"), "--weights-after",
                          os.path.join(tmp, "moe-aux"), "--data", os.path.join(tmp, "moe-data"),
                          "--config-json", os.path.join(tmp, "moe-hp.json")])
    check(rc == 2 and "router_aux_loss_coef" in err, f"step with aux loss: rc {rc}, {err}")
    PASSED.append("moe-cli")


def main():
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in [("idx", lambda: test_idx(tmp)), ("safetensors", lambda: test_safetensors(tmp)),
                         ("model", lambda: test_model_vs_naive(tmp)), ("lr", test_lr),
                         ("cli", lambda: test_cli(tmp)), ("moe", lambda: test_moe_vs_naive(tmp)),
                         ("moe-routing", test_moe_routing_details), ("moe-cli", lambda: test_moe_cli(tmp))]:
            try:
                fn()
                print(f"ok {name}")
            except Exception as e:  # report every failure, then fail
                failed.append(name)
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{len(PASSED)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
