"""Rotary position embedding (neox style: rotate halves) over a precomputed cos/sin cache."""

from __future__ import annotations

import torch
from torch import nn

from metainfer.kernels import build_cos_sin_cache


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict | None, ops, device=None):
        super().__init__()
        self.head_dim = head_dim
        cache = build_cos_sin_cache(rotary_dim, max_position, base, scaling)
        self.register_buffer("cos_sin_cache", cache.to(device) if device is not None else cache, persistent=False)
        self.bind_ops(ops)

    def bind_ops(self, ops) -> None:
        self._rotate = ops.rotary_neox

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self._rotate(positions, q, k, self.cos_sin_cache, self.head_dim)
