"""Tensor-parallel model runner: rank 0 in the user's process, ranks 1..N-1 in worker processes.

`TPModelRunner` has ModelRunner's interface for LLMEngine (`num_blocks`, `sampling_seqs`,
`execute(batch) -> logits`, `close`). Every rank, rank 0 included, holds a `RankModelRunner`
(a ModelRunner whose layers were built as that rank) and runs the same forward on the same
batch; the row-parallel all-reduces keep them in step and the LM head gathers logits to
rank 0, which alone samples.

Protocol (one duplex pipe per worker; messages are pickled tuples):
  start   worker -> ("hello", pid); rank 0 waits for every hello (a worker that dies while
          importing is reported at once), then all ranks join the TP group through rank 0's
          store (port picked by the OS) and build their model. Two agreements (all-reduce
          MIN of [ok, value]) follow: "built" and "num_blocks", so every rank allocates the
          same number of KV blocks and a rank that fails makes the others stop instead of
          wait. Each rank also checks its parameters against the per-rank shape contract
          (metainfer/models/shape_contract.py). worker -> ("ready", num_blocks), or
          ("error", traceback) / ("peer-failure",).
  step    rank 0 -> ("step", payload): per sequence (num_computed, num_scheduled, the
          scheduled token ids, block table, will_sample). Rank 0 sends it, then runs the same
          payload itself; workers rebuild a batch view and call ModelRunner.execute. No reply:
          the collectives inside the forward are the synchronisation.
  close   rank 0 -> ("close",); workers leave the group and exit; rank 0 joins them
          (terminate, then kill, if one does not exit).
Workers also exit when the pipe reaches EOF or their parent process is gone (a watchdog
thread polls the parent pid), so a killed user process leaves no orphans. Unclosed runners
are shut down by a weakref finalizer, which also runs at interpreter exit. No shared memory
is used, so none can leak. On the CPU every rank, rank 0 included, uses cpu_count // N torch
threads while the runner lives (oversubscribed OpenMP threads made a tiny model 10x slower).
Workers are started with `spawn`, so a user script that builds a TP engine at import time
needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist
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
from metainfer.engine.model_runner import ModelRunner
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.models.shape_contract import check_param_shapes, validate_tp_config

log = logging.getLogger("metainfer")


class PeerFailure(RuntimeError):
    """Another rank reported a failure while the model was being built."""


# -- the per-step batch description -----------------------------------------------------------
class _TokenWindow:
    """The tokens a step reads from one sequence: token_ids[start:start+n], indexed globally."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, key: slice) -> list[int]:
        if not isinstance(key, slice) or key.step is not None or (key.start or 0) < self.start:
            raise IndexError(f"a TP batch view holds tokens from position {self.start} on, not {key!r}")
        return self.tokens[key.start - self.start:key.stop - self.start]


class _SeqView:
    """What ModelRunner.prepare reads of a Sequence, rebuilt from the step payload."""

    __slots__ = ("num_computed_tokens", "num_scheduled_tokens", "token_ids", "block_table", "will_sample")

    def __init__(self, start: int, n: int, tokens: list[int], block_table: list[int], will_sample: bool):
        self.num_computed_tokens, self.num_scheduled_tokens = start, n
        self.token_ids = _TokenWindow(start, tokens)
        self.block_table, self.will_sample = block_table, will_sample


def encode_batch(batch: ScheduledBatch) -> tuple:
    """A small, picklable description of one step (only the scheduled tokens travel)."""
    seqs = []
    for s in batch.seqs:
        start, n = s.num_computed_tokens, s.num_scheduled_tokens
        seqs.append((start, n, s.token_ids[start:start + n], s.block_table, s.will_sample))
    return batch.is_prefill, seqs


def decode_batch(payload: tuple) -> ScheduledBatch:
    is_prefill, seqs = payload
    return ScheduledBatch([_SeqView(*s) for s in seqs], is_prefill)


