"""Model spec parsed from config.json: every dimension the engine builds from, never hard-coded.

Both hub-style keys (`rope_theta`, `rope_scaling`) and transformers-v5 keys (`rope_parameters`) are
accepted. Routing an architecture to its model family happens here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from metainfer.config.errors import ConfigError

# architecture name (config "architectures") -> model family module in metainfer.models
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "dense",
    "Qwen2ForCausalLM": "dense",
    "LlamaForCausalLM": "dense",
}
_MODEL_TYPE_TO_ARCH = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a dense decoder checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    partial_rotary_factor: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelSpec:
        arch = _route_architecture(cfg)
        model_type = cfg.get("model_type", "")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = _rope_settings(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
        )

    @classmethod
    def from_file(cls, path: str) -> ModelSpec:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _route_architecture(cfg: dict) -> str:
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    for arch in cfg.get("architectures") or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    arch = _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""))
    if arch and not cfg.get("architectures"):
        return arch
    given = cfg.get("architectures") or cfg.get("model_type")
    raise ConfigError(f"unsupported architecture {given!r}; supported architectures: {supported}")


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """Return (theta, scaling dict or None) from old-style or v5-style keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind in (None, "default") else {**params, "rope_type": kind}
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    else:
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling
