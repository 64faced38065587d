"""Collectives the model calls, over the TP group (torch.distributed's default group).

Layers pick their collective once, at construction, through `reducer()` / `gatherer()`:
with one rank these are the identity, so a TP=1 model makes no distributed call at all.
The rank and world size are captured when the collective is chosen, not read per step.
The all-reduce itself was chosen once, when the process joined the TP group (the custom
peer-to-peer all-reduce or NCCL on CUDA, gloo on the CPU: see custom_all_reduce.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from metainfer.distributed.parallel_state import get_group_all_reduce, get_tp_rank, get_tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; every rank gets the sum."""
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, world_size: int | None = None) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim; every rank gets the whole."""
    parts = [torch.empty_like(x) for _ in range(world_size or get_tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def gather_last_dim(x: torch.Tensor, rank: int, world_size: int, dst: int = 0) -> torch.Tensor:
    """Concatenate the shards along the last dim on rank `dst` only.

    `dst` gets the whole; the other ranks get their own shard back unchanged (they take part
    in the collective but their result is not used)."""
    x = x.contiguous()
    if rank != dst:
        dist.gather(x, None, dst=dst)
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.gather(x, parts, dst=dst)
    return torch.cat(parts, dim=-1)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def reducer() -> Callable[[torch.Tensor], torch.Tensor]:
    """The all-reduce used by row-parallel layers and the vocab-parallel embedding: the one
    chosen when this process joined the TP group (plain `all_reduce` outside a group)."""
    if get_tp_size() == 1:
        return identity
    return get_group_all_reduce() or all_reduce


def gatherer() -> Callable[[torch.Tensor], torch.Tensor]:
    """The logits gather of the LM head: shards concatenated on rank 0 (only rank 0 samples)."""
    rank, size = get_tp_rank(), get_tp_size()
    if size == 1:
        return identity

    def gather_to_rank0(x: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(x, rank, size)

    return gather_to_rank0

