"""Linears with the op before them folded in: (residual-add +) RMSNorm -> linear, SiLU-and-mul -> linear.

Contract (docs/CONTRACTS.md):
- `norm_linear(x[M, K], residual[M, K] | None, norm_weight[K], eps, weight[N, K], bias[N] | None)
  -> (y[M, N], residual_out[M, K])`: y = linear(rms_norm(h)), residual_out = h, with h = x (no
  residual; residual_out may then be x itself) or h = x + residual rounded to residual's dtype.
  The caller keeps using the returned residual: the unfused path updates `residual` in place and
  returns it, the fused GEMV writes h to a new buffer and leaves `residual` as it was.
- `silu_mul_linear(gate_up[M, 2I], weight[N, I], bias[N] | None) -> y[M, N]`:
  y = linear(silu_and_mul(gate_up)).

Why: at batch 1 each folded op is one launch less a decode step (72 norms and 36 activations for
Qwen3-8B). `*_unfused` compose the op set's own kernels (the CPU path and the oracle); `*_engine`
take the fused Triton GEMV where the engine's linear would take the Triton GEMV (M <= ENGINE_MAX_ROWS
and the weight shape in the tuned table) and the unfused composition otherwise. Chosen by shape,
so a CUDA graph records one path per captured batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .gemv import ENGINE_MAX_ROWS, GemvConfig, rms_norm_gemv_triton, silu_mul_gemv_triton


def norm_linear_unfused(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None, *, rms_norm: Callable,
                        add_rms_norm: Callable, linear: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), residual


def silu_mul_linear_unfused(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            silu_and_mul: Callable, linear: Callable) -> torch.Tensor:
    return linear(silu_and_mul(gate_up), weight, bias)


def _gemv_config(x: torch.Tensor, weight: torch.Tensor, table: Mapping) -> GemvConfig | None:
    """The tuned config when the fused GEMV applies (the rule of gemv.linear_engine), else None."""
    if x.dim() == 2 and 1 <= x.shape[0] <= ENGINE_MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1:
        return table.get(weight.shape)
    return None


def norm_linear_engine(x, residual, norm_weight, eps, weight, bias=None, *, table: Mapping, pdl: bool,
                       unfused: Callable):
    config = _gemv_config(x, weight, table)
    if config is None or (residual is not None and residual.stride(1) != 1):
        return unfused(x, residual, norm_weight, eps, weight, bias)
    return rms_norm_gemv_triton(x, residual, norm_weight, eps, weight, bias, config=config, pdl=pdl)


def silu_mul_linear_engine(gate_up, weight, bias=None, *, table: Mapping, pdl: bool, unfused: Callable):
    config = _gemv_config(gate_up, weight, table)
    if config is None:
        return unfused(gate_up, weight, bias)
    return silu_mul_gemv_triton(gate_up, weight, bias, config=config, pdl=pdl)


__all__ = ["norm_linear_engine", "norm_linear_unfused", "silu_mul_linear_engine", "silu_mul_linear_unfused"]
