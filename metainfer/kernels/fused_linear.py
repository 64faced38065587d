"""SiLU-and-mul -> linear, with the activation folded into the GEMV where the GEMV runs.

Contract (docs/CONTRACTS.md): `silu_mul_linear(gate_up[M, 2I], weight[N, I], bias[N] | None) -> y[M, N]`:
y = linear(silu_and_mul(gate_up)).

Why: at batch 1 the folded activation is one launch less a layer (36 for Qwen3-8B; run 12: 0.6 us a
layer). `silu_mul_linear_unfused` composes the op set's own kernels (the CPU path and the oracle);
`silu_mul_linear_engine` takes the fused Triton GEMV where the engine's linear would take the Triton GEMV
(M <= ENGINE_MAX_ROWS and the weight shape in the tuned table) and the unfused composition otherwise.
Chosen by shape, so a CUDA graph records one path per captured batch size. (A norm folded into the GEMV
after it lost its A/B, runs 12-13, and was removed.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .gemv import ENGINE_MAX_ROWS, silu_mul_gemv_triton


def silu_mul_linear_unfused(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            silu_and_mul: Callable, linear: Callable) -> torch.Tensor:
    return linear(silu_and_mul(gate_up), weight, bias)


def silu_mul_linear_engine(gate_up, weight, bias=None, *, table: Mapping, pdl: bool, unfused: Callable):
    if gate_up.dim() == 2 and 1 <= gate_up.shape[0] <= ENGINE_MAX_ROWS and gate_up.stride(1) == 1:
        config = table.get(weight.shape)
        if config is not None and weight.stride(1) == 1:
            return silu_mul_gemv_triton(gate_up, weight, bias, config=config, pdl=pdl)
    return unfused(gate_up, weight, bias)


__all__ = ["silu_mul_linear_engine", "silu_mul_linear_unfused"]
