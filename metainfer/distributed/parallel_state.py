"""Tensor-parallel rank state: which rank this process is and how many there are.

Set once per process before the model is built; layers read it at construction, so the
per-step path never asks again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TPState:
    rank: int = 0
    size: int = 1


_STATE = TPState()


def set_tp_state(rank: int, size: int) -> None:
    _STATE.rank, _STATE.size = rank, size


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size
