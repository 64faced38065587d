"""Tensor-parallel worker process: rank 1..N-1, driven by rank 0 over a pipe.

The protocol is in worker/tp/protocol.py. A worker runs the same ModelRunner as rank 0 (built as
this rank; it never samples and never decides anything) on the batch its StepMirror rebuilds from
each step's delta.
It ignores SIGINT (Ctrl-C in a terminal reaches the whole process group; rank 0 decides), takes
SIGTERM's default action (whatever its parent ignores), and exits on ("close",), on EOF of its pipe,
or when its parent process is gone.
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
from metainfer.worker.model_runner import ModelRunner
from metainfer.worker.tp.protocol import BuildSync, PeerFailure, RankLink, StepMirror, send, try_send

PARENT_POLL_S = 0.5


def _exit_when_orphaned(parent_pid: int) -> None:
    """Watchdog: a worker blocked in a collective never sees its pipe's EOF, so also poll."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def worker_main(rank: int, world_size: int, store_port: int, config, conn, parent_pid: int, hooks=()) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a spawned process inherits ignored signals: the server's engine process ignores SIGTERM, and TPDriver.shutdown
    # ends a rank that does not close with terminate()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                     name="metainfer-parent-watchdog").start()
    if config.torch_device.type == "cpu":  # N processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    in_group, code = False, 0
    try:
        send(conn, ("hello", os.getpid()))
        device = rank_device(config.torch_device, rank)
        init_tp_group(rank, world_size, connect_store(store_port, world_size), device,
                      custom_all_reduce=config.enable_custom_all_reduce)
        in_group = True
        set_tp_state(rank, world_size)
        runner = build_rank_runner(replace(config, torch_device=device), rank, world_size, hooks=hooks)
        send(conn, ("ready", runner.num_blocks))
        _serve(conn, runner)
    except PeerFailure:
        code = 1
        try_send(conn, ("peer-failure",))
    except BaseException:
        code = 1
        try_send(conn, ("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        if in_group:
            destroy_tp_group()
        conn.close()
    # Skip the interpreter's and multiprocessing's teardown (about a second per worker,
    # measured here); there is nothing left to flush but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_rank_runner(config, rank: int, world_size: int, eos_token_ids: tuple = (), hooks=(),
                      link: RankLink | None = None) -> ModelRunner:
    """This rank's runner (TP state set, group joined); on failure the other ranks are told. `hooks` run
    first (a test seam: TPDriver.worker_hooks); `link` defaults to a worker's (build agreements only)."""
    link = link or RankLink(BuildSync(config.torch_device))
    try:
        for hook in hooks:
            hook()
        return ModelRunner(config, rank, world_size, eos_token_ids, link=link)
    except BaseException:
        link.sync.report_failure()
        raise


def _serve(conn, runner: ModelRunner) -> None:
    mirror = StepMirror()
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if message[0] == "step":
            runner.execute(mirror.apply(message[1]))
        elif message[0] == "close":
            return
        else:
            raise RuntimeError(f"unknown message {message[0]!r}")
