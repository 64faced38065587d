"""Architecture -> (model class, attention backend). Routing happens once, when the engine is built."""

from __future__ import annotations

from metainfer.attention import PagedAttentionBackend
from metainfer.config import ConfigError, EngineConfig, ModelSpec
from metainfer.distributed.parallel_state import get_tp_size
from metainfer.models.dense import DenseForCausalLM

_FAMILIES = {"dense": DenseForCausalLM}


def model_class(spec: ModelSpec):
    try:
        return _FAMILIES[spec.family]
    except KeyError:
        raise ConfigError(f"no model family for architecture {spec.architecture!r}") from None


def build_attention_backend(config: EngineConfig, ops):
    """The family's attention backend, with this rank's heads: Hq / tp query heads and Hk / tp KV heads
    (one replicated KV head per rank when Hk < tp: layers/linear.py, QKVParallelLinear)."""
    spec, tp = config.spec, get_tp_size()
    if spec.family == "dense":
        return PagedAttentionBackend(ops, spec.num_heads // tp, max(1, spec.num_kv_heads // tp), spec.head_dim,
                                     config.torch_kv_cache_dtype, config.torch_device, config.max_num_seqs,
                                     config.max_model_len, config.block_size)
    raise ConfigError(f"no attention backend for architecture {spec.architecture!r}")
