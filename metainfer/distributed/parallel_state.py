"""Tensor-parallel rank state and the process group behind it.

The rank state (which rank this process is, how many there are) is set once per process
before the model is built; layers read it at construction, so the per-step path never asks
again. The TP group is torch.distributed's default group: NCCL on CUDA (one GPU per rank),
gloo on the CPU. Rank 0 owns the rendezvous store, bound to a port the OS picks (port 0), so
two engines on one host never collide and no port is hard-coded.

Joining the group also chooses, once, the all-reduce the row-parallel layers will use
(`make_all_reduce`: the custom peer-to-peer all-reduce on CUDA where it can run, else NCCL;
gloo on the CPU); `communication.reducer()` hands it out.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metainfer.distributed.custom_all_reduce import disable_nvlink_multicast, make_all_reduce

# Collectives and the rendezvous give up after this long (a rank that died mid-step).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
LOCALHOST = "127.0.0.1"


@dataclass
class TPState:
    rank: int = 0
    size: int = 1


_STATE = TPState()
_GROUP_ALL_REDUCE = None  # chosen by init_tp_group, released by destroy_tp_group


def set_tp_state(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside a group of size {size}")
    _STATE.rank, _STATE.size = rank, size


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


@contextmanager
def tp_state(rank: int, size: int):
    """Build modules as `rank` of `size`, then restore the previous state (rank 0 of a TP
    engine uses this so that a TP=1 engine built later in the same process is unsharded)."""
    previous = (_STATE.rank, _STATE.size)
    set_tp_state(rank, size)
    try:
        yield
    finally:
        _STATE.rank, _STATE.size = previous


def backend_for(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_tp_start(device: torch.device, tp_size: int) -> None:
    """Raise before any worker starts: too few GPUs (one per rank on CUDA), or a process group
    already in this process (one TP engine per process)."""
    device = torch.device(device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if tp_size > count:
            raise ValueError(f"tensor_parallel_size ({tp_size}) is larger than the number of visible "
                             f"GPUs ({count}); each rank needs its own GPU")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; "
                           "only one tensor-parallel engine can run per process (close the other first)")


def create_store(world_size: int, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port chosen by the OS; `store.port` tells the workers."""
    return dist.TCPStore(LOCALHOST, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def connect_store(port: int, world_size: int, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore(LOCALHOST, port, world_size, is_master=False, timeout=timeout)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: GPU `rank` on CUDA (made the current device), else `device` itself."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def init_tp_group(rank: int, world_size: int, store: dist.Store, device: torch.device,
                  timeout: datetime.timedelta = DEFAULT_TIMEOUT, custom_all_reduce: bool = True) -> None:
    """Join the TP group (the rank state is set separately: `set_tp_state` or `tp_state`).
    `device` is this rank's device from `rank_device`. `custom_all_reduce`: EngineConfig's
    enable_custom_all_reduce (custom_all_reduce.py); choosing it is a collective step."""
    global _GROUP_ALL_REDUCE
    device = torch.device(device)
    kwargs = {}
    if device.type == "cuda":
        disable_nvlink_multicast()
        kwargs["device_id"] = device  # bind the NCCL communicator to this rank's GPU eagerly
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    try:
        _GROUP_ALL_REDUCE = make_all_reduce(device, world_size, enabled=custom_all_reduce)
    except BaseException:
        dist.destroy_process_group()  # callers only tear down a group they know they joined
        raise


def get_group_all_reduce():
    """The all-reduce chosen when this process joined the TP group, or None outside one."""
    return _GROUP_ALL_REDUCE


def destroy_tp_group() -> None:
    """Leave the TP group (idempotent) and return to rank 0 of 1."""
    global _GROUP_ALL_REDUCE
    chosen, _GROUP_ALL_REDUCE = _GROUP_ALL_REDUCE, None
    if hasattr(chosen, "close"):  # the custom all-reduce's symmetric buffer
        chosen.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_state(0, 1)
