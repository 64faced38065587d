"""Collectives the model calls. With one rank they are identities chosen at build time."""

from __future__ import annotations

import torch
import torch.distributed as dist

from metainfer.distributed.parallel_state import get_tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (every rank gets the whole)."""
    parts = [torch.empty_like(x) for _ in range(get_tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def reducer():
    """The all-reduce used by row-parallel layers, decided once."""
    return all_reduce if get_tp_size() > 1 else identity


def gatherer():
    return all_gather_last_dim if get_tp_size() > 1 else identity
