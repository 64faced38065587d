"""The one thread that owns the engine, and the asyncio side that waits on it.

The engine is synchronous and not thread-safe, so ONE thread (`EngineLoop`) makes every engine
call: it drains a FIFO of add/abort commands, runs `step()` while anything is unfinished, and
sleeps on an Event when idle. Requests from all clients share its batches. Tokenization (text
prompts, chat templates) happens on this thread too, so the tokenizer is never used from two
threads at once.

HTTP handlers run on the asyncio loop. A handler submits its engine requests (one per prompt) as
a `RequestGroup`; a concurrent Future that the engine thread resolves says whether they were added
(a ValueError from `add_request` becomes a 400), and the engine's cumulative `RequestOutput`s reach
the group's asyncio.Queue through `loop.call_soon_threadsafe`. A group that is closed before its
requests finish (client gone, error) aborts them, which frees their KV blocks. A request that a
failed step was bisected to (LLMEngine fault isolation) ends with its own EngineError; the others go
on. At shutdown `drain` refuses new requests, waits for those in flight, then ends the rest.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import Any

from metainfer.entrypoints.openai.errors import OpenAIError, engine_dead, from_engine_error
from metainfer.entrypoints.openai.metrics import RequestTiming, ServerMetrics
from metainfer.sampling_params import SamplingParams

log = logging.getLogger("metainfer.server")

# (request id, prompt or a callable the engine thread turns into one, sampling params)
Item = tuple[str, Any, SamplingParams]


class EngineError(RuntimeError):
    """The engine raised while stepping; the affected requests were aborted."""

    status, code = 500, "engine_error"


class ServerShutdown(EngineError):
    """The server is shutting down and the request did not finish within the drain time."""

    status, code = 503, "server_shutdown"


class EngineLoop:
    """Owns the engine: every engine call happens on this one thread.

    The asyncio side (`submit`, the queue cap) lives here too, so that one object knows every
    request between its HTTP handler and the engine."""

    def __init__(self, engine, metrics: ServerMetrics, max_queued_requests: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.num_queued = 0  # requests without a first output yet; asyncio thread only
        self._commands: collections.deque = collections.deque()  # append/popleft are thread-safe
        self._wake = threading.Event()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._timing: dict[str, RequestTiming] = {}
        self._outbox: collections.deque = collections.deque()  # (sink, output) for the event loop to deliver
        self._flush_scheduled = False  # a _flush is queued on the event loop and has not started yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False  # shutting down: new requests get 503, in-flight ones may finish
        self._drain_task: asyncio.Task | None = None
        self.fatal: BaseException | None = None

    # called from the asyncio thread ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="metainfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    def add(self, items: list[Item], sink: asyncio.Queue) -> concurrent.futures.Future:
        """Queue engine requests (all or none are added); the Future resolves once they are."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append(("add", items, sink, future, time.monotonic()))
        self._wake.set()
        return future

    def abort(self, request_ids: list[str]) -> None:
        self._commands.append(("abort", request_ids))
        self._wake.set()

    @property
    def num_in_flight(self) -> int:
        """Engine requests with a waiting client (read from the asyncio thread; a dict's len is atomic)."""
        return len(self._sinks)

    def request_drain(self, timeout: float) -> None:
        """Start `drain` on the event loop; safe from a signal handler or another thread."""
        self.draining = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            def start():
                self._drain_task = loop.create_task(self.drain(timeout))
            loop.call_soon_threadsafe(start)

    async def drain(self, timeout: float) -> None:
        """Shutdown: refuse new requests, let those in flight finish for up to `timeout` seconds, then end
        the rest with a ServerShutdown (a stream's final event says so) so every connection closes."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while (self.num_in_flight or self._commands) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.num_in_flight or self._commands:
            self._commands.append(("fail_all", ServerShutdown("the server is shutting down; the request was "
                                                              f"not finished within {timeout:g} s")))
            self._wake.set()

    async def submit(self, items: list[Item]) -> RequestGroup:
        """Add one HTTP request's engine requests; 503 when the engine is down or the queue is full."""
        if not self.alive:
            raise engine_dead()
        if self.draining:
            raise OpenAIError(503, "the server is shutting down", "server_error", None, "server_shutdown")
        cap = self.max_queued_requests
        if cap is not None and self.num_queued + len(items) > cap:
            raise OpenAIError(503, f"the server's request queue is full ({cap} queued); retry later",
                              "server_error", None, "queue_full")
        group = RequestGroup(self, [item[0] for item in items])
        try:
            await asyncio.wrap_future(self.add(items, group.queue))
        except asyncio.CancelledError:
            group.close()
            raise
        except BaseException as exc:
            group.unfinished.clear()  # nothing was added
            group.close()
            raise from_engine_error(exc) from None
        return group

    # the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._drain()
                if self._stopping:
                    break
                if not self.engine.has_unfinished_requests():
                    self.metrics.publish(self.engine)
                    self._wake.wait()
                    continue
                self._step()
        except BaseException as exc:  # a bug in the loop itself: fail everything, stop serving
            log.exception("engine loop died")
            self.fatal = exc
            self._fail_all(EngineError(f"engine loop died: {exc!r}"))
            while self._commands:
                cmd = self._commands.popleft()
                if cmd[0] == "add" and cmd[3].set_running_or_notify_cancel():
                    cmd[3].set_exception(EngineError("engine is not running"))
        finally:
            for request_id in list(self._sinks):
                self.engine.abort_request(request_id)
            self._sinks.clear()
            self.metrics.publish(self.engine)

    def _drain(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "fail_all":
                self._fail_all(cmd[1])
            else:
                self._abort(cmd[1])

    def _add(self, items: list[Item], sink, future: concurrent.futures.Future, arrival: float) -> None:
        if not future.set_running_or_notify_cancel():
            return  # the handler went away before we got to it
        try:  # one client request: all or none, bounded together (LLMEngine.add_request_group)
            self.engine.add_request_group([(rid, prompt() if callable(prompt) else prompt, params)
                                           for rid, prompt, params in items])
        except BaseException as exc:
            future.set_exception(exc)
            return
        for request_id, _, _ in items:
            self._sinks[request_id] = sink
            self._timing[request_id] = RequestTiming(arrival)
        future.set_result(None)

    def _abort(self, request_ids) -> None:
        n = 0
        for request_id in request_ids:
            self._timing.pop(request_id, None)
            if self._sinks.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                n += 1
        if n:
            self.metrics.count_aborted(n)
            self.metrics.publish(self.engine)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; aborting the requests in flight")
            self.metrics.count_engine_error()
            self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        self.metrics.observe_outputs(outputs, self._timing, time.monotonic())
        deliveries = []
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if out.finished:
                self._timing.pop(out.request_id, None)
            if sink is not None:  # a request a failed step was bisected to ends with its own error
                deliveries.append((sink, out if out.error is None else EngineError(f"the request failed in the "
                                                                                   f"engine: {out.error}")))
        self.metrics.publish(self.engine, len(outputs))
        if deliveries:
            self._send(deliveries)

    def _send(self, deliveries) -> None:
        """Queue (sink, output) pairs for the event loop. One scheduled `_flush` drains the outbox, so a step
        whose predecessor's outputs are still undelivered adds no wake-up: each call_soon_threadsafe writes to
        the loop's socket and hands it the GIL, which cost the engine thread ~6 ms a step (CPU profile,
        tools/serve_overhead.py)."""
        self._outbox.extend(deliveries)
        if self._flush_scheduled:
            return
        self._flush_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _flush(self) -> None:
        """On the event loop: deliver everything queued (the flag is cleared first, so a later _send wakes us)."""
        self._flush_scheduled = False
        outbox = self._outbox
        while outbox:
            sink, item = outbox.popleft()
            sink.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        deliveries = []
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort after a failed step")
            deliveries.append((sink, exc))
        self._sinks.clear()
        self._timing.clear()
        if deliveries and self._loop is not None:
            self._send(deliveries)


class RequestGroup:
    """The engine requests of one HTTP request: their outputs, and cleanup on any exit."""

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str]):
        self.engine_loop = engine_loop
        self.ids = request_ids
        self.position = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.queued = set(request_ids)  # no output yet; counted against --max-queued-requests
        engine_loop.num_queued += len(request_ids)
        self.closed = False

    def _release(self, request_id: str) -> None:
        if request_id in self.queued:
            self.queued.discard(request_id)
            self.engine_loop.num_queued -= 1

    async def outputs(self):
        """Yield RequestOutputs (cumulative) until every request has finished. Outputs that queued up while
        the consumer was busy are coalesced to each request's latest (they are cumulative; vLLM's output
        collector does the same), so a consumer that falls behind frames one chunk a request, not one a token."""
        while self.unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            latest, error = {}, None
            for item in items:
                if isinstance(item, BaseException):
                    error = item
                    break
                latest[item.request_id] = item
            for item in latest.values():
                self._release(item.request_id)
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield item
            if error is not None:
                self.unfinished.clear()  # the engine already dropped them
                raise error

    def close(self) -> None:
        """Idempotent: abort what is still running (client gone, error) and fix the counters."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.queued):
            self._release(request_id)
        if self.unfinished:
            self.engine_loop.abort(sorted(self.unfinished))
            self.unfinished.clear()
