"""The attention layer a model calls: `self.attn(q, k, v)`; the backend chosen at build does the rest.

The layer holds what is per layer (scale, its cache views, and references to the model's q/k norms
and rotary cache, which the paged backend fuses into its K/V store); the backend holds the kernels
and the pool (attention/backend.py). References, not submodules: the weights stay where the
checkpoint names them (`self_attn.q_norm.weight`).
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, backend, scale: float, rotary=None, q_norm=None, k_norm=None, eps: float = 1e-6):
        super().__init__()
        self.backend, self.scale, self.eps = backend, scale, eps
        self._refs = (rotary, q_norm, k_norm)  # a tuple: not registered as submodules
        self.k_cache = self.v_cache = torch.empty(0)  # views into the backend's pool (backend.allocate)

    @property
    def cos_sin(self) -> torch.Tensor | None:
        return None if self._refs[0] is None else self._refs[0].cos_sin_cache

    @property
    def q_norm_weight(self) -> torch.Tensor | None:
        return None if self._refs[1] is None else self._refs[1].weight

    @property
    def k_norm_weight(self) -> torch.Tensor | None:
        return None if self._refs[2] is None else self._refs[2].weight

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(self, q, k, v)
