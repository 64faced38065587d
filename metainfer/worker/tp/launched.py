"""Tensor parallelism under an external launcher (`distributed_executor_backend="external_launcher"`):
torchrun starts every rank, each a process running the same script (SPMD), on one node or several.

Who decides: rank 0 runs the whole engine (scheduler, sampler, detokenizer) as in spawn mode; its link
(`LeaderLink`) sends each step's StepDelta (protocol.py) over the channel of distributed/store_channel.py (a gloo
broadcast; answers through the store) instead of a pipe. Ranks 1..N-1 build the same ModelRunner and replay rank
0's steps through a StepMirror, so every rank runs the same schedule and the same forwards; they never schedule
or sample. The sampled ids are rank 0's alone (broadcast, in effect, by the next step's delta), so no
determinism across ranks is assumed.

Calls. `LLM.generate` (and `chat`) on every rank is one call: rank 0 announces it with a fingerprint of its
arguments and every follower answers whether its own arguments are the same, or are invalid on their own (a
sampling_params list that does not match the prompts); on a difference or an invalid call on any rank, every rank
raises the same ValueError. Rank 0 then runs the call while the followers replay its steps; at the end they receive its
outputs (or its error, re-raised: a ValueError stays a ValueError), so every rank's generate returns the same
RequestOutputs. Commands (`metainfer serve`, `bench`, `generate`) run on rank 0 only; the followers `follow()`,
replaying steps and answering calls without comparing, until rank 0 closes.

Close: rank 0 sends ("close",); a follower whose script closes first reads on to it.

Faults. A rank that dies makes the others' next collective fail (gloo at once; NCCL after the process group's
timeout, `distributed_timeout_s`), and a follower waiting for rank 0's next message fails as soon as rank 0's
connection closes; each raises one RuntimeError naming the rank(s) that stopped (the heartbeat's `lost_ranks`
tells), without the transport's text. torchrun then stops the rest of its node. Where nothing waits on the dead
rank (rank 0 idle) or NCCL would wait out its timeout, or node 0's store is gone, the heartbeat
(distributed/heartbeat.py) ends the process within min(HEARTBEAT_S, distributed_timeout_s).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, is_dataclass, replace

import torch

from metainfer.config import EngineConfig
from metainfer.distributed.external_launcher import LauncherEnv, join_launched_group, read_launcher_env
from metainfer.distributed.heartbeat import Heartbeat
from metainfer.distributed.parallel_state import destroy_tp_group, tp_state
from metainfer.distributed.store_channel import ChannelClosed, StoreChannel
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.models.shape_contract import validate_tp_config
from metainfer.worker.model_runner import ModelRunner
from metainfer.worker.tp.driver import GroupUnusable
from metainfer.worker.tp.protocol import BuildSync, RankLink, StepEncoder, StepMirror
from metainfer.worker.tp.rank import build_rank_runner

log = logging.getLogger("metainfer")

HEARTBEAT_S = 30.0  # a rank silent this long (or distributed_timeout_s, if shorter) is dead


class LeaderLink(RankLink):
    """Rank 0's link: each step's delta goes to the followers before rank 0 runs the same batch."""

    def __init__(self, channel: StoreChannel, sync: BuildSync, lost_error):
        super().__init__(sync)
        self.channel = channel
        self.lost_error = lost_error  # LaunchedRank.lost_error
        self.encoder = StepEncoder()
        self.broken: str | None = None

    def check_usable(self) -> None:
        if self.broken is not None:
            raise GroupUnusable(f"the tensor-parallel group is unusable ({self.broken}); restart every rank")

    def publish(self, batch: ScheduledBatch) -> None:
        self.check_usable()
        self.channel.send(("step", self.encoder.encode(batch)))

    def step_failed(self, exc: BaseException) -> None:
        if isinstance(exc, GroupUnusable):
            return
        error = self.lost_error(exc, "a step")
        self.broken = str(error)
        if isinstance(exc, Exception):
            raise error from (None if error.lost else exc)


def call_fingerprint(args) -> list[str]:
    """One digest per argument (a prompt, its sampling params), independent of hash seeds and object ids."""
    def plain(obj):
        if is_dataclass(obj):
            return asdict(obj)
        if isinstance(obj, (set, frozenset)):
            return sorted(obj, key=repr)
        return repr(obj)

    return [hashlib.sha256(json.dumps(a, sort_keys=True, default=plain).encode()).hexdigest()[:16] for a in args]


def describe_difference(mine: list[str], rank0: list[str]) -> str | None:
    if len(mine) != len(rank0):
        return f"{len(mine) // 2} prompt(s) against rank 0's {len(rank0) // 2}"
    for i, (a, b) in enumerate(zip(mine, rank0)):
        if a != b:
            return f"{'prompt' if i % 2 == 0 else 'the sampling params of prompt'} {i // 2} differs from rank 0's"
    return None


class RankLostError(RuntimeError):
    """A launched rank's collective or message failed; `lost` are the ranks that stopped, where known."""

    def __init__(self, message: str, lost: list[int]):
        super().__init__(message)
        self.lost = lost


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _error_message(exc: BaseException) -> tuple:
    return ("error", type(exc).__name__, str(exc), isinstance(exc, ValueError))


