"""Run one function on every rank of a fresh TP group (tests and collective benchmarks).

`run_on_ranks(fn, world_size, *args)` spawns `world_size` processes, joins them into a TP
group (gloo on the CPU, NCCL on CUDA), calls `fn(rank, world_size, *args)` in each after the
rank state is set, and returns the per-rank results in rank order. The calling process
stays out of the group. `fn` must be importable (a module-level function) and its result
picklable. A rank that raises makes the whole call raise with that rank's traceback.
"""

from __future__ import annotations

import pickle
import time
import traceback

import torch
import torch.multiprocessing as mp

from metainfer.distributed.parallel_state import (
    connect_store,
    create_store,
    destroy_tp_group,
    init_tp_group,
    rank_device,
    set_tp_state,
)


def _rank_main(fn, rank, world_size, port, device_type, conn, args) -> None:
    torch.set_num_threads(1)
    try:
        device = rank_device(torch.device(device_type), rank)
        init_tp_group(rank, world_size, connect_store(port, world_size), device)
        set_tp_state(rank, world_size)
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            destroy_tp_group()
    except BaseException:
        result = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(result))
    conn.close()


def join_or_kill(procs, timeout: float = 10.0) -> None:
    """Wait for each process up to `timeout` s, then kill it: a hung rank must not outlive its caller."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join()


def run_on_ranks(fn, world_size: int, *args, device: str = "cpu", timeout: float = 120.0) -> list:
    ctx = mp.get_context("spawn")
    store = create_store(world_size + 1)  # the ranks connect as clients; this process only hosts it
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(fn, rank, world_size, store.port, device, child_end, args),
                            daemon=True, name=f"metainfer-rank{rank}")
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        results, errors = [None] * world_size, []
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"rank {rank} did not finish within {timeout:.0f} s")
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                status, value = "error", f"rank {rank} exited with code {procs[rank].exitcode} without a result"
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("run_on_ranks failed\n" + "\n".join(errors))
        return results
    finally:
        join_or_kill(procs)
        for conn in conns:
            conn.close()
