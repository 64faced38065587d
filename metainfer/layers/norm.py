"""RMSNorm module; the math lives in metainfer.kernels (reference or Triton, chosen at build)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        # the norm after a MoE block that returns its unsummed expert slots (layers/moe.py): x is ExpertSlots
        self.sums_expert_slots = False
        self.bind_ops(ops)

    def take_expert_slots(self, ops) -> None:
        """From now on the residual-add form takes a MoE block's ExpertSlots as x (set once, at build)."""
        self.sums_expert_slots = True
        self.bind_ops(ops)

    def bind_ops(self, ops) -> None:
        self._norm = ops.rms_norm
        self._add_norm = ops.fused_add_rms_norm_slots if self.sums_expert_slots else ops.fused_add_rms_norm

    def forward(self, x, residual: torch.Tensor | None = None):
        """Without residual: normed x. With residual: (normed x+residual, x+residual); x is the previous MoE
        block's ExpertSlots where `sums_expert_slots`."""
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)
