"""Tensor-parallel worker process: rank 1..N-1, driven by rank 0 over a pipe.

See metainfer/engine/tp_runner.py for the protocol. A worker never samples and never
decides anything: it builds its shards of the model, then runs every step rank 0 sends.
It ignores SIGINT (Ctrl-C in a terminal reaches the whole process group; rank 0 decides),
and exits on ("close",), on EOF of its pipe, or when its parent process is gone.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace

import torch

from metainfer.distributed.parallel_state import (
    connect_store,
    destroy_tp_group,
    init_tp_group,
    rank_device,
    set_tp_state,
)

PARENT_POLL_S = 0.5


def _exit_when_orphaned(parent_pid: int) -> None:
    """Watchdog: a worker blocked in a collective never sees its pipe's EOF, so also poll."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def _send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def worker_main(rank: int, world_size: int, store_port: int, config, conn, parent_pid: int, hooks=()) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                     name="metainfer-parent-watchdog").start()
    if config.torch_device.type == "cpu":  # N processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    from metainfer.engine.tp_runner import PeerFailure, build_rank_runner, decode_batch

    in_group, code = False, 0
    try:
        _send(conn, ("hello", os.getpid()))
        device = rank_device(config.torch_device, rank)
        init_tp_group(rank, world_size, connect_store(store_port, world_size), device)
        in_group = True
        set_tp_state(rank, world_size)
        runner = build_rank_runner(replace(config, torch_device=device), rank, world_size, hooks)
        _send(conn, ("ready", runner.num_blocks))
        _serve(conn, runner, decode_batch)
    except PeerFailure:
        code = 1
        _try_send(conn, ("peer-failure",))
    except BaseException:
        code = 1
        _try_send(conn, ("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        if in_group:
            destroy_tp_group()
        conn.close()
    # Skip the interpreter's and multiprocessing's teardown (about a second per worker,
    # measured here); there is nothing left to flush but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(conn, runner, decode_batch) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if message[0] == "step":
            runner.execute(decode_batch(message[1]))
        elif message[0] == "close":
            return
        else:
            raise RuntimeError(f"unknown message {message[0]!r}")


def _try_send(conn, message) -> None:
    try:
        _send(conn, message)
    except (OSError, ValueError):
        pass
