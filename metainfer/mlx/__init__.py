"""The MLX backend: the dense family computed in MLX (Apple silicon's Metal, or MLX's CPU build on Linux)
behind the same LLM / LLMEngine / scheduler / sampler as the torch path (`LLM(..., device="mlx")`).

Modules: `layers` (the model in MLX), `weights` (safetensors, GGUF, dummy and mlx-lm's affine-quantized
checkpoints onto that model), `paged_kv` (the KV pool, indexed by the engine's block tables, and a step's
attention inputs), `model_runner` (the runner LLMEngine builds for device "mlx"). MLX is imported only
here and below, so the torch path never needs it.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install mlx (Apple silicon) or pip install 'mlx[cpu]' (Linux)"


def mlx_available() -> bool:
    return importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx.core") is not None


def require_mlx():
    """Import and return `mlx.core`, or raise ConfigError (a ValueError) naming the install command."""
    from metainfer.config.errors import ConfigError

    try:
        import mlx.core as mx
    except ImportError as exc:
        raise ConfigError(f"device='mlx' needs MLX, which is not installed: {INSTALL_HINT}") from exc
    return mx
