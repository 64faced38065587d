"""Engine configuration: the model spec (from config.json), the engine's options, environment overrides."""

from metainfer.config.engine_config import (
    KV_CACHE_DTYPES,
    EngineConfig,
    locate_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from metainfer.config.errors import ConfigError
from metainfer.config.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["KV_CACHE_DTYPES", "SUPPORTED_ARCHITECTURES", "ConfigError", "EngineConfig", "ModelSpec", "locate_model",
           "resolve_device", "resolve_dtype", "resolve_kv_cache_dtype"]
