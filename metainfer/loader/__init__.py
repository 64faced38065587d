"""Weight sources (safetensors, GGUF, dummy) -> (name, tensor) pairs -> the model's loaders.

`load_weights` is the one place that maps checkpoint names onto parameters: it renames
per-expert tensors through the model's `map_checkpoint_name` (MoE: onto the stacked expert
weights) and fused projections through its `packed_modules_mapping`, calls each parameter's
`weight_loader`, and names every missing, unexpected or mis-shaped tensor. A parameter with
`expected_shards` (the stacked experts) is complete when every shard id is loaded; its loader
may return the shard ids one tensor filled (a fused [E, ...] checkpoint tensor fills them all).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from metainfer.layers.linear import default_weight_loader
from metainfer.loader.dummy import fill_dummy_weights
from metainfer.loader.gguf import iterate_gguf
from metainfer.loader.safetensors import iterate_safetensors


def load_model_weights(model: nn.Module, config) -> None:
    """Fill a built model from the source its EngineConfig names: dummy, a GGUF file or safetensors."""
    if config.load_format == "dummy":
        fill_dummy_weights(model, seed=config.seed)
    elif config.gguf_file is not None:
        load_weights(model, iterate_gguf(config.gguf_file))
    else:
        load_weights(model, iterate_safetensors(config.model_dir))


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    ignored = getattr(model, "ignored_checkpoint_keys", ())
    tied = getattr(getattr(model, "spec", None), "tie_word_embeddings", False)
    expected = _expected_shards(params, mapping)
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if any(fragment in name for fragment in ignored) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = map_name(name) or (name, None)
        for fragment, (fused, sid) in mapping.items():
            if target == name and f".{fragment}." in name:
                target, shard_id = name.replace(f".{fragment}.", f".{fused}."), sid
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            default_weight_loader(param, tensor.to(param.dtype), name)
            filled = None
        else:
            filled = loader(param, tensor.to(param.dtype), shard_id, name=name)
        loaded.update((target, sid) for sid in (filled if filled is not None else (shard_id,)))
    if unexpected:
        raise ValueError(f"unexpected tensor(s) in checkpoint: {', '.join(unexpected[:8])}")
    missing = sorted(_describe(p, s, mapping) for p, s in expected - loaded)
    if missing:
        raise ValueError(f"missing tensor(s) in checkpoint: {', '.join(missing[:8])}"
                         + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))


def _expected_shards(params: dict, mapping: dict) -> set[tuple[str, object]]:
    shards_of: dict[str, list] = {}
    for fused, sid in mapping.values():
        shards_of.setdefault(fused, []).append(sid)
    expected = set()
    for name, param in params.items():
        if getattr(param, "expected_shards", None) is not None:
            expected.update((name, sid) for sid in param.expected_shards)
            continue
        fused = next((f for f in shards_of if f".{f}." in name), None)
        if fused is None:
            expected.add((name, None))
        else:
            expected.update((name, sid) for sid in shards_of[fused])
    return expected


def _describe(param_name: str, shard_id, mapping: dict) -> str:
    """Name a missing shard the way the checkpoint would name it."""
    if shard_id is None:
        return param_name
    if isinstance(shard_id, tuple):  # (expert, part) of a stacked expert weight
        return param_name.replace(".experts.gate_up_proj", "").replace(".experts.down_proj", "") \
            + f".experts.{shard_id[0]}.{shard_id[1]}_proj.weight"
    for fragment, (fused, sid) in mapping.items():
        if sid == shard_id and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{fragment}.")
    return f"{param_name}[{shard_id}]"
