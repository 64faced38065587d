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


class LatentAttention(nn.Module):
    """MLA's attention layer (models/deepseek_v2.py): `self.attn(q, latent, None)` with q [T, Hr, Dn+R]
    and latent [T, L+R] (c and k_pe as kv_a_proj_with_mqa gives them). Holds the latent cache view and
    references to kv_a_layernorm and the rotary cache (the backend applies both in its store) and to
    kv_b_proj, whose per-head halves the backend applies absorbed: kv_b_proj.weight [Hr*(Dn+Dv), L] read
    as [Hr, Dn+Dv, L] -> w_uk [Hr, Dn, L], w_uv [Hr, Dv, L]."""

    def __init__(self, backend, scale: float, rotary, kv_b_proj, latent_norm, num_heads: int,
                 qk_nope_head_dim: int, v_head_dim: int):
        super().__init__()
        self.backend, self.scale = backend, scale
        self.num_heads, self.qk_nope_head_dim, self.v_head_dim = num_heads, qk_nope_head_dim, v_head_dim
        self._refs = (rotary, kv_b_proj, latent_norm)
        self.norm_eps = latent_norm.eps
        self.latent_cache = torch.empty(0)  # a view into the backend's pool (backend.allocate)

    @property
    def cos_sin(self) -> torch.Tensor:
        return self._refs[0].cos_sin_cache

    @property
    def norm_weight(self) -> torch.Tensor:
        return self._refs[2].weight

    def _kv_b(self) -> torch.Tensor:
        weight = self._refs[1].weight
        return weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, weight.shape[-1])

    @property
    def kv_b_weight(self) -> torch.Tensor:
        return self._refs[1].weight

    @property
    def w_uk(self) -> torch.Tensor:
        return self._kv_b()[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        return self._kv_b()[:, self.qk_nope_head_dim:]

    def forward(self, q: torch.Tensor, latent: torch.Tensor, v: None = None) -> torch.Tensor:
        return self.backend.forward(self, q, latent, v)
