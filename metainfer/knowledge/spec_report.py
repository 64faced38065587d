"""The model-spec report: what one TP rank of a model holds, from config.json or a GGUF header alone.

Why: before a GPU is rented or a checkpoint downloaded, one wants to know whether the model can be split
`tp` ways, how many bytes of weights each rank keeps and how many tokens of KV cache the rest buys. The
constraints here (`spec_violations`) are the ones the engine enforces when it builds
(models/shape_contract.py's `validate_tp_config` raises the first one), so the report and the engine
cannot disagree on what is valid.

`per_rank_shapes` uses the checkpoint's (the hub's) parameter names: one tensor per projection and per
expert (`mlp.experts.3.gate_proj.weight`), DeepSeek's shared experts as one `mlp.shared_experts.*` MLP.
transformers 5 holds the routed experts fused (`mlp.experts.gate_up_proj` [E, 2N, H], `.down_proj`
[E, H, N]); `fold_experts` turns the per-expert names into those. Sharding (the engine's, layers/*.py):
column-parallel projections split their output rows, row-parallel ones their input columns; KV heads are
replicated when fewer than tp (each rank one head); the vocabulary is padded to a multiple of tp; MLA
splits q / q_b / kv_b / o by heads and replicates q_a / kv_a and the norms; experts and shared experts
split by moe_intermediate_size (shared: S groups of N/tp rows each); routers are replicated.

`per_rank_shapes` in the report (JSON/YAML) maps every parameter name to its per-rank shape. The compressed
view (`compress_shapes`, what `metainfer spec` prints as text) folds repeated layers / experts: a key without
braces maps to its shape (a list); a key with `{i}` (layer) and/or `{e}` (expert) maps to
{"shape": [...], "i": [[first, last], ...], "e": [[first, last], ...]} (inclusive ranges), i.e. the key for
every combination of the indices. `expand_shapes` undoes it.

`memory` (with a GPU memory budget): the KV tokens that fit next to this rank's weights and how many
sequences of `max_model_len` tokens that is; max_model_len is the caller's or, by default, the config's
max_position_embeddings (the engine's default too), and the plan says which.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re

from metainfer.config import KV_CACHE_DTYPES, ConfigError, ModelSpec
from metainfer.config.model_spec import ModelConfigError, _route_architecture, read_config_json

NODES = ("constraint.supported_architecture", "constraint.tp_divides_heads", "constraint.tp_kv_heads",
         "constraint.tp_divides_intermediate", "constraint.tp_divides_moe_intermediate",
         "constraint.rope_scaling_supported", "constraint.kv_cache_dtype", "constraint.supported_features")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # kernels/rotary.py: _inv_freq
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GPU_MEMORY_UTILIZATION = 0.9  # the engine's default share of the GPU (EngineConfig.gpu_memory_utilization)
_TP_NODES = NODES[1:5]


# -- constraints ---------------------------------------------------------------------------------------
class ConstraintViolation(ConfigError):
    """A config the engine refuses, naming the blueprint node of the constraint it breaks."""

    def __init__(self, node: str, message: str):
        super().__init__(f"{node}: {message}")
        self.node, self.message = node, message


def model_spec(config: dict) -> ModelSpec:
    """The ModelSpec of an HF-style config, or ConstraintViolation: an architecture the engine does not route
    (constraint.supported_architecture), or a routing it does not implement (scoring_func, topk_method, n_group:
    constraint.supported_features). The engine reads its spec through this (LLMEngine), the report too, so an
    unsupported model is refused by the same node in both, before any weight is read."""
    try:
        _route_architecture(config)
    except ConfigError as err:
        raise ConstraintViolation("constraint.supported_architecture", str(err)) from None
    try:
        return ModelSpec.from_dict(config)
    except (ConstraintViolation, ModelConfigError):
        raise
    except ConfigError as err:
        raise ConstraintViolation("constraint.supported_features", str(err)) from None


def spec_violations(spec: ModelSpec, tp: int, kv_cache_dtype="auto") -> list[dict]:
    """Every constraint that (spec, tp, kv_cache_dtype) breaks, as [{"node", "message"}]; [] when the
    engine can build it. The engine raises the first one (shape_contract.validate_tp_config)."""
    out: list[dict] = []

    def bad(node: str, message: str) -> None:
        out.append({"node": node, "message": message})

    if tp < 1:
        bad("constraint.tp_divides_heads", f"tensor_parallel_size must be >= 1, got {tp}")
        tp = 1
    if spec.num_heads % tp:
        bad("constraint.tp_divides_heads",
            f"num_attention_heads ({spec.num_heads}) is not divisible by tensor_parallel_size ({tp})")
    kv = spec.num_kv_heads
    if not spec.is_mla and kv >= tp and kv % tp:  # MLA: one latent, replicated on every rank
        bad("constraint.tp_kv_heads", f"num_key_value_heads ({kv}) is not divisible by tensor_parallel_size ({tp})")
    if not spec.is_mla and kv < tp and tp % kv:
        bad("constraint.tp_kv_heads", f"tensor_parallel_size ({tp}) is not a multiple of num_key_value_heads "
            f"({kv}); KV heads can only be replicated evenly")
    if spec.intermediate_size % tp and len(spec.moe_layers) < spec.num_layers:  # some layer is dense
        bad("constraint.tp_divides_intermediate",
            f"intermediate_size ({spec.intermediate_size}) is not divisible by tensor_parallel_size ({tp})")
    if spec.moe_layers and spec.moe_intermediate_size % tp:
        bad("constraint.tp_divides_moe_intermediate", f"moe_intermediate_size ({spec.moe_intermediate_size}) "
            f"is not divisible by tensor_parallel_size ({tp})")
    kind = rope_type(spec)
    if kind not in SUPPORTED_ROPE_TYPES:
        bad("constraint.rope_scaling_supported", f"rope_scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    raw = spec.raw or {}
    if raw.get("mlp_bias"):
        bad("constraint.supported_features", "mlp_bias is not supported (no MLP biases in the engine's layers)")
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        bad("constraint.supported_features", f"sliding-window attention (sliding_window={raw['sliding_window']}) "
            "is not supported: the paged attention attends to the whole context")
    if not _kv_dtype_ok(kv_cache_dtype):
        bad("constraint.kv_cache_dtype", f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; "
            f"got {kv_cache_dtype!r}")
    return out


def _kv_dtype_ok(kv_cache_dtype) -> bool:
    if isinstance(kv_cache_dtype, str):
        return kv_cache_dtype == "auto" or kv_cache_dtype in KV_CACHE_DTYPES
    import torch  # a torch dtype (LLM(kv_cache_dtype=torch.float8_e4m3fn)): EngineConfig checks it further

    return isinstance(kv_cache_dtype, torch.dtype)


def rope_type(spec: ModelSpec) -> str:
    scaling = spec.rope_scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


# -- shapes --------------------------------------------------------------------------------------------
def param_shapes(spec: ModelSpec, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Checkpoint parameter name -> this rank's shape under `tp` (tp=1: the full shapes). Tied embeddings:
    no lm_head.weight (it is embed_tokens'). Assumes spec_violations(spec, tp) has no tp violation."""
    h = spec.hidden_size
    vp = -(-spec.vocab_size // tp)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vp, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(_mla(spec, tp, p) if spec.is_mla else _gqa(spec, tp, p))
        shapes.update(_moe(spec, tp, p) if i in spec.moe_layers else _mlp(h, spec.intermediate_size // tp, p + "mlp."))
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (vp, h)
    return shapes


def _gqa(spec: ModelSpec, tp: int, p: str) -> dict:
    h, d, hq = spec.hidden_size, spec.head_dim, spec.num_heads // tp
    hk = max(1, spec.num_kv_heads // tp)  # fewer KV heads than ranks: one replicated head per rank
    a = p + "self_attn."
    shapes = {a + "q_proj.weight": (hq * d, h), a + "k_proj.weight": (hk * d, h), a + "v_proj.weight": (hk * d, h),
              a + "o_proj.weight": (h, hq * d)}
    if spec.qkv_bias:
        shapes.update({a + "q_proj.bias": (hq * d,), a + "k_proj.bias": (hk * d,), a + "v_proj.bias": (hk * d,)})
    if spec.qk_norm:
        shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    return shapes


def _mla(spec: ModelSpec, tp: int, p: str) -> dict:
    h, hq, lat, lq = spec.hidden_size, spec.num_heads // tp, spec.kv_lora_rank, spec.q_lora_rank
    dn, dr, dv, a = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, p + "self_attn."
    bias = bool(spec.raw.get("attention_bias"))
    shapes: dict[str, tuple[int, ...]] = {}
    if lq is None:
        shapes[a + "q_proj.weight"] = (hq * (dn + dr), h)
    else:  # q-LoRA: the down-projection and its norm replicated, the up-projection split by heads
        shapes[a + "q_a_proj.weight"] = (lq, h)
        if bias:
            shapes[a + "q_a_proj.bias"] = (lq,)
        shapes.update({a + "q_a_layernorm.weight": (lq,), a + "q_b_proj.weight": (hq * (dn + dr), lq)})
    shapes[a + "kv_a_proj_with_mqa.weight"] = (lat + dr, h)
    if bias:
        shapes[a + "kv_a_proj_with_mqa.bias"] = (lat + dr,)
    shapes.update({a + "kv_a_layernorm.weight": (lat,), a + "kv_b_proj.weight": (hq * (dn + dv), lat),
                   a + "o_proj.weight": (h, hq * dv)})
    if bias:
        shapes[a + "o_proj.bias"] = (h,)
    return shapes


def _mlp(h: int, n: int, m: str) -> dict:
    return {m + "gate_proj.weight": (n, h), m + "up_proj.weight": (n, h), m + "down_proj.weight": (h, n)}


def _moe(spec: ModelSpec, tp: int, p: str) -> dict:
    h, n, m = spec.hidden_size, spec.moe_intermediate_size // tp, p + "mlp."
    shapes = {m + "gate.weight": (spec.num_experts, h)}  # the router, replicated
    for e in range(spec.num_experts):
        shapes.update(_mlp(h, n, f"{m}experts.{e}."))
    if spec.num_shared_experts:  # one MLP of S * N channels: each rank S groups of N / tp
        shapes.update(_mlp(h, spec.num_shared_experts * n, m + "shared_experts."))
    return shapes


def fold_experts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-expert checkpoint names -> transformers 5's fused expert parameters (`experts.gate_up_proj`
    [E, 2N, H], `experts.down_proj` [E, H, N]); every other name unchanged."""
    out: dict[str, tuple[int, ...]] = {}
    counts: dict[str, int] = {}
    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    for name, shape in shapes.items():
        match = pattern.match(name)
        if match is None:
            out[name] = shape
            continue
        prefix, part = match.group(1), match.group(3)
        if part == "up":
            continue
        key = prefix + (".down_proj" if part == "down" else ".gate_up_proj")
        counts[key] = counts.get(key, 0) + 1
        out[key] = (counts[key], shape[0], shape[1]) if part == "down" else (counts[key], 2 * shape[0], shape[1])
    return out


_INDEXED = ((re.compile(r"^model\.layers\.(\d+)\."), "model.layers.{i}.", "i"),
            (re.compile(r"\.experts\.(\d+)\."), ".experts.{e}.", "e"))


def compress_shapes(shapes: dict[str, tuple[int, ...]]) -> dict:
    """The module docstring's compressed form: repeated layers / experts as `{i}` / `{e}` templates."""
    groups: dict[str, list[tuple[dict, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        template, index = name, {}
        for pattern, replacement, symbol in _INDEXED:
            match = pattern.search(template)
            if match:
                index[symbol] = int(match.group(1))
                template = template[:match.start()] + replacement + template[match.end():]
        groups.setdefault(template, []).append((index, shape))
    out: dict = {}
    for template, members in groups.items():
        if not members[0][0]:
            out[template] = list(members[0][1])
            continue
        symbols = sorted(members[0][0])
        values = {s: sorted({index[s] for index, _ in members}) for s in symbols}
        combos = {tuple(index[s] for s in symbols) for index, _ in members}
        if len({shape for _, shape in members}) == 1 and len(combos) == len(members) \
                and combos == set(itertools.product(*(values[s] for s in symbols))):
            out[template] = {"shape": list(members[0][1]), **{s: _ranges(values[s]) for s in symbols}}
        else:  # not one shape over a full grid of indices: leave those names expanded
            out.update({_fill(template, index): list(shape) for index, shape in members})
    return out


def _ranges(values: list[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for v in values:
        if ranges and v == ranges[-1][1] + 1:
            ranges[-1][1] = v
        else:
            ranges.append([v, v])
    return ranges


def _fill(template: str, index: dict) -> str:
    return template.replace("{i}", str(index.get("i", "{i}"))).replace("{e}", str(index.get("e", "{e}")))


def expand_shapes(compressed: dict) -> dict[str, tuple[int, ...]]:
    """The full {name: shape} of a compressed (or already full) `per_rank_shapes`."""
    out: dict[str, tuple[int, ...]] = {}
    for key, value in compressed.items():
        if isinstance(value, (list, tuple)):
            out[key] = tuple(value)
            continue
        symbols = [s for s in ("i", "e") if "{" + s + "}" in key]
        spans = [[v for lo, hi in value[s] for v in range(lo, hi + 1)] for s in symbols]
        for combo in itertools.product(*spans):
            out[_fill(key, dict(zip(symbols, combo)))] = tuple(value["shape"])
    return out


# -- the report ----------------------------------------------------------------------------------------
def load_config(model: str) -> dict:
    """config.json of a model folder (or the path of a config.json itself), or the config the engine derives
    from a GGUF header (no tensor data)."""
    from metainfer.config import locate_model

    if os.path.isfile(model) and model.endswith(".json"):
        with open(model) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as err:
                raise ConfigError(f"model {model!r} is not valid JSON: {err}") from None
    folder, gguf_file = locate_model(model)
    if gguf_file is not None:
        from metainfer.loader.gguf import gguf_config

        return gguf_config(gguf_file)
    return read_config_json(os.path.join(folder, "config.json"))


def features(spec: ModelSpec) -> dict:
    if spec.is_mla:
        attention = {"kind": "MLA", "num_heads": spec.num_heads, "kv_lora_rank": spec.kv_lora_rank,
                     "qk_rope_head_dim": spec.qk_rope_head_dim, "qk_nope_head_dim": spec.qk_nope_head_dim,
                     "v_head_dim": spec.v_head_dim, "q_lora_rank": spec.q_lora_rank}
    else:
        attention = {"kind": "GQA", "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
                     "groups": spec.num_heads // spec.num_kv_heads, "head_dim": spec.head_dim}
    moe = None
    if spec.moe_layers:
        moe = {"num_experts": spec.num_experts, "top_k": spec.num_experts_per_tok,
               "num_shared_experts": spec.num_shared_experts, "moe_intermediate_size": spec.moe_intermediate_size,
               "num_moe_layers": len(spec.moe_layers), "routing_method": spec.topk_method,
               "n_group": spec.n_group, "topk_group": spec.topk_group, "norm_topk_prob": spec.norm_topk_prob,
               "routed_scaling_factor": spec.routed_scaling_factor, "router_fp32": spec.router_fp32}
    return {"rope": {"type": rope_type(spec), "theta": spec.rope_theta, "rotary_dim": spec.rotary_dim,
                     "scaling": spec.rope_scaling},
            "qk_norm": spec.qk_norm, "qkv_bias": spec.qkv_bias,
            "attention_bias": bool(spec.raw.get("attention_bias", False)) or spec.qkv_bias,
            "tie_word_embeddings": spec.tie_word_embeddings, "attention": attention, "moe": moe,
            "max_position_embeddings": spec.max_position_embeddings}


def kv_bytes_per_token(spec: ModelSpec, tp: int, elem: int) -> int:
    """Per rank: dense 2 (K and V) x layers x max(1, kv_heads / tp) x head_dim; MLA layers x (kv_lora_rank +
    qk_rope_head_dim), the latent replicated on every rank."""
    if spec.is_mla:
        return spec.num_layers * spec.latent_dim * elem
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.head_dim * elem


def weight_bytes(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], elem: int) -> int:
    """Bytes of the given shapes at `elem` bytes a value; DeepSeek's routers are fp32 in the engine."""
    total = 0
    for name, shape in shapes.items():
        count = 1
        for d in shape:
            count *= d
        total += count * (4 if spec.router_fp32 and name.endswith(".mlp.gate.weight") else elem)
    return total


def memory_plan(budget_gib: float, weights: int, kv_per_token: int, max_model_len: int,
                max_model_len_from: str = "max_position_embeddings") -> dict:
    """budget = G x 2^30 x 0.9 (the engine's default gpu_memory_utilization); KV gets the budget less this
    rank's weights (activations, CUDA graphs and the sampler are not counted: an upper bound); the sequences
    that fit are whole sequences of `max_model_len` tokens (`max_model_len_from` says where that came from)."""
    budget = int(budget_gib * 2**30 * GPU_MEMORY_UTILIZATION)
    available = budget - weights
    tokens = max(0, available) // kv_per_token
    return {"gpu_memory_gib": budget_gib, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "budget_bytes": budget,
            "weight_bytes_per_rank": weights, "kv_bytes_available": available, "kv_bytes_per_token": kv_per_token,
            "kv_tokens": tokens, "max_model_len": max_model_len, "max_model_len_from": max_model_len_from,
            "max_sequences_at_max_model_len": tokens // max_model_len,
            "not_counted": "activations, CUDA graphs and sampler buffers (an upper bound)"}


def build_report(config: dict, tp: int = 1, dtype: str = "bfloat16", kv_cache_dtype: str = "auto",
                 gpu_memory_gib: float | None = None, max_model_len: int | None = None) -> dict:
    """The report (module docstring) for an HF-style config dict. Values that need a valid split (or a
    supported architecture) are None when a violation forbids them. `max_model_len` (default: the config's
    max_position_embeddings) is the sequence length the memory plan counts sequences of."""
    if dtype not in ELEMENT_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(ELEMENT_BYTES)}; got {dtype!r}")
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"max_model_len must be >= 1; got {max_model_len}")
    if gpu_memory_gib is not None and not 0 < gpu_memory_gib < math.inf:  # nan too
        raise ConfigError(f"gpu_memory_gib must be a finite number > 0; got {gpu_memory_gib}")
    archs = config.get("architectures") or [config.get("model_type")]
    report = {"architecture": archs[0], "family": None, "features": None, "params_total": None,
              "per_rank_shapes": None, "weight_bytes_per_rank": None, "kv_bytes_per_token": None, "memory": None,
              "violations": []}
    try:
        spec = model_spec(config)
    except ConstraintViolation as err:
        report["violations"].append({"node": err.node, "message": err.message})
        return report
    violations = spec_violations(spec, tp, kv_cache_dtype)
    report.update(architecture=spec.architecture, family=spec.family, features=features(spec),
                  params_total=sum(_numel(s) for s in param_shapes(spec, 1).values()), violations=violations)
    nodes = {v["node"] for v in violations}
    if nodes & set(_TP_NODES):
        return report
    shapes = param_shapes(spec, tp)
    report["per_rank_shapes"] = {k: list(v) for k, v in shapes.items()}
    report["weight_bytes_per_rank"] = weight_bytes(spec, shapes, ELEMENT_BYTES[dtype])
    if "constraint.kv_cache_dtype" in nodes:
        return report
    elem = 1 if kv_cache_dtype in KV_CACHE_DTYPES else ELEMENT_BYTES[dtype]
    report["kv_bytes_per_token"] = kv_bytes_per_token(spec, tp, elem)
    if gpu_memory_gib is not None:
        length, source = (max_model_len, "--max-model-len") if max_model_len else \
            (spec.max_position_embeddings, "max_position_embeddings")
        report["memory"] = memory_plan(gpu_memory_gib, report["weight_bytes_per_rank"], report["kv_bytes_per_token"],
                                       length, source)
    return report


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def to_yaml(value, indent: int = 0) -> str:
    """A small YAML emitter for the report (dicts, lists, str, int, float, bool, None); no dependency."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return pad + "{}\n"
        lines = []
        for key, item in value.items():
            head = f"{pad}{_yaml_scalar(str(key))}:"
            if _inline(item):
                lines.append(f"{head} {_yaml_inline(item)}\n")
            else:
                lines.append(head + "\n" + to_yaml(item, indent + 1))
        return "".join(lines)
    if isinstance(value, list):
        if _inline(value):
            return pad + _yaml_inline(value) + "\n"
        lines = []
        for item in value:
            if _inline(item):
                lines.append(f"{pad}- {_yaml_inline(item)}\n")
            else:
                body = to_yaml(item, indent + 1)
                lines.append(f"{pad}- {body.lstrip()}")
        return "".join(lines)
    return pad + _yaml_scalar(value) + "\n"


def _inline(value) -> bool:
    """Scalars, empty containers and lists of scalars / of lists of scalars go on one line (flow style)."""
    if isinstance(value, dict):
        return not value
    if isinstance(value, list):
        return all(not isinstance(v, (dict, list)) or (isinstance(v, list) and _inline(v)) for v in value)
    return True


def _yaml_inline(value) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_inline(v) for v in value) + "]"
    return _yaml_scalar(value)


def _yaml_scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):  # YAML 1.1 readers want a dot in the mantissa of 1e-06
        text = repr(value)
        return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)  # a JSON string is a valid double-quoted YAML scalar


_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}


def to_json(value, indent: int = 0) -> str:
    """JSON with one object key a line and every list of numbers (a shape, a range) on one line."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {to_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and not _inline(value):
        return "[\n" + ",\n".join(inner + to_json(v, indent + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value, separators=(", ", ": "))
