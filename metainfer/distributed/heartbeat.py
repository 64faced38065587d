"""Liveness of the other ranks of a launched group, for the waits that nothing else bounds.

Each rank runs a daemon thread (`Heartbeat`) that bumps its own counter in the rendezvous store every
`dead_after_s / 10` and reads the others'. A rank whose counter has not moved for `dead_after_s`, and which did not
say it closed, is gone: the thread logs one error naming it and ends this process as torchrun would (SIGTERM to
itself: a server drains and closes, a script ends; `os._exit(1)` if the process is still there after another
`dead_after_s`), since a tensor-parallel group with a dead rank cannot go on.

It covers what the collectives do not: rank 0 idle (a server without traffic) when a follower dies, and a NCCL
collective stuck on a dead peer until the process group's timeout. (A gloo collective fails at once, and a
follower waiting for rank 0's next message fails when rank 0's connection closes.) The thread has its own store
connection, so a main thread blocked in a collective does not block it. If the store itself goes (node 0's side
of the job has ended), the thread stops without acting: the rank's next collective or message says so.
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


class Heartbeat:
    def __init__(self, host: str, port: int, rank: int, world_size: int, prefix: str, dead_after_s: float):
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.dead_after_s = dead_after_s
        self.interval_s = max(0.2, dead_after_s / 10)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=dead_after_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metainfer-heartbeat", daemon=True)
        self._closed_marked = False

    def start(self) -> Heartbeat:
        self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
        atexit.register(self.stop)  # a script that ends without close() has not died
        self._thread.start()
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
                now = time.monotonic()
                for r in others:
                    count = self.store.add(f"{self.prefix}/beat/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.dead_after_s and not self.store.check([f"{self.prefix}/closed/{r}"]):
                        if not self._stop.is_set():
                            self._end(r, now - seen[r][1])
                        return
        except dist.DistError:  # the store is gone: node 0's side has ended; the rank's next collective says so
            return

    def _end(self, dead: int, silent_s: float) -> None:
        message = (f"tensor-parallel rank {dead} stopped: no heartbeat for {silent_s:.0f} s; rank {self.rank} "
                   "ends too (the group cannot go on without it)")
        log.error(message)
        os.kill(os.getpid(), signal.SIGTERM)
        if not self._stop.wait(self.dead_after_s):  # a handler that did not end the process in time
            os._exit(1)
