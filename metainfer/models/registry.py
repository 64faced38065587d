"""Architecture -> (model class, attention backend). Routing happens once, when the engine is built."""

from __future__ import annotations

from metainfer.attention import MLABackend, PagedAttentionBackend
from metainfer.config import ConfigError, EngineConfig, ModelSpec
from metainfer.distributed.parallel_state import get_tp_size
from metainfer.models.deepseek_v2 import DeepseekV2ForCausalLM
from metainfer.models.dense import DenseForCausalLM
from metainfer.models.qwen3_moe import Qwen3MoeForCausalLM

_FAMILIES = {"dense": DenseForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}


def model_class(spec: ModelSpec):
    try:
        return _FAMILIES[spec.family]
    except KeyError:
        raise ConfigError(f"no model family for architecture {spec.architecture!r}") from None


def build_attention_backend(config: EngineConfig, ops):
    """The family's attention backend, with this rank's heads: Hq / tp query heads and Hk / tp KV heads
    (one replicated KV head per rank when Hk < tp: layers/linear.py, QKVParallelLinear); MLA: heads / tp
    query heads over the replicated latent."""
    spec, tp = config.spec, get_tp_size()
    common = dict(kv_dtype=config.torch_kv_cache_dtype, device=config.torch_device, max_num_seqs=config.max_num_seqs,
                  max_model_len=config.max_model_len, block_size=config.block_size)
    if spec.is_mla:
        if ops.backend == "triton":
            _check_mla_kernel_dims(spec)
        return MLABackend(ops, spec.num_heads // tp, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim,
                          **common)
    if spec.family in ("dense", "qwen3_moe"):
        return PagedAttentionBackend(ops, spec.num_heads // tp, max(1, spec.num_kv_heads // tp), spec.head_dim,
                                     **common)
    raise ConfigError(f"no attention backend for architecture {spec.architecture!r}")


def _check_mla_kernel_dims(spec: ModelSpec) -> None:
    """The Triton MLA kernels tile the latent, rope, nope and value dims as tl.dot operands: powers of two of at
    least 16 (DeepSeek-V2: 512, 64, 128, 128). Checked at build, not at the first launch; the CPU path takes any."""
    dims = {"kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.qk_rope_head_dim,
            "qk_nope_head_dim": spec.qk_nope_head_dim, "v_head_dim": spec.v_head_dim}
    bad = {name: value for name, value in dims.items() if value < 16 or value & (value - 1)}
    if bad:
        raise ConfigError(f"the GPU's MLA kernels need powers of two >= 16 for {', '.join(bad)} (got "
                          f"{', '.join(f'{k}={v}' for k, v in bad.items())}); device='cpu' runs this model")
