"""Architecture -> model class. Routing happens once, when the engine is built."""

from __future__ import annotations

from metainfer.config import ConfigError, ModelSpec


def model_class(spec: ModelSpec):
    if spec.family == "dense":
        from metainfer.models.dense import DenseForCausalLM
        return DenseForCausalLM
    raise ConfigError(f"no model family for architecture {spec.architecture!r}")
