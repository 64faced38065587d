"""SiLU-and-mul: the SwiGLU gate, `silu(x[:, :I]) * x[:, I:]`."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self._op = ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)
