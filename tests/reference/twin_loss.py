#!/usr/bin/env python3
"""The PyTorch twin's loss (tools/train_torch.py, the model the GPU check
times origami against) on origami's exported weights: the twin built from a
config on the CPU in fp32, its parameters loaded from the export's
model.safetensors (read by reference.py), evaluated on the first `samples`
windows of a .bin/.idx dataset as `origami eval` takes them. Equal losses
show the twin computes origami's model, not one that is merely as large.

Usage: twin_loss.py CONFIG.toml WEIGHTS_DIR DATA_PREFIX SAMPLES
Output: {"loss": mean token loss, "samples": N, "tokens": N·seq_len}.
"""
import importlib.util
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference  # noqa: E402  (this directory's)


def load_twin():
    path = os.path.join(HERE, "..", "..", "tools", "train_torch.py")
    spec = importlib.util.spec_from_file_location("train_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def twin_state(torch, s, w):
    """The twin's parameter names from the export's (HF Mixtral/Qwen-MoE names)."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    for l in range(s["L"]):
        p, q = f"model.layers.{l}.", f"layers.{l}."
        names.update({q + "attn_norm.weight": p + "input_layernorm.weight",
                      q + "mlp_norm.weight": p + "post_attention_layernorm.weight"})
        for x in "qkvo":
            names[q + f"attn.{x}.weight"] = p + f"self_attn.{x}_proj.weight"
        moe = s["E"] > 0 and l >= s["first_dense"] and (l - s["first_dense"]) % s["freq"] == 0
        if moe:
            b = p + "block_sparse_moe."
            names[q + "moe.gate.weight"] = b + "gate.weight"
            for e in range(s["E"]):
                for part, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                    names[q + f"moe.experts.{e}.{part}.weight"] = b + f"experts.{e}.{hf}.weight"
            if s["Fs"]:
                for part in ("gate", "up", "down"):
                    names[q + f"moe.shared.{part}.weight"] = b + f"shared_expert.{part}_proj.weight"
        else:
            for part in ("gate", "up", "down"):
                names[q + f"mlp.{part}.weight"] = p + f"mlp.{part}_proj.weight"
    return {ours: torch.from_numpy(np.ascontiguousarray(w[hf], dtype=np.float32)) for ours, hf in names.items()}


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__)
    config, weights, data, samples = argv[0], argv[1], argv[2], int(argv[3])
    import torch
    twin = load_twin()
    s = twin.shape_of(twin.read_toml(config))
    model = twin.build(torch, s, torch.device("cpu"))
    _, w = reference.read_model_dir(weights)
    model.load_state_dict(twin_state(torch, s, w), strict=True)  # every parameter, no stray name
    toks = torch.from_numpy(reference.windows(reference.token_stream(data, s["V"]), s["S"], 0, samples)).long()
    with torch.no_grad():
        loss = model(toks[:, :-1], toks[:, 1:]).item()
    print(json.dumps({"loss": loss, "samples": samples, "tokens": samples * s["S"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
