#!/usr/bin/python3
"""Independent float64 reference for Origami's model (ARCHITECTURE.md §4, §6, §8).

Reads Origami's exported Hugging Face weights (model.safetensors + config.json)
and Megatron indexed datasets (.bin/.idx) with its own parsers (numpy only) and
recomputes, in torch float64 with autograd:

  Dense (Llama) and MoE (Mixtral-named) models. An MoE export has
  "model_type": "mixtral", num_local_experts, num_experts_per_tok,
  moe_intermediate_size (expert width; intermediate_size is the dense width)
  and the DeepSeek-style routing fields scoring_func ("softmax" | "sigmoid"),
  norm_topk_prob, routed_scaling_factor, first_k_dense_replace,
  moe_layer_freq, n_group, topk_group, shared_expert_intermediate_size
  (absent fields take plain Mixtral's meaning: softmax, renormalized top-k,
  scale 1, every layer MoE, no groups, no shared expert). Layer l is MoE iff
  l >= first_k_dense_replace and (l - first_k_dense_replace) % moe_layer_freq
  == 0. Routing is dropless: z = m·Wr^T, s = softmax(z) | sigmoid(z), top-k
  of s + expert_bias (ties to the lower index; group-limited when n_group > 1:
  a group scores the sum of its top k/topk_group values, the best topk_group
  groups stay eligible), p = s at the chosen experts, p /= sum(p) + 1e-20 if
  norm_topk_prob, p *= routed_scaling_factor, out = sum_j p_j SwiGLU_e_j(m) +
  SwiGLU_shared(m).

  eval  --weights DIR --data PREFIX --samples N --seq-len S [--batch B]
        mean token cross-entropy over the first N windows in file order;
        prints {"loss": L, "samples": N, "tokens": N*S}.

  step  --weights-before DIR --weights-after DIR --data PREFIX --config-json FILE
        one optimizer step (t = 1) from the before-weights on global batch 0
        (unshuffled windows [0, global_batch)): mean loss, backward,
        torch.nn.utils.clip_grad_norm_, torch.optim.AdamW (decay on rank >= 2
        tensors only), then compares every tensor with the after-weights.
        Prints {"loss", "grad_norm", "lr", "max_param_rel_err", "worst_param",
        "max_update_rel_err", "worst_update", "per_param": {name: {...}}}.

        --config-json holds: seq_len, global_batch, lr, beta1, beta2, eps,
        weight_decay, clip_grad, warmup_steps, decay_steps, total_steps, min_lr
        (optional: step, default 1; only step 1 is meaningful from fresh
        optimizer state). MoE models only without auxiliary losses: the step
        replays the lm loss alone, so config.json must say
        router_aux_loss_coef = 0 and expert_bias false (and the run must
        have z_loss_coeff = 0, which config.json does not record).

Nothing here imports or mirrors Origami code: it is written from the spec so a
shared misunderstanding cannot hide. Malformed input (files, headers, shapes,
names, arguments) prints "error: ..." to stderr and exits with status 2.

Run it with Debian's interpreter: /usr/bin/python3 (torch 1.13 + numpy).
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np


class InputError(Exception):
    """Malformed input: reported as 'error: ...' with exit status 2."""


# --------------------------------------------------------------------------
# Megatron indexed dataset (.idx / .bin)
# --------------------------------------------------------------------------

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    8: np.uint16,
}


def read_indexed_dataset(prefix):
    """Returns (sequences: list of int64 arrays, doc_idx: int64 array)."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    try:
        with open(idx_path, "rb") as f:
            idx = f.read()
    except OSError as e:
        raise InputError(f"{idx_path}: cannot read: {e.strerror}")
    try:
        bin_bytes = np.fromfile(bin_path, dtype=np.uint8)
    except OSError as e:
        raise InputError(f"{bin_path}: cannot read: {e.strerror}")

    head = len(IDX_MAGIC) + 8 + 1 + 8 + 8
    if len(idx) < head:
        raise InputError(f"{idx_path}: {len(idx)} bytes, shorter than the {head}-byte header")
    if idx[: len(IDX_MAGIC)] != IDX_MAGIC:
        raise InputError(f"{idx_path}: bad magic {idx[:len(IDX_MAGIC)]!r}, expected {IDX_MAGIC!r}")
    off = len(IDX_MAGIC)
    (version,) = struct.unpack_from("<Q", idx, off)
    off += 8
    if version != 1:
        raise InputError(f"{idx_path}: version {version}, expected 1")
    code = idx[off]
    off += 1
    if code not in IDX_DTYPES:
        raise InputError(f"{idx_path}: dtype code {code} at offset {off - 1} not an integer token type "
                         f"({sorted(IDX_DTYPES)})")
    dtype = np.dtype(IDX_DTYPES[code])
    num_seq, num_docs = struct.unpack_from("<QQ", idx, off)
    off += 16
    need = off + 4 * num_seq + 8 * num_seq + 8 * num_docs
    if len(idx) != need:
        raise InputError(f"{idx_path}: {len(idx)} bytes, expected {need} for {num_seq} sequences and "
                         f"{num_docs} doc_idx entries")
    sizes = np.frombuffer(idx, dtype="<i4", count=num_seq, offset=off).astype(np.int64)
    off += 4 * num_seq
    pointers = np.frombuffer(idx, dtype="<i8", count=num_seq, offset=off).astype(np.int64)
    off += 8 * num_seq
    doc_idx = np.frombuffer(idx, dtype="<i8", count=num_docs, offset=off).astype(np.int64)

    seqs = []
    for i in range(num_seq):
        if sizes[i] < 0:
            raise InputError(f"{idx_path}: sequence {i} has negative size {sizes[i]}")
        begin, end = pointers[i], pointers[i] + sizes[i] * dtype.itemsize
        if begin < 0 or end > bin_bytes.size or begin % dtype.itemsize != 0:
            raise InputError(f"{idx_path}: sequence {i} spans bytes [{begin}, {end}) outside {bin_path} "
                             f"({bin_bytes.size} bytes) or misaligned for {dtype}")
        seqs.append(bin_bytes[begin:end].view(dtype.newbyteorder("<")).astype(np.int64))
    if num_docs > 0:
        if doc_idx[0] != 0 or doc_idx[-1] != num_seq or np.any(np.diff(doc_idx) < 0):
            raise InputError(f"{idx_path}: doc_idx must rise from 0 to {num_seq}, got {doc_idx.tolist()[:8]}...")
    return seqs, doc_idx


