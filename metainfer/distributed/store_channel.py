"""Rank 0's messages to the other ranks of a launched group, carried by the rendezvous TCPStore.

Why the store and not a collective: a follower may wait for rank 0's next message for as long as rank 0 has
nothing to do (a server without traffic), which a collective's timeout would turn into a failure. A store
read waits as long as it must, and fails at once when the store goes away; the store lives in node 0's
torchrun agent (or, without an agent, in rank 0), so it goes when rank 0's side of the job ends.

Each message is one key, `{prefix}/{index}`, written once by rank 0 (`send`) and read by every follower in
index order (`recv`). A follower answers a message with a reply key `{prefix}/reply/{index}/{rank}`; rank 0
collects the answers with a deadline (`replies`). Rank 0 deletes a message once every follower has read it,
without asking: it calls `forget_through(i)` after completing a collective that each follower can only have
entered after reading message i (the forward of the step that message i carried).
"""

from __future__ import annotations

import datetime
import pickle

import torch.distributed as dist

# A follower's read gives up and retries after this long (a retry costs one line of c10d's log): the wait for
# rank 0's next message has no deadline of its own; it ends with the message, or when the store is gone.
IDLE_WAIT_S = 3600.0


class ChannelClosed(RuntimeError):
    """The store went away: rank 0's side of the job has ended."""


class StoreChannel:
    def __init__(self, host: str, port: int, rank: int, world_size: int, prefix: str):
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=IDLE_WAIT_S))
        self.sent = self.received = self.forgotten = 0

    def _key(self, index: int) -> str:
        return f"{self.prefix}/{index}"

    def _closed(self, exc: BaseException) -> ChannelClosed:
        return ChannelClosed(f"rank {self.rank} lost the rendezvous store, so rank 0's side of the job has ended "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")

    # -- rank 0 ---------------------------------------------------------------------------------
    def send(self, message) -> int:
        """Publish `message` to every follower; returns its index."""
        self.sent += 1
        try:
            self.store.set(self._key(self.sent), pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except dist.DistError as exc:
            raise self._closed(exc) from exc
        return self.sent

    def try_send(self, message) -> None:
        try:
            self.send(message)
        except ChannelClosed:
            pass

    def forget_through(self, index: int) -> None:
        """Delete messages up to `index`: the caller knows every follower has read them."""
        for i in range(self.forgotten + 1, index + 1):
            self.store.delete_key(self._key(i))
        self.forgotten = max(self.forgotten, index)

    def replies(self, index: int, timeout: float) -> dict[int, object]:
        """Every follower's reply to message `index`, or TimeoutError naming the ranks that did not answer."""
        ranks = list(range(1, self.world_size))
        keys = [f"{self.prefix}/reply/{index}/{r}" for r in ranks]
        if not keys:
            return {}
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout))
        except dist.DistNetworkError as exc:
            raise self._closed(exc) from exc
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
        """Rank 0's next message (waits as long as it takes; ChannelClosed when the store is gone)."""
        self.received += 1
        key = self._key(self.received)
        while True:
            try:
                return pickle.loads(self.store.get(key))
            except dist.DistNetworkError as exc:
                raise self._closed(exc) from exc
            except dist.DistStoreError:
                continue  # IDLE_WAIT_S without a message: keep waiting

    def reply(self, index: int, value) -> None:
        try:
            self.store.set(f"{self.prefix}/reply/{index}/{self.rank}",
                           pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except dist.DistError as exc:
            raise self._closed(exc) from exc
