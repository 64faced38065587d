"""The SwiGLU MLP (gate and up fused in one column-parallel GEMM, down row-parallel): the dense layers of
every family. (DeepSeek's shared experts run as stacked experts inside the MoE block: layers/moe.py.)
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, ops, dtype):
        super().__init__()
        i = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [i, i], bias=False, dtype=dtype, ops=ops)
        self.down_proj = RowParallelLinear(i, hidden_size, bias=False, dtype=dtype, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul is applied by down_proj.forward_gated (folded into its GEMV where the op set says so)."""
        return self.down_proj.forward_gated(self.gate_up_proj(x))
