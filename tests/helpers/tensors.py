"""Reproducible random tensors for the tests (a private generator: the global seed is left alone)."""

from __future__ import annotations

import torch


def randn(*shape, seed: int = 0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)
