"""mlx-lm, the peer, as a test reference: load a model folder and generate greedily with its own code."""

from __future__ import annotations

import json
import os


def add_legacy_rope_keys(folder: str) -> None:
    """transformers v5 writes `rope_parameters`; mlx-lm reads the older `rope_theta` / `rope_scaling`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in params:
        cfg["rope_theta"] = params["rope_theta"]
        if params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


def mlx_lm_greedy(folder: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's `generate_step` (argmax sampler; it never stops at EOS by itself), one prompt at a time."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(folder)
    out = []
    for ids in prompts:
        out.append([int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)])
    return out


def mlx_lm_quantize(src: str, dst: str, bits: int, group_size: int = 32, quant_predicate=None) -> None:
    """mlx-lm's own converter: an affine-quantized checkpoint (`quantization` in its config.json);
    `quant_predicate(path, module, config) -> bool | {"bits", "group_size"}` gives per-module overrides."""
    from mlx_lm.convert import convert

    add_legacy_rope_keys(src)
    convert(src, dst, quantize=True, q_bits=bits, q_group_size=group_size, quant_predicate=quant_predicate)
