"""Random weights at the real dims (vLLM's "dummy" load format), for benchmarks."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, scale: float = 0.02) -> None:
    """Norm weights get 1 (keeps activations sane); everything else uniform in ±scale."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.uniform_(-scale, scale, generator=gen)