# -- one rank's model runner -------------------------------------------------------------------
class _BuildSync:
    """The agreements every rank makes while building (all-reduce MIN of [ok, value])."""

    def __init__(self, device: torch.device):
        self.device, self.failed = device, False

    def agree(self, value: int, ok: bool = True) -> int:
        flags = torch.tensor([int(ok), value], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        ok_all, agreed = flags.tolist()
        if not ok_all:
            self.failed = True
            raise PeerFailure("a tensor-parallel rank failed while building the model")
        return agreed

    def report_failure(self) -> None:
        """Called by a rank that raised: join the agreement the others are heading to."""
        if not self.failed:
            try:
                self.agree(0, ok=False)
            except PeerFailure:
                pass


class RankModelRunner(ModelRunner):
    """ModelRunner of one TP rank: checks the shape contract, agrees on the KV pool size."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, sync: _BuildSync):
        self.rank, self.world_size, self._sync = rank, world_size, sync
        super().__init__(config)

    def _build_model(self):
        model = super()._build_model()
        check_param_shapes(model, self.spec, self.world_size, self.rank)
        self._sync.agree(1)  # "built": every rank loaded its shards
        return model

    def _decide_num_blocks(self) -> int:
        return self._sync.agree(super()._decide_num_blocks())  # the smallest pool fits every rank


def build_rank_runner(config: EngineConfig, rank: int, world_size: int, hooks=()) -> RankModelRunner:
    """Build this rank's runner (TP state already set, group joined); on failure tell the others.
    `hooks` run first (see TPModelRunner.worker_hooks)."""
    sync = _BuildSync(config.torch_device)
    try:
        for hook in hooks:
            hook()
        return RankModelRunner(config, rank, world_size, sync)
    except BaseException:
        sync.report_failure()
        raise


# -- rank 0 ------------------------------------------------------------------------------------
def _send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class _Workers:
    """Worker processes, their pipes and this process's membership of the TP group. Held apart
    from TPModelRunner so that the finalizer does not keep the runner alive."""

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
                _send(conn, ("close",))
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


class TPModelRunner:
    """Rank 0 of a TP group; spawns and drives ranks 1..N-1 (see the module docstring)."""

    # Test seam: importable callables each worker process runs after joining the group and
    # before building its model (e.g. to inject a fault on every rank).
    worker_hooks: tuple = ()

    def __init__(self, config: EngineConfig):
        tp = config.tensor_parallel_size
        validate_tp_config(config.spec, tp)  # bad configurations fail before any worker starts
        check_tp_start(config.torch_device, tp)
        self.config, self.world_size = config, tp
        self.runner: RankModelRunner | None = None
        self._broken: str | None = None
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.shutdown)
        try:
            self._start(config)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, config: EngineConfig) -> None:
        from metainfer.engine.worker import worker_main

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
        timeout = DEFAULT_TIMEOUT.total_seconds()
        for rank in range(1, tp):
            workers.recv(rank, timeout)  # "hello": the worker imported and is joining
        device = rank_device(config.torch_device, 0)
        if device.type == "cpu":  # N ranks share the cores; oversubscribed OpenMP threads crawl
            share = max(1, (os.cpu_count() or 1) // tp)
            if torch.get_num_threads() > share:
                workers.saved_threads = torch.get_num_threads()
                torch.set_num_threads(share)
        init_tp_group(0, tp, workers.store, device)
        workers.in_group = True
        try:
            with tp_state(0, tp):
                self.runner = build_rank_runner(replace(config, torch_device=device), 0, tp)
        except Exception as exc:
            errors = workers.collect_errors()
            if errors or isinstance(exc, PeerFailure):  # a worker's fault: show its traceback
                raise RuntimeError("tensor-parallel start-up failed on a worker:\n"
                                   + (errors or "(no traceback received)")) from exc
            raise  # rank 0's own error (the workers only stopped because of it)
        for rank in range(1, tp):
            _, blocks = workers.recv(rank, timeout)
            if blocks != self.runner.num_blocks:
                raise RuntimeError(f"worker {rank} allocated {blocks} KV blocks, rank 0 {self.runner.num_blocks}")
        self.num_blocks = self.runner.num_blocks
        self.model = self.runner.model
        log.info("tensor parallel: %d ranks (%s), %d KV blocks per rank", tp,
                 "nccl" if device.type == "cuda" else "gloo", self.num_blocks)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    sampling_seqs = staticmethod(ModelRunner.sampling_seqs)

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        self.runner.record_sampled(token_ids)

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Send the step to the workers, run it here too; rank 0's logits [sampling seqs, V]."""
        if self.runner is None:
            raise RuntimeError("the tensor-parallel runner is closed")
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel group is unusable ({self._broken}); close the LLM and "
                               "create a new one")
        payload = encode_batch(batch)
        try:
            self._workers.broadcast(("step", payload))
            return self.runner.execute(decode_batch(payload))
        except BaseException as exc:
            self._broken = f"a step failed: {type(exc).__name__}: {exc}"
            self._workers.broken = True
            if isinstance(exc, Exception):
                errors = self._workers.collect_errors(wait=2.0)
                if errors:
                    raise RuntimeError(f"tensor-parallel step failed:\n{errors}") from exc
            raise

    def close(self) -> None:
        self._finalizer()
        self.runner = self.model = None
