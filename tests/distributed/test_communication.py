"""The TP group (gloo on the CPU), rank state, free-port rendezvous, collectives, teardown."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist

from metainfer.distributed.communication import (
    all_gather_last_dim,
    all_reduce,
    gather_last_dim,
    gatherer,
    identity,
    reducer,
)
from metainfer.distributed.launch import run_on_ranks
from metainfer.distributed.parallel_state import (
    backend_for,
    check_tp_start,
    create_store,
    get_tp_rank,
    get_tp_size,
    set_tp_state,
    tp_state,
)


def _collectives(rank: int, world: int) -> dict:
    assert (get_tp_rank(), get_tp_size()) == (rank, world)
    summed = all_reduce(torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1))
    shard = torch.full((2, 3), float(rank))
    everywhere = all_gather_last_dim(shard.clone(), world)
    to_rank0 = gather_last_dim(shard.clone(), rank, world)
    chosen_reduce = reducer()(torch.ones(4) * (rank + 1))
    chosen_gather = gatherer()(shard.clone())
    empty = gatherer()(torch.zeros(0, 3))  # a step with no sampling rows still gathers
    return {"sum": summed, "all_gather": everywhere, "gather": to_rank0, "reducer": chosen_reduce,
            "gatherer": chosen_gather, "empty": tuple(empty.shape), "backend": dist.get_backend()}


@pytest.mark.tp
@pytest.mark.parametrize("world", [3])  # odd on purpose; TP=2 and TP=4 run end to end in test_tp_parity
def test_collectives_on_gloo(world):
    results = run_on_ranks(_collectives, world)
    total = sum(range(1, world + 1))
    expected_gather = torch.cat([torch.full((2, 3), float(r)) for r in range(world)], dim=-1)
    for rank, out in enumerate(results):
        assert out["backend"] == "gloo"
        torch.testing.assert_close(out["sum"], torch.arange(6, dtype=torch.float32).view(2, 3) * total)
        torch.testing.assert_close(out["all_gather"], expected_gather)
        torch.testing.assert_close(out["reducer"], torch.full((4,), float(total)))
        if rank == 0:  # only rank 0 gets the whole; the others keep their shard
            torch.testing.assert_close(out["gather"], expected_gather)
            torch.testing.assert_close(out["gatherer"], expected_gather)
            assert out["empty"] == (0, 3 * world)
        else:
            torch.testing.assert_close(out["gather"], torch.full((2, 3), float(rank)))
            assert out["empty"] == (0, 3)
    assert not dist.is_initialized(), "the calling process must stay out of the group"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("metainfer-rank")]


def _fail_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


@pytest.mark.tp
def test_rank_failure_is_reported():
    with pytest.raises(RuntimeError, match="rank one is broken"):
        run_on_ranks(_fail_on_rank1, 2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("metainfer-rank")]


def test_store_binds_a_fresh_free_port():
    a, b = create_store(2), create_store(2)
    assert a.port != b.port and a.port > 0 and b.port > 0
    for store in (a, b):  # the port is bound and listening until the store is dropped
        with socket.create_connection(("127.0.0.1", store.port), timeout=2):
            pass


def test_one_rank_makes_no_distributed_calls():
    with tp_state(0, 1):
        assert reducer() is identity and gatherer() is identity
    assert not dist.is_initialized()


def test_tp_state_context_restores():
    set_tp_state(0, 1)
    with tp_state(3, 4):
        assert (get_tp_rank(), get_tp_size()) == (3, 4)
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with pytest.raises(ValueError, match="outside"):
        set_tp_state(2, 2)


def test_backend_per_device():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


def test_more_ranks_than_gpus_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is larger than the number of visible GPUs \(1\)"):
        check_tp_start(torch.device("cuda"), 2)
    check_tp_start(torch.device("cpu"), 8)  # CPU ranks share the cores; no limit
