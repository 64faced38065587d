"""Rank 0's messages to the other ranks of a launched group, and their answers (the store is where answers go).

Messages go by broadcast over a gloo group of their own, made by the constructor: rank 0's process writes them
straight to the followers' sockets (no third process on the way, unlike the rendezvous store, whose server runs
in torchrun's agent), on the CPU for NCCL groups too. The group's timeout is long (`IDLE_WAIT`) because a
follower waits for rank 0's next message for as long as rank 0 has nothing to do (a server without traffic); a
peer that dies still fails the wait at once, since gloo sees its connection close, and a rank 0 that freezes or is
cut off (no connection closes) is caught by the heartbeat (heartbeat.py), which ends the waiting rank within its
bound. The year is never waited out.

Answers (a follower's reply to message i) go through the rendezvous store, `{prefix}/reply/{i}/{rank}`, where rank
0 collects them with a deadline (`replies`): a rank that does not answer is named instead of waited for.
"""

from __future__ import annotations

import datetime
import pickle

import torch.distributed as dist

# The control group's collective timeout: a follower's wait for rank 0's next message has no deadline of its own.
IDLE_WAIT = datetime.timedelta(days=365)


class ChannelClosed(RuntimeError):
    """Rank 0 (or the store) is gone: the job's other side has ended."""


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class StoreChannel:
    """Every rank makes one, right after joining the group (the constructor creates the gloo control group, a
    collective call); `store` is the rendezvous store, for the answers."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, prefix: str):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        self.store = store
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.sent = self.received = 0

    # -- rank 0 ---------------------------------------------------------------------------------
    def send(self, message) -> int:
        """Publish `message` to every follower; returns its index (1, 2, ...)."""
        self.sent += 1
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except RuntimeError as exc:
            raise ChannelClosed(f"rank 0 could not reach the other ranks ({_first_line(exc)})") from exc
        return self.sent

    def try_send(self, message) -> None:
        try:
            self.send(message)
        except ChannelClosed:
            pass

    def replies(self, index: int, timeout: float) -> dict[int, object]:
        """Every follower's reply to message `index`, or TimeoutError naming the ranks that did not answer."""
        ranks = list(range(1, self.world_size))
        keys = [f"{self.prefix}/reply/{index}/{r}" for r in ranks]
        if not keys:
            return {}
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout))
        except dist.DistNetworkError as exc:
            raise ChannelClosed(f"rank 0 lost the rendezvous store ({_first_line(exc)})") from exc
        except dist.DistStoreError:
            missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
            raise TimeoutError(f"tensor-parallel rank(s) {missing} did not answer rank 0 within {timeout:.0f} s "
                               "(stopped, or not making the same LLM call)") from None
        values = self.store.multi_get(keys)
        for key in keys:
            self.store.delete_key(key)
        return {r: pickle.loads(v) for r, v in zip(ranks, values)}

    # -- ranks 1..N-1 ---------------------------------------------------------------------------
    def recv(self):
        """Rank 0's next message (waits as long as it takes; ChannelClosed when rank 0 is gone)."""
        self.received += 1
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as exc:
            raise ChannelClosed(f"rank {self.rank} lost rank 0 ({_first_line(exc)}): the job's other side "
                                "has ended") from exc
        return box[0]

    def reply(self, index: int, value) -> None:
        try:
            self.store.set(f"{self.prefix}/reply/{index}/{self.rank}",
                           pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except dist.DistError as exc:
            raise ChannelClosed(f"rank {self.rank} lost the rendezvous store ({_first_line(exc)})") from exc