def _rank0_error(kind: str, message: str, bad_input: bool) -> Exception:
    """Rank 0's error as the followers raise it: bad input stays a ValueError with the same message."""
    if bad_input:
        return ValueError(message)
    return RuntimeError(f"rank 0 failed: {kind}: {message}")


class LaunchedRank:
    """This process's rank of a launched group: joins it (before any weight is read), builds this rank's runner,
    then leads (rank 0) or follows. `LLMEngine` holds it as `engine.launcher`."""

    def __init__(self, config: EngineConfig, env: LauncherEnv | None = None):
        env = env or read_launcher_env()
        validate_tp_config(config.spec, config.tensor_parallel_size)
        self.config, self.env = config, env
        self.rank, self.world_size = env.rank, env.world_size
        self.is_leader = env.rank == 0
        if not self.is_leader:  # rank 0 alone reports progress; the others keep their errors
            logging.getLogger("metainfer").setLevel(logging.ERROR)
        self.device, store = join_launched_group(config, env)
        self._saved_threads = None
        if self.device.type == "cpu" and env.local_world_size > 1:  # the node's ranks share its cores (torchrun
            share = max(1, (os.cpu_count() or 1) // env.local_world_size)  # already sets OMP_NUM_THREADS=1)
            if torch.get_num_threads() > share:
                self._saved_threads = torch.get_num_threads()
                torch.set_num_threads(share)
        self.channel = StoreChannel(store, env.rank, env.world_size, f"{env.key_prefix}/msg")
        # a dead rank ends this one within dead_after_s even when no collective would notice (distributed/heartbeat.py)
        self.heartbeat = Heartbeat(env.master_addr, env.master_port, env.rank, env.world_size,
                                   f"{env.key_prefix}/heartbeat",
                                   dead_after_s=min(HEARTBEAT_S, config.distributed_timeout_s)).start()
        self.runner: ModelRunner | None = None
        self.link: RankLink | None = None
        self.mirror = StepMirror()
        self._closed = False
        self._followed_close = False

    def build_runner(self, eos_token_ids: tuple = ()) -> ModelRunner:
        """This rank's runner; every rank agrees it built (a rank that fails makes the others fail too)."""
        sync = BuildSync(self.device)
        self.link = LeaderLink(self.channel, sync, self.lost_error) if self.is_leader else RankLink(sync)
        config = replace(self.config, torch_device=self.device)
        try:
            with tp_state(self.rank, self.world_size):
                self.runner = build_rank_runner(config, self.rank, self.world_size, eos_token_ids, link=self.link)
        except BaseException:
            self.close()
            raise
        if self.is_leader:
            log.info("tensor parallel (external launcher): %d ranks (%s), %d KV blocks per rank", self.world_size,
                     "nccl" if self.device.type == "cuda" else "gloo", self.runner.num_blocks)
        return self.runner

    def warm_up(self) -> float:
        """Every rank's kernels compiled before the engine takes requests, as in spawn mode: rank 0 runs its
        runner's warm-up steps (each published to the others, which replay them), then sends ("warmed",); the
        seconds this rank spent. Called by every rank's LLMEngine right after build_runner."""
        if self.is_leader:
            try:
                seconds = self.runner.warm_up()
            except BaseException as exc:
                self.channel.try_send(_error_message(exc))
                raise
            self.channel.send(("warmed",))
            return seconds
        start = time.perf_counter()
        while True:
            message = self._recv()
            if message[0] == "step":
                self._step(message[1])
            elif message[0] == "warmed":
                return time.perf_counter() - start
            elif message[0] == "error":
                raise _rank0_error(*message[1:])
            else:
                raise RuntimeError(f"rank {self.rank} expected rank 0's warm-up steps but got {message[0]!r}")

    # -- faults ---------------------------------------------------------------------------------------
    def lost_error(self, exc: BaseException, what: str, suspect: int | None = None) -> RankLostError:
        """The one error this rank raises when `what` (a step, a message) failed: naming the ranks that stopped
        (asked of the heartbeat, ~2 beats; `suspect` where node 0's store is gone too), else this rank's own
        failure in one line."""
        lost = self.heartbeat.lost_ranks()
        if lost is None:
            lost = [suspect] if suspect is not None else []
        if lost:
            names = f"rank {lost[0]}" if len(lost) == 1 else f"ranks {lost}"
            return RankLostError(f"tensor-parallel {names} stopped; rank {self.rank} ends too (the group cannot go on "
                             "without it)", lost)
        return RankLostError(f"tensor-parallel rank {self.rank}: {what} failed ({_first_line(exc)}); another rank has "
                         "probably stopped", [])

    def _recv(self):
        try:
            return self.channel.recv()
        except ChannelClosed as exc:
            error = self.lost_error(exc.__cause__ or exc, "waiting for rank 0's next message", suspect=0)
            raise error from (None if error.lost else exc)

    # -- calls ----------------------------------------------------------------------------------------
    def call(self, args, run, invalid: str | None = None):
        """One LLM call made by every rank with the same `args`: rank 0 runs `run()`, the others replay it;
        every rank returns rank 0's result (or raises its error). `invalid`: why this rank's arguments are
        invalid on their own (every rank then raises the same ValueError)."""
        fingerprint = call_fingerprint(args)
        if self.is_leader:
            return self._lead(fingerprint, run, invalid)
        return self._follow_call(fingerprint, invalid)

    def _lead(self, fingerprint: list[str], run, invalid: str | None = None):
        self.link.check_usable()
        index = self.channel.send(("call", fingerprint))
        answers = self.channel.replies(index, self.config.distributed_timeout_s)
        problems = {r: a for r, a in answers.items() if a}
        if invalid is not None or problems:
            if invalid is not None:
                message = invalid
            else:
                rank, (kind, what) = min(problems.items())
                message = (f"{what} (on rank {rank}; every rank raises this)" if kind == "invalid" else
                           f"generate() got different arguments on rank {rank} ({what}); under the external "
                           "launcher every rank must pass the same prompts and sampling params")
            error = ValueError(message)
            self.channel.send(_error_message(error))
            raise error
        try:
            result = run()
        except BaseException as exc:
            self.channel.try_send(_error_message(exc))
            raise
        self.channel.send(("result", result))
        return result

    def _follow_call(self, fingerprint: list[str], invalid: str | None = None):
        message = self._recv()
        if message[0] != "call":
            raise RuntimeError(f"rank {self.rank} expected rank 0's generate call but got {message[0]!r}: every "
                               "rank must make the same LLM calls in the same order")
        different = describe_difference(fingerprint, message[1])
        answer = ("invalid", invalid) if invalid is not None else ("different", different) if different else None
        self.channel.reply(self.channel.received, answer)
        return self._replay(in_call=True)

    def follow(self) -> None:
        """Replay rank 0 until it closes (the followers of `metainfer serve`, `bench`, `generate`)."""
        if not self.is_leader:
            self._replay(in_call=False)

    def _replay(self, in_call: bool):
        while True:
            message = self._recv()
            kind = message[0]
            if kind == "step":
                self._step(message[1])
            elif kind == "call":  # rank 0 runs a call of its own (a command): nothing to compare
                self.channel.reply(self.channel.received, None)
            elif kind == "result" and in_call:
                return message[1]
            elif kind == "error" and in_call:
                raise _rank0_error(*message[1:])
            elif kind == "close":
                self._followed_close = True
                if in_call:
                    raise RuntimeError("rank 0 closed its engine during a generate call")
                return None

    def _step(self, delta) -> None:
        try:
            self.runner.execute(self.mirror.apply(delta))
        except Exception as exc:
            error = self.lost_error(exc, "a step")
            raise error from (None if error.lost else exc)

    # -- close --------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.heartbeat.stop()
        try:
            if self.is_leader:
                self.channel.send(("close",))
            elif not self._followed_close:
                self._drain_to_close()
        except Exception as exc:  # a rank already gone (its error was raised already): nothing left to hand over
            log.debug("external launcher: rank %d closed without the others (%s)", self.rank, exc)
        finally:
            destroy_tp_group()
            if self._saved_threads is not None:
                torch.set_num_threads(self._saved_threads)

    def _drain_to_close(self) -> None:
        """A follower that closes first (its script ended) reads on to rank 0's ("close",) and answers it."""
        while True:
            message = self.channel.recv()
            if message[0] == "close":
                return
            if message[0] == "call":
                self.channel.reply(self.channel.received, ("different", "its engine is closed"))
            elif message[0] == "step":
                raise RuntimeError(f"rank {self.rank} closed its engine while rank 0 still runs steps")


def follow_rank0(llm) -> bool:
    """For commands: on a follower of a launched group, replay rank 0 until it closes, close, and return True
    (the command then ends); elsewhere return False at once."""
    launcher = llm.llm_engine.launcher
    if launcher is None or launcher.is_leader:
        return False
    try:
        launcher.follow()
    finally:
        llm.close()
    return True