def token_stream(prefix, vocab_size=None):
    seqs, _ = read_indexed_dataset(prefix)
    stream = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
    if vocab_size is not None and stream.size and (stream.min() < 0 or stream.max() >= vocab_size):
        raise InputError(f"{prefix}.bin: token ids span [{stream.min()}, {stream.max()}], vocab is {vocab_size}")
    return stream


def windows(stream, seq_len, first, count):
    """Windows [first, first+count): window w = stream[w*S : w*S + S + 1]."""
    n_windows = (stream.size - 1) // seq_len if stream.size > 0 else 0
    if first < 0 or count < 1 or first + count > n_windows:
        raise InputError(f"windows [{first}, {first + count}) requested, the data has {n_windows} windows of "
                         f"{seq_len + 1} tokens ({stream.size} tokens)")
    return np.stack([stream[w * seq_len: w * seq_len + seq_len + 1] for w in range(first, first + count)])


# --------------------------------------------------------------------------
# safetensors + config.json
# --------------------------------------------------------------------------

ST_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "bf16"}


def read_safetensors(path):
    """Returns {name: float64 numpy array}."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}")
    if len(raw) < 8:
        raise InputError(f"{path}: {len(raw)} bytes, no 8-byte header length")
    (hlen,) = struct.unpack_from("<Q", raw, 0)
    if 8 + hlen > len(raw):
        raise InputError(f"{path}: header length {hlen} runs past the end of the file ({len(raw)} bytes)")
    try:
        header = json.loads(raw[8:8 + hlen].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: header is not JSON: {e}")
    if not isinstance(header, dict):
        raise InputError(f"{path}: header is not a JSON object")
    data = raw[8 + hlen:]
    out = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: tensor {name}: header entry needs dtype, shape, data_offsets: {info}")
        if dtype not in ST_DTYPES:
            raise InputError(f"{path}: tensor {name}: dtype {dtype} not one of {sorted(ST_DTYPES)}")
        numel = int(np.prod(shape)) if shape else 1
        item = 2 if dtype in ("F16", "BF16") else np.dtype(ST_DTYPES[dtype]).itemsize
        if not (0 <= begin <= end <= len(data)) or end - begin != numel * item:
            raise InputError(f"{path}: tensor {name}: data_offsets [{begin}, {end}) do not hold {numel} x {dtype} "
                             f"within {len(data)} data bytes")
        spans.append((begin, end, name))
        buf = data[begin:end]
        if dtype == "BF16":
            arr = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=ST_DTYPES[dtype])
        out[name] = arr.astype(np.float64).reshape(shape)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InputError(f"{path}: tensors {n0} and {n1} overlap ([{b0},{e0}) and [{b1},{e1}))")
    return out


CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "rope_theta")
MOE_KEYS = ("num_local_experts", "num_experts_per_tok")


def _int_field(cfg, cfg_path, key, default, lo):
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InputError(f"{cfg_path}: {key} = {json.dumps(v)}: must be an integer >= {lo}")
    return v


def read_moe_config(cfg, cfg_path, F):
    """The MoE hyper-parameters of an MoE config.json, or None for a dense one."""
    is_moe = cfg.get("model_type") == "mixtral" or "MixtralForCausalLM" in (cfg.get("architectures") or [])
    if not is_moe:
        if cfg.get("num_local_experts", 0):
            raise InputError(f"{cfg_path}: num_local_experts = {cfg['num_local_experts']} but model_type is "
                             f"{json.dumps(cfg.get('model_type'))}, not \"mixtral\"")
        return None
    missing = [k for k in MOE_KEYS if k not in cfg]
    if missing:
        raise InputError(f"{cfg_path}: model_type \"mixtral\" but missing keys {missing}")
    E = _int_field(cfg, cfg_path, "num_local_experts", None, 1)
    k = _int_field(cfg, cfg_path, "num_experts_per_tok", None, 1)
    if k > E:
        raise InputError(f"{cfg_path}: num_experts_per_tok = {k} must be <= num_local_experts = {E}")
    Fe = _int_field(cfg, cfg_path, "moe_intermediate_size", F, 1)
    score = cfg.get("scoring_func", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise InputError(f"{cfg_path}: scoring_func = {json.dumps(score)}: must be \"softmax\" or \"sigmoid\"")
    norm = cfg.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise InputError(f"{cfg_path}: norm_topk_prob = {json.dumps(norm)}: must be a boolean")
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InputError(f"{cfg_path}: routed_scaling_factor = {json.dumps(scale)}: must be a number > 0")
    first = _int_field(cfg, cfg_path, "first_k_dense_replace", 0, 0)
    freq = _int_field(cfg, cfg_path, "moe_layer_freq", 1, 1)
    G = _int_field(cfg, cfg_path, "n_group", 1, 1)
    TG = _int_field(cfg, cfg_path, "topk_group", 1, 1)
    Fs = _int_field(cfg, cfg_path, "shared_expert_intermediate_size", 0, 0)
    if E % G != 0:
        raise InputError(f"{cfg_path}: num_local_experts = {E} must be divisible by n_group = {G}")
    if TG > G:
        raise InputError(f"{cfg_path}: topk_group = {TG} must be <= n_group = {G}")
    if G > 1 and (k % TG != 0 or k > TG * (E // G)):
        raise InputError(f"{cfg_path}: num_experts_per_tok = {k} must be a multiple of topk_group = {TG} and "
                         f"<= topk_group * num_local_experts / n_group = {TG * (E // G)}")
    return dict(E=E, k=k, Fe=Fe, score=score, norm=norm, scale=float(scale), first=first, freq=freq, G=G, TG=TG,
                Fs=Fs)


def is_moe_layer(hp, l):
    mo = hp.get("moe")
    return mo is not None and l >= mo["first"] and (l - mo["first"]) % mo["freq"] == 0


def read_model_dir(d):
    cfg_path = os.path.join(d, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise InputError(f"{cfg_path}: cannot read: {e.strerror}")
    except json.JSONDecodeError as e:
        raise InputError(f"{cfg_path}: not JSON: {e}")
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise InputError(f"{cfg_path}: missing keys {missing}")
    V, D, F = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    L, nh, nkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", D // nh if nh else 0)
    if nh <= 0 or nkv <= 0 or nh % nkv != 0 or D != nh * hd or hd % 2 != 0:
        raise InputError(f"{cfg_path}: inconsistent heads: hidden {D}, heads {nh}, kv heads {nkv}, head_dim {hd}")
    if cfg.get("tie_word_embeddings", False):
        raise InputError(f"{cfg_path}: tie_word_embeddings is true; Origami's lm_head is untied")
    mo = read_moe_config(cfg, cfg_path, F)
    hp = dict(V=V, D=D, F=F, L=L, nh=nh, nkv=nkv, hd=hd, eps=float(cfg["rms_norm_eps"]),
              theta=float(cfg["rope_theta"]), moe=mo)
    w = read_safetensors(os.path.join(d, "model.safetensors"))

    expect = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    optional = {}
    for l in range(L):
        p = f"model.layers.{l}."
        expect.update({
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (nh * hd, D),
            p + "self_attn.k_proj.weight": (nkv * hd, D),
            p + "self_attn.v_proj.weight": (nkv * hd, D),
            p + "self_attn.o_proj.weight": (D, nh * hd),
        })
        if is_moe_layer(hp, l):
            E, Fe, Fs = mo["E"], mo["Fe"], mo["Fs"]
            b = p + "block_sparse_moe."
            expect[b + "gate.weight"] = (E, D)
            for e in range(E):
                expect.update({b + f"experts.{e}.w1.weight": (Fe, D), b + f"experts.{e}.w3.weight": (Fe, D),
                               b + f"experts.{e}.w2.weight": (D, Fe)})
            if Fs > 0:
                expect.update({b + "shared_expert.gate_proj.weight": (Fs, D),
                               b + "shared_expert.up_proj.weight": (Fs, D),
                               b + "shared_expert.down_proj.weight": (D, Fs)})
            optional[b + "expert_bias"] = (E,)
        else:
            expect.update({
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
            })
    missing = sorted(set(expect) - set(w))
    extra = sorted(set(w) - set(expect) - set(optional))
    if missing or extra:
        raise InputError(f"{d}/model.safetensors: missing tensors {missing[:6]}, unexpected {extra[:6]}")
    for name, shape in list(expect.items()) + [(n, s) for n, s in optional.items() if n in w]:
        if tuple(w[name].shape) != shape:
            raise InputError(f"{d}/model.safetensors: {name} has shape {list(w[name].shape)}, expected {list(shape)}")
        if not np.all(np.isfinite(w[name])):
            raise InputError(f"{d}/model.safetensors: {name} has non-finite values")
    if mo is not None:
        hp["aux_loss_coef"] = float(cfg.get("router_aux_loss_coef", 0.0))
        hp["expert_bias"] = bool(cfg.get("expert_bias", False))
    return hp, w


# --------------------------------------------------------------------------
# The model, float64
# --------------------------------------------------------------------------

def topk_lower_index_first(torch, x, k):
    """Indices of the k largest entries along the last dim; equal values rank the lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(torch, mo, z, bias=None):
    """Router logits z [N, E] -> (experts [N, k], weights [N, k], scores [N, E])."""
    E, k, G, TG = mo["E"], mo["k"], mo["G"], mo["TG"]
    s = torch.softmax(z, -1) if mo["score"] == "softmax" else torch.sigmoid(z)
    sel = s.detach()
    if bias is not None:
        sel = sel + bias.detach()
    if G > 1:
        N = sel.shape[0]
        grouped = sel.view(N, G, E // G)
        top_in_group = torch.sort(grouped, dim=-1, descending=True).values[..., : k // TG]
        group_score = top_in_group.sum(-1)  # [N, G]
        keep = torch.zeros(N, G, dtype=torch.bool)
        keep.scatter_(1, topk_lower_index_first(torch, group_score, TG), True)
        keep = keep[:, :, None].expand(N, G, E // G).reshape(N, E)
        sel = sel.masked_fill(~keep, float("-inf"))
    idx = topk_lower_index_first(torch, sel, k)  # [N, k]
    p = s.gather(1, idx)
    if mo["norm"]:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return idx, p * mo["scale"], s


def moe_mlp(torch, mo, P, b, m):
    """The MoE block (prefix b = 'model.layers.{l}.block_sparse_moe.') on m [..., D]; dropless."""
    silu = torch.nn.functional.silu
    shape = m.shape
    x = m.reshape(-1, shape[-1])
    idx, p, _ = route(torch, mo, x @ P[b + "gate.weight"].T, P.get(b + "expert_bias"))
    out = torch.zeros_like(x)
    for e in range(mo["E"]):
        rows, slot = (idx == e).nonzero(as_tuple=True)  # tokens that chose e, and in which slot
        if rows.numel() == 0:
            continue
        xe = x[rows]
        y = (silu(xe @ P[b + f"experts.{e}.w1.weight"].T) * (xe @ P[b + f"experts.{e}.w3.weight"].T)) \
            @ P[b + f"experts.{e}.w2.weight"].T
        out = out.index_add(0, rows, y * p[rows, slot][:, None])
    if mo["Fs"] > 0:
        out = out + (silu(x @ P[b + "shared_expert.gate_proj.weight"].T) * (x @ P[b + "shared_expert.up_proj.weight"].T)) \
            @ P[b + "shared_expert.down_proj.weight"].T
    return out.reshape(shape)


def lm_loss(torch, hp, P, tokens):
    """Mean token cross-entropy of tokens [B, S+1] (inputs [:, :-1], targets [:, 1:])."""
    F = torch.nn.functional
    ids = torch.as_tensor(tokens[:, :-1], dtype=torch.long)
    tgt = torch.as_tensor(tokens[:, 1:], dtype=torch.long)
    B, S = ids.shape
    nh, nkv, hd, eps = hp["nh"], hp["nkv"], hp["hd"], hp["eps"]

    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    i = torch.arange(hd // 2, dtype=torch.float64)
    inv_freq = hp["theta"] ** (-2.0 * i / hd)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [S, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)  # [S, hd]
    sin = torch.cat([ang.sin(), ang.sin()], -1)

    def rope(x):  # x [B, heads, S, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    h = P["model.embed_tokens.weight"][ids]  # [B, S, D]
    for l in range(hp["L"]):
        p = f"model.layers.{l}."
        a = rmsnorm(h, P[p + "input_layernorm.weight"])
        q = (a @ P[p + "self_attn.q_proj.weight"].T).view(B, S, nh, hd).transpose(1, 2)
        k = (a @ P[p + "self_attn.k_proj.weight"].T).view(B, S, nkv, hd).transpose(1, 2)
        v = (a @ P[p + "self_attn.v_proj.weight"].T).view(B, S, nkv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=1)  # q head j -> kv head j // rep
        v = v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        s = s.masked_fill(causal, float("-inf"))
        o = torch.softmax(s, -1) @ v  # [B, nh, S, hd]
        o = o.transpose(1, 2).reshape(B, S, nh * hd)
        h = h + o @ P[p + "self_attn.o_proj.weight"].T
        m = rmsnorm(h, P[p + "post_attention_layernorm.weight"])
        if is_moe_layer(hp, l):
            h = h + moe_mlp(torch, hp["moe"], P, p + "block_sparse_moe.", m)
        else:
            g = m @ P[p + "mlp.gate_proj.weight"].T
            u = m @ P[p + "mlp.up_proj.weight"].T
            h = h + (F.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T
    logits = rmsnorm(h, P["model.norm.weight"]) @ P["lm_head.weight"].T
    return F.cross_entropy(logits.reshape(B * S, -1), tgt.reshape(B * S), reduction="mean")


def to_torch(torch, w, requires_grad=False):
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad) for k, v in w.items()}


def lr_at(step, c):
    lr, min_lr, W = float(c["lr"]), float(c["min_lr"]), int(c["warmup_steps"])
    E = int(c["decay_steps"]) or int(c["total_steps"])
    if W > 0 and step <= W:
        return lr * step / W
    p = (step - W) / (E - W) if E > W else 1.0
    p = min(max(p, 0.0), 1.0)
    return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * p)) / 2.0


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------

def cmd_eval(args):
    import torch
    hp, w = read_model_dir(args.weights)
    stream = token_stream(args.data, hp["V"])
    if args.seq_len < 1:
        raise InputError(f"--seq-len {args.seq_len}: must be >= 1")
    toks = windows(stream, args.seq_len, 0, args.samples)
    P = to_torch(torch, w)
    total = 0.0
    with torch.no_grad():
        for b in range(0, args.samples, args.batch):
            chunk = toks[b: b + args.batch]
            total += lm_loss(torch, hp, P, chunk).item() * chunk.shape[0] * args.seq_len
    n_tok = args.samples * args.seq_len
    print(json.dumps({"loss": total / n_tok, "samples": args.samples, "tokens": n_tok}))


STEP_KEYS = ("seq_len", "global_batch", "lr", "beta1", "beta2", "eps", "weight_decay", "clip_grad",
             "warmup_steps", "decay_steps", "total_steps", "min_lr")


def rel(a, b):
    """||a - b|| / ||b|| (||a - b|| when b = 0)."""
    d = float(np.linalg.norm((a - b).ravel()))
    n = float(np.linalg.norm(b.ravel()))
    return d / n if n > 0 else d


def cmd_step(args):
    import torch
    try:
        with open(args.config_json) as f:
            c = json.load(f)
    except OSError as e:
        raise InputError(f"{args.config_json}: cannot read: {e.strerror}")
    except json.JSONDecodeError as e:
        raise InputError(f"{args.config_json}: not JSON: {e}")
    missing = [k for k in STEP_KEYS if k not in c]
    if missing:
        raise InputError(f"{args.config_json}: missing keys {missing}")
    step = int(c.get("step", 1))

    hp, w0 = read_model_dir(args.weights_before)
    hp1, w1 = read_model_dir(args.weights_after)
    if hp != hp1:
        raise InputError(f"{args.weights_before} and {args.weights_after}: configs differ: {hp} vs {hp1}")
    if hp["moe"] is not None and (hp["aux_loss_coef"] != 0 or hp["expert_bias"]):
        raise InputError(f"{args.weights_before}/config.json: router_aux_loss_coef = {hp['aux_loss_coef']}, "
                         f"expert_bias = {str(hp['expert_bias']).lower()}: step replays the lm loss only, so an MoE "
                         f"model needs router_aux_loss_coef 0 and expert_bias false")
    stream = token_stream(args.data, hp["V"])
    S, B = int(c["seq_len"]), int(c["global_batch"])
    toks = windows(stream, S, (step - 1) * B, B)

    names = sorted(w0)
    P = to_torch(torch, w0, requires_grad=True)
    loss = lm_loss(torch, hp, P, toks)
    loss.backward()
    params = [P[n] for n in names]
    for t in params:  # an expert no token chose (or the selection-only bias) gets a zero gradient, still decayed
        if t.grad is None:
            t.grad = torch.zeros_like(t)
    if float(c["clip_grad"]) > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, float(c["clip_grad"])))
    else:
        grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params])))
    lr = lr_at(step, c)
    decay = [P[n] for n in names if P[n].dim() >= 2]
    no_decay = [P[n] for n in names if P[n].dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": float(c["weight_decay"])},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(float(c["beta1"]), float(c["beta2"])), eps=float(c["eps"]))
    for _ in range(step):  # fresh optimizer state; only step 1 is a true replay
        opt.step()

    per = {}
    worst, worst_u = ("", -1.0), ("", -1.0)
    for n in names:
        ours = P[n].detach().numpy()
        ref = w1[n]
        e_p = rel(ref, ours)  # Origami's after-weights vs ours, relative to ours
        e_u = rel(ref - w0[n], ours - w0[n])  # Origami's update vs ours, relative to ours
        per[n] = {"rel_err": e_p, "update_rel_err": e_u,
                  "norm": float(np.linalg.norm(ours)), "update_norm": float(np.linalg.norm(ours - w0[n])),
                  "max_abs_diff": float(np.max(np.abs(ref - ours)))}
        if e_p > worst[1]:
            worst = (n, e_p)
        if e_u > worst_u[1]:
            worst_u = (n, e_u)
    print(json.dumps({"loss": loss.item(), "grad_norm": grad_norm, "lr": lr,
                      "max_param_rel_err": worst[1], "worst_param": worst[0],
                      "max_update_rel_err": worst_u[1], "worst_update": worst_u[0],
                      "per_param": per}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval", help="mean token loss of exported weights")
    e.add_argument("--weights", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--samples", type=int, required=True)
    e.add_argument("--seq-len", type=int, required=True)
    e.add_argument("--batch", type=int, default=8, help="windows per forward (memory only)")
    s = sub.add_parser("step", help="replay one AdamW step and compare")
    s.add_argument("--weights-before", required=True)
    s.add_argument("--weights-after", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--config-json", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "eval":
            if args.batch < 1:
                raise InputError(f"--batch {args.batch}: must be >= 1")
            cmd_eval(args)
        else:
            cmd_step(args)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
