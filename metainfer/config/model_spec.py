"""Model spec parsed from config.json: every dimension the engine builds from, never hard-coded.

Both hub-style keys (`rope_theta`, `rope_scaling`) and transformers-v5 keys (`rope_parameters`) are
accepted. Routing an architecture to its model family happens here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from metainfer.config.errors import ConfigError
from metainfer.kernels.rotary import yarn_get_mscale

# architecture name (config "architectures") -> model family module in metainfer.models
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "dense",
    "Qwen2ForCausalLM": "dense",
    "LlamaForCausalLM": "dense",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPE_TO_ARCH = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a decoder checkpoint. The MLA fields (DeepSeek-V2's
    latent attention) are 0/None for the other families; the MoE fields are 0 for dense models."""

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
    # multi-head latent attention (DeepSeek-V2): q_lora_rank None = a plain q_proj
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # mixture of experts: which layers are sparse, the router, the experts
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # DeepSeek: one MLP of num_shared_experts * moe_intermediate_size
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    router_fp32: bool = False  # DeepSeek keeps the router weight and logits in fp32 (transformers does)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_scale(self) -> float:
        """Softmax scale: head_dim^-0.5; under a scaled rope with `mscale_all_dim` (DeepSeek's YaRN) MLA
        also multiplies it by mscale(factor, mscale_all_dim)^2 (the non-rotary dims too, as its reference
        implementation and transformers' yarn_apply_mscale do)."""
        scale = self.head_dim ** -0.5
        scaling = self.rope_scaling or {}  # None for rope_type "default" (_rope_settings)
        if self.is_mla and scaling and scaling.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
            m = yarn_get_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale *= m * m
        return scale

    @property
    def max_context_tokens(self) -> int:
        """The longest context the checkpoint was made for (vLLM's derived max_model_len): max_position_embeddings,
        or under a scaled rope the original length times the factor (YaRN: original_max_position_embeddings x
        factor, at least max_position_embeddings; linear / dynamic: max_position_embeddings x factor)."""
        scaling = self.rope_scaling or {}
        factor = float(scaling.get("factor") or 1.0)
        kind = scaling.get("rope_type")
        if kind == "yarn":
            original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * factor))
        if kind in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        return self.max_position_embeddings

    @property
    def latent_dim(self) -> int:
        """Values the latent cache keeps per token and layer (MLA): kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def __post_init__(self):
        """A config.json missing or mistyping a size is a ConfigError naming it, not a KeyError or a TypeError
        deep in the engine."""
        for name in _POSITIVE_SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"the model's config.json: {_CONFIG_KEY.get(name, name)} must be a positive "
                                       f"integer, got {value!r}")

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelSpec:
        try:
            return cls._from_dict(cfg)
        except KeyError as err:
            raise ModelConfigError(f"the model's config.json lacks {err.args[0]!r}, which "
                                   f"{cfg.get('architectures')} needs") from None
        except TypeError as err:  # arithmetic on a mistyped field before the checks above run
            raise ModelConfigError(f"the model's config.json has a field of the wrong type ({err})") from None

    @classmethod
    def _from_dict(cls, cfg: dict) -> ModelSpec:
        arch = _route_architecture(cfg)
        model_type = cfg.get("model_type", "")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = _rope_settings(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        family = SUPPORTED_ARCHITECTURES[arch]
        # every family's MLP is SwiGLU; another activation would run as SiLU without a word
        act = cfg.get("hidden_act") or "silu"
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {act!r} is not supported (supported: silu)")
        extra = _mla_fields(cfg) if family == "deepseek_v2" else {}
        extra.update(_moe_fields(cfg, family))
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] if family == "deepseek_v2"
                      else cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or is_qwen2,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
            **extra,
        )

    @classmethod
    def from_file(cls, path: str) -> ModelSpec:
        return cls.from_dict(read_config_json(path))


class ModelConfigError(ConfigError):
    """A checkpoint's config.json that is broken (not JSON, a size missing or mistyped), not one that asks for a
    feature the engine lacks (spec_report.model_spec turns those into constraint violations)."""


# the sizes every family needs, positive ints (ModelSpec.__post_init__), and their config.json names
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                   "head_dim", "max_position_embeddings")
_CONFIG_KEY = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads"}


def read_config_json(path: str) -> dict:
    """A checkpoint's config.json as a dict; one that is not a JSON object is a ConfigError naming the file."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


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


def _mla_fields(cfg: dict) -> dict:
    return {
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
    }


def _moe_fields(cfg: dict, family: str) -> dict:
    """Which layers are sparse and how they route, for both MoE families (empty for dense)."""
    layers = range(cfg["num_hidden_layers"])
    if family == "deepseek_v2":
        experts = cfg.get("n_routed_experts") or 0
        first_dense, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        moe_layers = tuple(i for i in layers if experts and i >= first_dense and i % freq == 0)
        method = cfg.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise ConfigError(f"topk_method {method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
        scoring = cfg.get("scoring_func") or "softmax"
        if scoring != "softmax":
            raise ConfigError(f"scoring_func {scoring!r} is not supported (supported: softmax)")
        extra = {"num_shared_experts": int(cfg.get("n_shared_experts") or 0), "topk_method": method,
                 "n_group": int(cfg.get("n_group") or 1), "topk_group": int(cfg.get("topk_group") or 1),
                 "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0), "router_fp32": True}
    elif family == "qwen3_moe":
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers v5 writes the latter
        skip, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
        moe_layers = tuple(i for i in layers if experts and i not in skip and (i + 1) % step == 0)
        extra = {}
    else:
        return {}
    if moe_layers and experts % int(extra.get("n_group", 1)):
        raise ConfigError(f"n_group ({extra['n_group']}) does not divide the {experts} experts")
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if moe_layers and extra.get("topk_method") == "group_limited_greedy":
        groups, kept = extra["n_group"], extra["topk_group"]
        if not 1 <= kept <= groups:
            raise ConfigError(f"topk_group ({kept}) must be in [1, n_group={groups}]")
        if top_k > kept * (experts // groups):
            raise ConfigError(f"num_experts_per_tok ({top_k}) exceeds the {kept * (experts // groups)} experts in "
                              f"topk_group={kept} groups of {experts // groups}")
    return {"moe_layers": moe_layers, "num_experts": int(experts),
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), **extra}


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
