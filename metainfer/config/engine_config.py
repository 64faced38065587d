"""The engine's options (`LLM(...)` keyword arguments), validated once in `finalize`."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import torch

from metainfer.config.env import env_overrides
from metainfer.config.errors import ConfigError
from metainfer.config.model_spec import ModelSpec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# "mp": rank 0 spawns the TP workers; "external_launcher": torchrun (or another launcher) starts every rank
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")


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
    """The torch device; "mlx" (the MLX backend, metainfer/mlx/) samples on the CPU, so it resolves to cpu once
    MLX imports (else a ValueError naming the install command). "auto" never picks MLX."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "mlx":
        from metainfer.mlx import require_mlx

        require_mlx()
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's own message lists every device type it knows
        raise ConfigError(f"device must be auto, cpu, cuda or mlx; got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu, cuda or mlx; got {device!r}")
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
    # a max_model_len past the model's positions (ModelSpec.max_context_tokens) is refused unless this is set
    # (env METAINFER_ALLOW_LONG_MAX_MODEL_LEN=1, as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)
    allow_long_max_model_len: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # most prompt tokens a step that also decodes running sequences may carry (Sarathi-Serve's stall-free
    # budget): a prompt arriving adds at most this much work to the running streams' next token, bounding
    # their inter-token latency; steps without decode rows still take max_num_batched_tokens. None: no cap
    max_mixed_prefill_tokens: int | None = None
    # share of what each running request may still generate (max_tokens left, at most 4,096) whose KV blocks
    # a prompt's admission leaves free, so admitted requests finish without preemption (engine/kv_reserve.py,
    # SGLang's new-token ratio); None: learned from finished requests, apart for requests with and without a
    # max_tokens (1.0 and 0.7 until one finishes); 0: none (vLLM's greedy admission)
    kv_reserve_ratio: float | None = None
    # the reserve applies from this many running sequences; below it only while their remaining lengths are spread,
    # and never for a model with routed experts: greedy admission otherwise (a decode step below the GPU's ridge,
    # ~184-200 rows of bf16 GEMM on an H100 / H200, costs the same with more rows: engine/kv_reserve.py)
    kv_reserve_min_running: int = 192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # the decode batch sizes captured as CUDA graphs, two or more (vLLM's cuda_graph_sizes as a list; its one-value
    # pattern form is refused); those at or above min(max_num_seqs, 512) give way to that count itself, so every row
    # count has a graph. None: 1, 2, 4, 8 and every multiple of 16
    cuda_graph_sizes: tuple[int, ...] | None = None
    # prefill and mixed steps of up to this many tokens run as per-layer CUDA graphs around eager attention
    # (worker/piecewise_graphs.py; capped at max_num_batched_tokens); 0: they run eagerly
    max_piecewise_graph_tokens: int = 2048
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    # build no tokenizer (vLLM's option): prompts are token ids, outputs carry ids and no text, stop strings and
    # chat templates are refused; the stop tokens come from the model's config. For dummy-weight runs of a
    # config-only folder and for callers that tokenize themselves.
    skip_tokenizer_init: bool = False
    cpu_kv_cache_gib: float = 2.0
    # per-request bounds checked when a request is added (engine/request_validation.py)
    max_n: int = 128  # samples of one request (OpenAI's own cap); vLLM caps best-of fan-out alike
    # top logprobs a request may ask for (vLLM's default); -1: no cap, so logprobs / prompt_logprobs = -1 (the whole
    # vocabulary, vLLM's) are allowed (otherwise only where the vocabulary fits under the cap)
    max_logprobs: int = 20
    # launch step n+1 before reading step n back (None: on for a single CUDA GPU, off elsewhere)
    async_scheduling: bool | None = None
    # kill switches (on by default where the device supports them; env overrides: config/env.py)
    enable_pdl: bool = True  # programmatic dependent launch of the Triton kernels (sm_90+)
    enable_skinny_gemm: bool = True  # tensor-core skinny GEMM for 3-64-row decode GEMMs with a tuned table
    enable_fused_sampler: bool = True  # one-pass Gumbel-max sampler for greedy/temperature-only batches
    enable_custom_all_reduce: bool = True  # one-shot all-reduce over symmetric memory for small TP messages
    # every GEMM the engine leaves to torch (F.linear where no Triton kernel takes the shape, MLA's bmm above 16
    # rows) through cuBLASLt's heuristics: torch.backends.cuda.preferred_blas_library("cublaslt"), process-wide, set
    # when a CUDA engine builds and put back when it closes; False: the process's own setting (torch's default:
    # cuBLAS). None: on, except for MLA models (docs/PERFORMANCE.md, H100: Qwen3-8B +0.6-1.1%, runs 129-130;
    # Qwen3-30B-A3B +-0.1%, run 135; DeepSeek-V2-Lite -1.5%, runs 132-133)
    enable_cublaslt: bool | None = None
    # "mp": rank 0 spawns its TP workers (the default); "external_launcher": this process is one rank of a group
    # started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; worker/tp/launched.py)
    distributed_executor_backend: str = "mp"
    # external launcher: how long a rank waits for the others (joining; each collective) before it fails
    distributed_timeout_s: float = 600.0
    # a profiling aid: every step's launch (perf_counter seconds, prefill?, sequences, tokens, decode rows, and when
    # it was read back) is kept and written to this JSON file when the engine closes (`metainfer serve --step-trace`:
    # the server's step timeline beside the offline engine's); ~150 bytes a step in memory until then. None: nothing
    step_trace_path: str | None = None
    # filled by finalize()
    spec: ModelSpec | None = None
    model_dir: str | None = None
    gguf_file: str | None = None
    torch_device: torch.device | None = None
    torch_dtype: torch.dtype | None = None
    torch_kv_cache_dtype: torch.dtype | None = None

    def finalize(self, spec: ModelSpec) -> None:
        self.spec = spec
        for name, value in env_overrides().items():  # before anything is built or spawned
            setattr(self, name, value)
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = _graph_sizes(self.cuda_graph_sizes)
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be >= 0, or -1 (no cap), got {self.max_logprobs}")
        if not 0 <= self.seed < 2**64:  # torch.manual_seed's (its overflow names no field) and MLX's (no negatives)
            raise ConfigError(f"seed must be in [0, 2**64), got {self.seed}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError("distributed_executor_backend must be one of "
                              f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; got {self.distributed_executor_backend!r}")
        if not self.distributed_timeout_s > 0:
            raise ConfigError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ConfigError(f"load_format must be auto, safetensors, gguf or dummy; got {self.load_format!r}")
        if self.max_model_len is None:
            self.max_model_len = spec.max_position_embeddings
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_model_len > spec.max_context_tokens and not self.allow_long_max_model_len:
            raise ConfigError(f"max_model_len {self.max_model_len} is longer than the model's "
                              f"{spec.max_context_tokens} positions (its max_position_embeddings and rope "
                              "scaling); positions past them were never trained (set "
                              "METAINFER_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway)")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, min(self.max_model_len, 16384))
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_mixed_prefill_tokens is not None and self.max_mixed_prefill_tokens < 1:
            raise ConfigError(f"max_mixed_prefill_tokens must be >= 1, got {self.max_mixed_prefill_tokens}")
        if self.kv_reserve_ratio is not None and not 0.0 <= self.kv_reserve_ratio <= 1.0:
            raise ConfigError(f"kv_reserve_ratio must be in [0, 1], got {self.kv_reserve_ratio}")
        if not self.kv_reserve_min_running >= 1:
            raise ConfigError(f"kv_reserve_min_running must be >= 1, got {self.kv_reserve_min_running}")
        if self.load_format == "gguf" and self.gguf_file is None:
            raise ConfigError(f"load_format='gguf' needs a .gguf model, got {self.model!r}")
        if self.load_format == "safetensors" and self.gguf_file is not None:
            raise ConfigError(f"load_format='safetensors' needs a model folder, got {self.model!r}")
        if self.max_piecewise_graph_tokens < 0:
            raise ConfigError(f"max_piecewise_graph_tokens must be >= 0, got {self.max_piecewise_graph_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.step_trace_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(
                self.step_trace_path))):
            raise ConfigError(f"step_trace_path: the folder of {self.step_trace_path!r} does not exist")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ConfigError(f"skip_tokenizer_init=True builds no tokenizer, but tokenizer={self.tokenizer!r} "
                              "names one: pass one of them")
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, spec.torch_dtype, self.torch_device)
        if self.device == "mlx":
            self._check_mlx(spec)
        self.torch_kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype, self.torch_device)
        if self.enable_cublaslt is None:
            self.enable_cublaslt = not spec.is_mla
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda" and self.tensor_parallel_size == 1
        elif self.async_scheduling and self.tensor_parallel_size > 1:
            raise ConfigError("async_scheduling is not supported with tensor_parallel_size > 1 (the workers "
                              "read their input ids from rank 0's host)")


    def _check_mlx(self, spec: ModelSpec) -> None:
        """The MLX backend: dense family, one device, model-dtype KV, synchronous steps. dtype "auto" is the
        checkpoint's dtype there (as mlx-lm), not fp32: MLX's CPU build runs bf16 GEMMs faster than fp32."""
        if spec.family != "dense":
            raise ConfigError(f"device='mlx' supports the dense family (Qwen3, Qwen2, Llama); got {spec.architecture}")
        if self.tensor_parallel_size != 1:
            raise ConfigError("device='mlx' runs on one device: tensor_parallel_size must be 1")
        if self.distributed_executor_backend != "mp":
            raise ConfigError("device='mlx' runs in one process: distributed_executor_backend must be 'mp' "
                              f"(the default), got {self.distributed_executor_backend!r}")
        if self.kv_cache_dtype not in ("auto", self.torch_dtype):
            raise ConfigError(f"device='mlx' keeps K/V in the model dtype: kv_cache_dtype must be auto, "
                              f"got {self.kv_cache_dtype!r}")
        if self.async_scheduling:
            raise ConfigError("device='mlx' does not support async_scheduling (its steps are synchronous)")
        self.async_scheduling = False
        if self.dtype == "auto":
            self.torch_dtype = _DTYPES.get(spec.torch_dtype.replace("torch.", ""), torch.float32)
        if self.torch_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"device='mlx' computes in float32, bfloat16 or float16; got dtype {self.dtype!r}")


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


def _graph_sizes(value) -> tuple[int, ...]:
    """EngineConfig.cuda_graph_sizes as a sorted tuple of distinct ints, or a ConfigError naming the field."""
    try:
        sizes = tuple(value)
    except TypeError:
        raise ConfigError(f"cuda_graph_sizes must be a list of batch sizes, got {value!r}") from None
    if not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1 for b in sizes):
        raise ConfigError(f"cuda_graph_sizes must be integers >= 1, got {value!r}")
    if len(set(sizes)) < 2:
        raise ConfigError(f"cuda_graph_sizes must list two or more batch sizes, got {value!r} (vLLM reads one "
                          "value N as a pattern up to N; give the sizes themselves)")
    return tuple(sorted({int(b) for b in sizes}))
