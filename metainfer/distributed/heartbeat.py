"""Liveness of the other ranks of a launched group, for the waits that nothing else bounds.

Each rank runs a daemon thread (`Heartbeat`) that bumps its own counter in the rendezvous store every
`interval_s` (a tenth of `dead_after_s`, between 0.2 and 1 s) and reads the others'. A rank whose counter has not
moved for `dead_after_s`, and which did not say it closed, is gone: the thread logs one error naming it and ends
this process as torchrun would (SIGTERM to itself: a server drains and closes, a script ends; `os._exit(1)` if the
process is still there after another `dead_after_s`, whatever its handler is doing), since a tensor-parallel group
with a dead rank cannot go on.

It covers what the collectives do not: rank 0 idle (a server without traffic) when a follower dies, and a NCCL
collective stuck on a dead peer until the process group's timeout. (A gloo collective fails at once, and a
follower waiting for rank 0's next message fails when rank 0's connection closes.) The thread has its own store
connection, so a main thread blocked in a collective does not block it. The store itself is watched too, by a
second thread (`_watch`): when no beat has gone through for `dead_after_s` (node 0 ended and its store refuses, or
node 0 is frozen or cut off: no connection closes, and a TCPStore `add` waits on regardless of its timeout), it ends
this rank the same way. A rank whose main thread noticed the fault first (its collective failed) has raised its own
error and closed by then, which stops both threads. So no wait of a launched rank outlasts about `dead_after_s` +
`interval_s` after the fault.

`lost_ranks` answers "who went?" for a rank whose collective just failed, so its error can name the rank.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import threading
import time

import torch.distributed as dist

log = logging.getLogger("metainfer")

STORE_LOST = ("tensor-parallel rank {rank} lost the rendezvous store (node 0 ended, frozen or unreachable) and ends "
              "(the group cannot go on without it)")


class Heartbeat:
    def __init__(self, host: str, port: int, rank: int, world_size: int, prefix: str, dead_after_s: float):
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.host, self.port = host, port
        self.dead_after_s = dead_after_s
        self.interval_s = min(1.0, max(0.2, dead_after_s / 10))
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=dead_after_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metainfer-heartbeat", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="metainfer-heartbeat-watch", daemon=True)
        self._last_beat = time.monotonic()
        self._ending, self._ended = threading.Lock(), False
        self._closed_marked = False

    def start(self) -> Heartbeat:
        self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
        atexit.register(self.stop)  # a script that ends without close() has not died
        self._thread.start()
        self._watcher.start()
        return self

    def stop(self) -> None:
        """This rank is closing: say so (the others stop watching it) and stop the thread."""
        self._stop.set()
        if not self._closed_marked:
            self._closed_marked = True
            try:
                self.store.set(f"{self.prefix}/closed/{self.rank}", "1")
            except dist.DistError:
                pass
        atexit.unregister(self.stop)

    def _run(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}
        try:
            while not self._stop.wait(self.interval_s):
                self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
                now = self._last_beat = time.monotonic()
                for r in others:
                    count = self.store.add(f"{self.prefix}/beat/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.dead_after_s and not self.store.check([f"{self.prefix}/closed/{r}"]):
                        if not self._stop.is_set():
                            self._end(f"tensor-parallel rank {r} stopped: no heartbeat for {now - seen[r][1]:.0f} s; "
                                      f"rank {self.rank} ends too (the group cannot go on without it)")
                        return
        except dist.DistError:  # node 0's store is gone: _watch ends the rank dead_after_s after the last beat
            return

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self._last_beat > self.dead_after_s:
                self._end(STORE_LOST.format(rank=self.rank))
                return

    def lost_ranks(self) -> list[int] | None:
        """The other ranks that are gone: their counter stays still over two beats and they did not close
        (waits up to ~2 `interval_s`). None where the store itself cannot be read (node 0's side has ended)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            store = dist.TCPStore(self.host, self.port, is_master=False,  # short: a gone store is an answer too
                                  timeout=datetime.timedelta(seconds=max(1.0, 2 * self.interval_s)))
            first = {r: store.add(f"{self.prefix}/beat/{r}", 0) for r in others}
            still = set(others)
            deadline = time.monotonic() + 2 * self.interval_s + 0.3
            while still and time.monotonic() < deadline:
                time.sleep(self.interval_s / 2)
                still = {r for r in still if store.add(f"{self.prefix}/beat/{r}", 0) == first[r]}
            return sorted(r for r in still if not store.check([f"{self.prefix}/closed/{r}"]))
        except dist.DistError:
            return None

    def _end(self, message: str) -> None:
        with self._ending:  # the beat and the watch thread may both see the fault: one error, one SIGTERM
            if self._ended:
                return
            self._ended = True
        log.error(message)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.dead_after_s)  # a handler that did not end the process in time (a close stuck on the store)
        os._exit(1)
