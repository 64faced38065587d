"""Tensor parallelism, rank 0's side: spawns and drives ranks 1..N-1.

Every rank, rank 0 included, runs the same ModelRunner (built as that rank); the row-parallel
all-reduces keep them in step and the LM head gathers the logits to rank 0, which alone samples.
`TPDriver` is rank 0's RankLink (worker/tp/protocol.py): it joins the build agreements and, each
step, sends the workers the step's delta before rank 0 runs the same batch.

Start: rank 0 waits for every worker's "hello" (a worker that dies while importing is reported at
once); all ranks join the TP group through rank 0's store (port picked by the OS) and build their
runner, agreeing twice (all-reduce MIN): "built", then the number of KV blocks, so a rank that fails
makes the others stop instead of wait. Each rank also checks its parameters against the per-rank
shape contract (models/shape_contract.py). Close: ("close",), workers leave the group and exit;
rank 0 joins them (terminate, then kill, if one does not exit). Workers also exit on EOF of their pipe
or when their parent process is gone, so a killed user process leaves no orphans; unclosed drivers
are shut down by a weakref finalizer (also at interpreter exit). No shared memory is used. On the CPU
every rank uses cpu_count // N torch threads while the group lives (oversubscribed OpenMP threads made
a tiny model 10x slower). Workers are started with `spawn`, so a user script that builds a TP engine
at import time needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import weakref
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from metainfer.config import EngineConfig
from metainfer.distributed.parallel_state import (
    DEFAULT_TIMEOUT,
    check_tp_start,
    create_store,
    destroy_tp_group,
    init_tp_group,
    rank_device,
    tp_state,
)
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.models.shape_contract import validate_tp_config
from metainfer.worker.model_runner import ModelRunner
from metainfer.worker.tp.protocol import BuildSync, PeerFailure, RankLink, StepEncoder, send
from metainfer.worker.tp.rank import build_rank_runner, worker_main

log = logging.getLogger("metainfer")


class _Workers:
    """Worker processes, their pipes and this process's membership of the TP group. Held apart
    from TPDriver so that the finalizer does not keep the driver alive."""

    def __init__(self):
        self.procs, self.conns, self.store, self.in_group = [], [], None, False
        self.errors: dict[int, str] = {}
        self.saved_threads: int | None = None
        self.broken = False  # a step failed midway: workers may be stuck in a collective

    def recv(self, rank: int, timeout: float) -> tuple:
        """The next message of worker `rank`, failing early if it dies."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.05):
            if not proc.is_alive() and not conn.poll(0):
                raise RuntimeError(f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code "
                                   f"{proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel worker {rank} sent nothing for {timeout:.0f} s")
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            raise RuntimeError(f"tensor-parallel worker {rank} closed its pipe") from None
        if message[0] == "peer-failure":
            raise RuntimeError(f"tensor-parallel worker {rank} stopped because another rank failed")
        if message[0] == "error":
            self.errors[rank] = message[1]
            raise RuntimeError(f"tensor-parallel worker {rank} failed:\n{message[1]}")
        return message

    def broadcast(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def collect_errors(self, wait: float = 5.0) -> str:
        """Tracebacks the workers sent after a failure (waits briefly for them)."""
        deadline = time.monotonic() + wait
        for rank, conn in enumerate(self.conns, start=1):
            while rank not in self.errors and time.monotonic() < deadline:
                try:
                    if conn.poll(0.05):
                        message = pickle.loads(conn.recv_bytes())
                        if message[0] != "error":
                            break  # this worker did not fail
                        self.errors[rank] = message[1]
                    elif not self.procs[rank - 1].is_alive():
                        break
                except (EOFError, OSError):
                    break
        return "\n".join(f"worker {r}:\n{tb}" for r, tb in sorted(self.errors.items()))

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                send(conn, ("close",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (1 if self.broken else 10)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if self.procs:
            log.info("tensor parallel: stopped %d worker(s), exit codes %s", len(self.procs),
                     [p.exitcode for p in self.procs])
        self.conns = []
        if self.in_group:
            destroy_tp_group()
            self.in_group = False
        self.store = None
        if self.saved_threads is not None:
            torch.set_num_threads(self.saved_threads)
            self.saved_threads = None


class GroupUnusable(RuntimeError):
    """A step refused because the group is closed or broken (nothing was sent)."""


class TPDriver(RankLink):
    """Rank 0 of a TP group (see the module docstring). `TPDriver(config).build_runner(eos)` returns
    rank 0's ModelRunner; `close()` stops the workers."""

    # Test seam: importable callables each worker process runs after joining the group and
    # before building its model (e.g. to inject a fault on every rank).
    worker_hooks: tuple = ()

    def __init__(self, config: EngineConfig):
        tp = config.tensor_parallel_size
        validate_tp_config(config.spec, tp)  # bad configurations fail before any worker starts
        check_tp_start(config.torch_device, tp)
        super().__init__(None)
        self.config, self.world_size = config, tp
        self._encoder = StepEncoder()
        self._closed = False
        self._broken: str | None = None
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.shutdown)
        try:
            self._start_workers(config)
        except BaseException:
            self._finalizer()
            raise

    def _start_workers(self, config: EngineConfig) -> None:
        tp, workers = self.world_size, self._workers
        ctx = mp.get_context("spawn")
        workers.store = create_store(tp)
        for rank in range(1, tp):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, name=f"metainfer-tp{rank}", daemon=True,
                               args=(rank, tp, workers.store.port, config, child_end, os.getpid(),
                                     tuple(self.worker_hooks)))
            proc.start()
            child_end.close()
            workers.procs.append(proc)
            workers.conns.append(parent_end)
        for rank in range(1, tp):
            workers.recv(rank, DEFAULT_TIMEOUT.total_seconds())  # "hello": the worker imported and is joining
        self.device = rank_device(config.torch_device, 0)
        if self.device.type == "cpu":  # N ranks share the cores; oversubscribed OpenMP threads crawl
            share = max(1, (os.cpu_count() or 1) // tp)
            if torch.get_num_threads() > share:
                workers.saved_threads = torch.get_num_threads()
                torch.set_num_threads(share)
        init_tp_group(0, tp, workers.store, self.device, custom_all_reduce=config.enable_custom_all_reduce)
        workers.in_group = True

    def build_runner(self, eos_token_ids: tuple = ()) -> ModelRunner:
        """Rank 0's runner, built alongside the workers' (their failures are reported with tracebacks)."""
        tp, workers = self.world_size, self._workers
        self.sync = BuildSync(self.device)
        try:
            with tp_state(0, tp):
                runner = build_rank_runner(replace(self.config, torch_device=self.device), 0, tp, eos_token_ids,
                                           link=self)
        except Exception as exc:
            errors = workers.collect_errors()
            self.close()
            if errors or isinstance(exc, PeerFailure):  # a worker's fault: show its traceback
                raise RuntimeError("tensor-parallel start-up failed on a worker:\n"
                                   + (errors or "(no traceback received)")) from exc
            raise  # rank 0's own error (the workers only stopped because of it)
        except BaseException:
            self.close()
            raise
        try:
            for rank in range(1, tp):
                _, blocks = workers.recv(rank, DEFAULT_TIMEOUT.total_seconds())
                if blocks != runner.num_blocks:
                    raise RuntimeError(f"worker {rank} allocated {blocks} KV blocks, rank 0 {runner.num_blocks}")
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (%s), %d KV blocks per rank", tp,
                 "nccl" if self.device.type == "cuda" else "gloo", runner.num_blocks)
        return runner

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    def publish(self, batch: ScheduledBatch) -> None:
        """Send the step's delta to every worker (rank 0 then runs the same batch)."""
        if self._closed:
            raise GroupUnusable("the tensor-parallel runner is closed")
        if self._broken is not None:
            raise GroupUnusable(f"the tensor-parallel group is unusable ({self._broken}); close the LLM and "
                                "create a new one")
        self._workers.broadcast(("step", self._encoder.encode(batch)))

    def step_failed(self, exc: BaseException) -> None:
        if isinstance(exc, GroupUnusable):
            return  # refused before anything was sent
        self._broken = f"a step failed: {type(exc).__name__}: {exc}"
        self._workers.broken = True
        if isinstance(exc, Exception):
            errors = self._workers.collect_errors(wait=2.0)
            if errors:
                raise RuntimeError(f"tensor-parallel step failed:\n{errors}") from exc

    def close(self) -> None:
        self._closed = True
        self._finalizer()
