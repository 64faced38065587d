"""Model spec parsed from config.json, and the engine's configuration.

Dimensions are read from the checkpoint's config, never hard-coded. Both hub-style keys
(`rope_theta`, `rope_scaling`) and transformers-v5 keys (`rope_parameters`) are accepted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch


class ConfigError(ValueError):
    """A bad engine option (the message names the field). A ValueError, so callers of `LLM(...)` catch it
    as one; the CLI prints it as one line instead of a traceback."""


# The engine's A/B environment switches: name -> (value when unset, accepted values). Each is read once,
# where the engine is built (README: what each does); EngineConfig.finalize checks them all first.
# METAINFER_DISABLE_CUSTOM_ALL_REDUCE is not one of them: a kill switch of the TP all-reduce, parsed
# leniently where it is read (distributed/custom_all_reduce.py: "", 0, false, no, off keep it on).
ENV_SWITCHES = {
    "METAINFER_DISABLE_PDL": ("0", ("0", "1")),
    "METAINFER_FUSED_DECODE_PREP": ("0", ("0", "1")),
    "METAINFER_SKINNY_GEMM": ("1", ("0", "1")),
    "METAINFER_FP8_V_TOKEN_MAJOR": ("1", ("0", "1")),
    "METAINFER_FUSED_SAMPLER": ("1", ("0", "1")),
    "METAINFER_DECODE_ORDER": ("longest", ("longest", "admission")),
}


def env_choice(name: str) -> str:
    """A switch's value; one outside its accepted values is a ConfigError naming the variable (a typo must
    not silently measure the default)."""
    default, choices = ENV_SWITCHES[name]
    value = os.environ.get(name, default)
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def env_switch(name: str) -> bool:
    """A "0" / "1" switch: True for "1"."""
    return env_choice(name) == "1"

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


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype,
                           device: torch.device | None = None) -> torch.dtype:
    """`auto` is the model dtype; `fp8` / `fp8_e4m3` (or torch.float8_e4m3fn) is float8_e4m3fn
    (kernels/kv_cache.py), for which a CUDA device needs compute capability 8.9+ (e4m3 conversions)."""
    bad = ConfigError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)} (or the torch dtype "
                      f"{model_dtype} / torch.float8_e4m3fn); got {kv_cache_dtype!r}")
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype not in (model_dtype, torch.float8_e4m3fn):
            raise bad
        dtype = kv_cache_dtype
    elif isinstance(kv_cache_dtype, str) and (kv_cache_dtype == "auto" or kv_cache_dtype in KV_CACHE_DTYPES):
        dtype = KV_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)
    else:
        raise bad
    if dtype == torch.float8_e4m3fn and device is not None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or later "
                              f"(fp8 conversions); this one has {capability[0]}.{capability[1]}")
    return dtype


def resolve_dtype(dtype: str | torch.dtype, spec_dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is the checkpoint's dtype on CUDA and fp32 on the CPU (CPU bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(spec_dtype.replace("torch.", ""), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda; got {device!r}")
    return dev


@dataclass
class EngineConfig:
    """All engine options of `LLM(...)`, validated once."""

    model: str
    dtype: str | torch.dtype = "auto"
    # "auto": the model dtype; "fp8" (= "fp8_e4m3"): float8_e4m3fn K/V with a unit scale, half the
    # bytes of a 16-bit cache (twice the blocks, half the decode attention's reads)
    kv_cache_dtype: str | torch.dtype = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    cpu_kv_cache_gib: float = 2.0
    # launch step n+1 before reading step n back (None: on for a single CUDA GPU, off elsewhere)
    async_scheduling: bool | None = None
    # filled by finalize()
    spec: ModelSpec | None = None
    model_dir: str | None = None
    gguf_file: str | None = None
    torch_device: torch.device | None = None
    torch_dtype: torch.dtype | None = None
    torch_kv_cache_dtype: torch.dtype | None = None

    def finalize(self, spec: ModelSpec) -> None:
        self.spec = spec
        for name in ENV_SWITCHES:  # before anything is built or spawned (TP workers would wrap the error)
            env_choice(name)
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ConfigError(f"load_format must be auto, safetensors, gguf or dummy; got {self.load_format!r}")
        if self.max_model_len is None:
            self.max_model_len = spec.max_position_embeddings
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, min(self.max_model_len, 16384))
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.load_format == "gguf" and self.gguf_file is None:
            raise ConfigError(f"load_format='gguf' needs a .gguf model, got {self.model!r}")
        if self.load_format == "safetensors" and self.gguf_file is not None:
            raise ConfigError(f"load_format='safetensors' needs a model folder, got {self.model!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, spec.torch_dtype, self.torch_device)
        self.torch_kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype, self.torch_device)
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda" and self.tensor_parallel_size == 1
        elif self.async_scheduling and self.tensor_parallel_size > 1:
            raise ConfigError("async_scheduling is not supported with tensor_parallel_size > 1 (the workers "
                              "read their input ids from rank 0's host)")


def locate_model(model: str) -> tuple[str, str | None]:
    """Return (folder, gguf file or None) for a model folder or a .gguf path."""
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigError(f"model file {model!r} does not exist")
        return os.path.dirname(os.path.abspath(model)), model
    if not os.path.isdir(model):
        raise ConfigError(f"model {model!r} is neither a model folder nor a .gguf file")
    ggufs = [f for f in os.listdir(model) if f.endswith(".gguf")]
    if not os.path.exists(os.path.join(model, "config.json")) and len(ggufs) == 1:
        return model, os.path.join(model, ggufs[0])
    if not os.path.exists(os.path.join(model, "config.json")):
        raise ConfigError(f"model folder {model!r} has no config.json")
    return model, None
