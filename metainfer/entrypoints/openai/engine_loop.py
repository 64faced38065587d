"""The HTTP process's side of the engine: requests out to the engine core, token deltas back in, text made here.

The engine runs in its own process (`engine_core.py`: `EngineCore` over two pipes), so its step loop never waits
for the GIL held by JSON, SSE framing or detokenizing. `EngineLoop` lives on the asyncio loop: `submit`
tokenizes a request's prompts (text prompts and chat templates stay in this process) on a worker thread with a
tokenizer of its own (a long prompt or a slow template must not hold up every stream's SSE events; a Rust
tokenizer is not safe to share across threads), a request body over `LONG_REQUEST_BYTES` on a second one (so a
megabyte prompt, seconds of encoding, does not hold up every short request behind it), sends them as one "add"
(all or none; a ValueError in the engine comes back as a 400) and returns a `RequestGroup`. One reader
callback on the output pipe (`loop.add_reader`, no thread) takes each step's message: the new token ids of every
request it changed. It appends them to the request's `RequestState` and hands the state to its group's queue;
the consumer turns it into a cumulative `RequestOutput` when it reads it, detokenizing incrementally then, so a
consumer that falls behind decodes (and frames) one chunk a request, not one a token.

A group that closes before its requests finish (client gone, error) aborts them in the engine, which frees their
KV blocks. A request that a failed step was bisected to (LLMEngine fault isolation) ends with its own
EngineError; the others go on, but a client request's other prompts are aborted with it (the group closes). A step
that raised fails the requests the engine says it aborted (not one whose "add" it has not read yet). The engine
process dying (the output pipe closes) fails every request in flight and `alive` turns false (/health answers 503).
At shutdown `drain` refuses new requests, waits for those in flight, then ends the rest.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from metainfer.engine.llm_engine import tokenize_prompt
from metainfer.engine.request_validation import check_prompt_length
from metainfer.engine.sequence import DETOK_PROMPT_TAIL
from metainfer.engine.tokenizer import IncrementalDetokenizer
from metainfer.entrypoints.openai.errors import OpenAIError, engine_dead, from_engine_error
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.outputs import CompletionOutput, RequestOutput
from metainfer.sampling_params import SamplingParams

log = logging.getLogger("metainfer.server")

# (request id, prompt (text, token ids, a dict) or a callable that returns one, sampling params)
Item = tuple[str, Any, SamplingParams]

# A request body over this many bytes (~16k tokens of text, tens of ms to encode) is tokenized on the long lane
LONG_REQUEST_BYTES = 64 * 1024


class TokenizingLane:
    """One thread and a tokenizer of its own (a Rust tokenizer is not safe to share across threads); requests on a
    lane are tokenized in arrival order."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)


class EngineError(RuntimeError):
    """The engine raised while stepping (or died); the affected requests were aborted."""

    status, code = 500, "engine_error"


class ServerShutdown(EngineError):
    """The server is shutting down and the request did not finish within the drain time."""

    status, code = 503, "server_shutdown"


class ChoiceState:
    """One choice's tokens as received, and its text as decoded so far (the attributes `IncrementalDetokenizer`
    reads on a Sequence: the output tokens alone, so `num_prompt_tokens` is 0, and the prompt's last ids as
    `detok_prompt_tail`, shared by the request's choices, so the text is the engine's)."""

    __slots__ = ("index", "params", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
                 "output_text", "detok_prefix_offset", "detok_read_offset", "final_text", "detok_context",
                 "detok_prompt_tail")
    num_prompt_tokens = 0

    def __init__(self, index: int, params: SamplingParams, detok_prompt_tail: list[int] | tuple = ()):
        self.index, self.params, self.detok_prompt_tail = index, params, detok_prompt_tail
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = None
        self.finish_reason = self.stop_reason = None
        self.output_text = ""
        self.detok_prefix_offset = self.detok_read_offset = 0
        self.detok_context: list[int] | None = None  # chosen by the detokenizer on first use
        # the final text once known: the engine's (a request with stop strings) or decoded here, once
        self.final_text: str | None = None

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids


class RequestState:
    """One engine request as the HTTP process knows it: what arrived from the engine, its timing (`arrival`,
    `last_time`, `num_tokens`: what `ServerMetrics.observe` keeps up to date) and the group queue it is delivered
    to."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "choices", "finished", "num_cached_tokens", "sink",
                 "arrival", "last_time", "num_tokens", "prompt_logprobs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 sink: asyncio.Queue | None, arrival: float):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        tail = prompt_token_ids[-DETOK_PROMPT_TAIL:]  # once a request, not a copy of the prompt per token
        self.choices = [ChoiceState(i, params, tail) for i in range(params.n)]
        self.finished = False
        self.num_cached_tokens = 0
        self.sink = sink
        self.arrival, self.last_time, self.num_tokens = arrival, 0.0, 0
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    def apply(self, finished: bool, num_cached_tokens: int, seqs, prompt_logprobs=None) -> int:
        """Append one step's delta (engine_core's SeqDelta per choice, and the prompt logprobs in the first); return
        the most tokens a choice holds."""
        self.finished, self.num_cached_tokens = finished, num_cached_tokens
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        most = 0
        for choice, (ids, logprobs, cumulative, finish_reason, stop_reason, text) in zip(self.choices, seqs):
            choice.token_ids += ids
            if logprobs is not None and choice.logprobs is not None:
                choice.logprobs += logprobs
            choice.cumulative_logprob, choice.finish_reason, choice.stop_reason = cumulative, finish_reason, stop_reason
            if text is not None:
                choice.final_text = text
            most = max(most, len(choice.token_ids))
        return most

    def output(self, detokenizer: IncrementalDetokenizer) -> RequestOutput:
        """The cumulative output so far, decoding what is new. Its token and logprob lists are this state's own
        (no copy per token): read them before the next step's message is applied."""
        outs = []
        for c in self.choices:
            if c.finish_reason is not None:
                if c.final_text is None:  # once: the full decode is authoritative (held-back characters)
                    detokenizer.flush(c)
                    c.detok_read_offset = len(c.token_ids)
                    c.final_text = c.output_text
                c.output_text = c.final_text
            elif c.detok_read_offset < len(c.token_ids):
                detokenizer.update(c)
            outs.append(CompletionOutput(c.index, c.output_text, c.token_ids, c.cumulative_logprob, c.logprobs,
                                         c.finish_reason, c.stop_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             {"arrival_time": self.arrival, "num_cached_tokens": self.num_cached_tokens},
                             self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)


class EngineLoop:
    """The server's end of the engine core's pipes, on the asyncio loop: submit, abort, deliver, drain.

    `handle` is the `engine_core.EngineProcess` (process or thread) whose pipes this serves; `tokenizer` is this
    process's own tokenizer: the loop detokenizes with it, and each tokenizing lane's copy of it encodes the prompts
    and renders the chat templates on that lane's thread (a body over LONG_REQUEST_BYTES on the second lane, so
    requests under it do not queue behind it; a short body that is slow to encode still holds its own lane)."""

    def __init__(self, handle, tokenizer, metrics: ServerMetrics, max_queued_requests: int | None = None,
                 max_model_len: int | None = None):
        self.handle = handle
        self.max_model_len = max_model_len  # checked here too: a too long prompt is not shipped to be refused
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        # prompts are tokenized off the event loop: short requests on one lane, long ones on another
        self.lanes = (TokenizingLane(tokenizer, "metainfer-tokenize"),
                      TokenizingLane(tokenizer, "metainfer-tokenize-long"))
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.num_queued = 0  # requests without a first output yet
        self.num_admitting = 0  # requests accepted and being tokenized (not yet in num_queued)
        self._requests: dict[str, RequestState] = {}
        self._adds: dict[int, asyncio.Future] = {}
        self._group_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None  # why the engine is gone
        self.draining = False  # shutting down: new requests get 503, in-flight ones may finish
        self._drain_task: asyncio.Task | None = None
        # A thread writes to the engine's input pipe: a large prompt that does not fit the pipe's buffer must not
        # block the event loop (which would stop it reading the output pipe: the engine, blocked writing, would
        # never read ours).
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    # lifecycle --------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.handle.start()
        self._sender = threading.Thread(target=self._send_loop, name="metainfer-engine-input", daemon=True)
        self._sender.start()
        fd = self.handle.outputs.fileno()
        loop.add_reader(fd, self._on_readable)
        # uvloop (libuv) makes a watched fd non-blocking; Connection.recv must then not meet a message that has only
        # partly arrived (one over the pipe's 64 KiB buffer: a step with long prompt logprobs), which it reports as
        # BlockingIOError and leaves unreadable. Readiness says a message has begun, and the engine writes each one
        # whole, so a blocking read of its rest is short
        os.set_blocking(fd, True)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine: "stop" goes through the sender thread (the only writer of the input pipe, after what it
        still holds), and the engine's output is read (and dropped) until it ends, so an engine blocked writing
        output reaches "stop"; then the sender ends."""
        if self._loop is not None and not self._loop.is_closed() and self._dead is None:
            self._loop.remove_reader(self.handle.outputs.fileno())
        self._dead = self._dead or "the server stopped"
        sender = self._sender
        if sender is not None and sender.is_alive():
            self._outbox.put(("stop",))
            self._outbox.put(None)
            self.handle.stop(timeout, send_stop=False)
            sender.join(5)
        else:
            self.handle.stop(timeout)
        for lane in self.lanes:
            lane.executor.shutdown(wait=False, cancel_futures=True)

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self.handle.requests.send(msg)
            except Exception as exc:  # a closed pipe, or anything else: no later message could be sent either
                if not isinstance(exc, (OSError, ValueError)):
                    log.exception("sending to the engine failed")
                loop = self._loop
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(self._engine_gone, f"the engine's input pipe failed: "
                                                                 f"{type(exc).__name__}: {exc}")
                return

    @property
    def alive(self) -> bool:
        return self._dead is None and self.handle.alive

    @property
    def num_in_flight(self) -> int:
        """Engine requests with a waiting client."""
        return len(self._requests)

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
        while (self.num_in_flight or self._adds or self.num_admitting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.num_in_flight:
            try:
                self._send(("abort", list(self._requests)))
            except EngineError:
                pass  # the engine is gone: nothing holds their blocks
            self._fail_all(ServerShutdown(f"the server is shutting down; the request was not finished within "
                                          f"{timeout:g} s"))

    # requests -----------------------------------------------------------------------------------
    def lane(self, request_bytes: int) -> TokenizingLane:
        """The lane for a request body of `request_bytes`."""
        return self.lanes[request_bytes > LONG_REQUEST_BYTES]

    async def submit(self, items: list[Item], request_bytes: int = 0) -> RequestGroup:
        """Add one HTTP request's engine requests (its body `request_bytes` long: it picks the tokenizing lane);
        503 when the engine is down or the queue is full, 400 when a prompt or a value is refused (here or by the
        engine)."""
        self._check_admissible(len(items))
        self.num_admitting += len(items)  # held against the queue cap and waited for by drain while tokenizing
        lane = self.lane(request_bytes)
        try:
            prepared = await self._loop.run_in_executor(lane.executor, self._tokenize, lane.tokenizer, items)
        except asyncio.CancelledError:
            if self._dead is not None and not asyncio.current_task().cancelling():
                raise engine_dead() from None  # stop() cancelled the queued tokenizing, not the client
            raise
        finally:
            self.num_admitting -= len(items)
        if not self.alive:  # accepted before a drain began: it is still taken; a dead engine cannot
            raise engine_dead()
        group = RequestGroup(self, [p[0] for p in prepared])
        now = time.monotonic()
        for request_id, text, ids, params in prepared:
            self._requests[request_id] = RequestState(request_id, text, ids, params, group.queue, now)
        group_id = next(self._group_ids)
        future = self._loop.create_future()
        self._adds[group_id] = future
        try:
            self._send(("add", group_id, [(rid, {"prompt_token_ids": ids}, params)
                                          for rid, text, ids, params in prepared]))
            error = await future
        except asyncio.CancelledError:
            group.close()
            raise
        except BaseException:
            self._forget(group)
            raise
        finally:
            self._adds.pop(group_id, None)
        if error is not None:
            self._forget(group)
            kind, message, param = error
            if kind == "invalid":
                raise from_engine_error(_RefusedRequest(message, param)) from None
            raise OpenAIError(500, f"internal error: {message}", "server_error", None, "internal_error")
        return group

    async def run_tokenizer(self, fn: Callable, request_bytes: int = 0):
        """fn(tokenizer) on the lane for `request_bytes`, in order with its prompts, with that lane's tokenizer
        (/tokenize, /detokenize: a long text must not hold the event loop); any error it raises is a 400
        (from_engine_error)."""
        lane = self.lane(request_bytes)

        def call():
            try:
                return fn(lane.tokenizer)
            except Exception as exc:
                raise from_engine_error(exc) from None

        return await self._loop.run_in_executor(lane.executor, call)

    def _check_admissible(self, num_requests: int) -> None:
        """503 when the engine is gone, the server drains, or `num_requests` more would overfill the queue."""
        if not self.alive:
            raise engine_dead()
        if self.draining:
            raise OpenAIError(503, "the server is shutting down", "server_error", None, "server_shutdown")
        cap = self.max_queued_requests
        if cap is not None and self.num_queued + self.num_admitting + num_requests > cap:
            raise OpenAIError(503, f"the server's request queue is full ({cap} queued); retry later",
                              "server_error", None, "queue_full")

    def _tokenize(self, tokenizer, items: list[Item]) -> list[tuple[str, str | None, list[int], SamplingParams]]:
        """On a tokenizing lane's thread, with its `tokenizer`: each item's (request id, text, ids, params); a
        callable prompt (a chat template) is given that tokenizer. The first refused prompt raises its 400."""
        prepared = []
        for request_id, prompt, params in items:
            try:  # the engine process gets ids
                text, ids = tokenize_prompt(tokenizer, prompt(tokenizer) if callable(prompt) else prompt)
                if self.max_model_len is not None:
                    check_prompt_length(ids, self.max_model_len)
            except Exception as exc:
                raise from_engine_error(exc) from None
            prepared.append((request_id, text, ids, params))
        return prepared

    def _forget(self, group: RequestGroup) -> None:
        """Nothing of `group` was added: drop its states and release its queue slots."""
        for request_id in group.ids:
            self._requests.pop(request_id, None)
        group.unfinished.clear()
        group.close()

    def abort(self, request_ids: list[str]) -> None:
        n = sum(self._requests.pop(request_id, None) is not None for request_id in request_ids)
        if n:
            self.metrics.count_aborted(n)
            if self._dead is None:
                self._send(("abort", list(request_ids)))

    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineError(f"the engine is not running ({self._dead})")
        self._outbox.put(msg)

    # engine -> here ------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        """The output pipe has data: apply every message waiting (one a step), then return to the loop."""
        conn = self.handle.outputs
        try:
            while conn.poll():
                msg = conn.recv()
                kind = msg[0]
                if kind == "step":
                    self._on_step(msg[1], msg[2])
                elif kind == "added":
                    for group_id, error in msg[1]:
                        future = self._adds.get(group_id)
                        if future is not None and not future.done():
                            future.set_result(error)
                elif kind == "stats":
                    self.metrics.publish_stats(msg[1])
                elif kind == "step_failed":  # only the requests the engine had (an "add" may still be in the pipe)
                    self.metrics.publish_stats(msg[3])
                    self._fail(msg[2], EngineError(msg[1]))
        except (EOFError, OSError) as exc:
            self._engine_gone(f"the engine process exited ({type(exc).__name__})")

    def _on_step(self, deltas, stats) -> None:
        now = time.monotonic()
        requests, observe = self._requests, self.metrics.observe
        for request_id, finished, num_cached, error, seqs, prompt_logprobs in deltas:
            state = requests.pop(request_id, None) if finished else requests.get(request_id)
            if state is None:
                continue  # aborted here after the engine stepped it
            num_tokens = state.apply(finished, num_cached, seqs, prompt_logprobs)
            observe(state, num_tokens, finished, seqs[0][3], error is not None, now)
            if error is not None:  # a request a failed step was bisected to ends with its own error
                state.sink.put_nowait(EngineError(f"the request failed in the engine: {error}"))
            else:
                state.sink.put_nowait(state)
        self.metrics.publish_stats(stats)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail(list(self._requests), exc)

    def _fail(self, request_ids, exc: BaseException) -> None:
        """End these requests (those still here) with `exc`: one error per group."""
        sinks = {}
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is not None:
                sinks[id(state.sink)] = state.sink
        for sink in sinks.values():
            sink.put_nowait(exc)

    def _engine_gone(self, why: str) -> None:
        if self._dead is not None:
            return
        self._dead = why
        log.error("engine is gone: %s; failing %d request(s) in flight", why, len(self._requests))
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.handle.outputs.fileno())
        self.metrics.count_engine_error()
        self._fail_all(EngineError(f"the engine is not running: {why}"))
        for future in self._adds.values():
            if not future.done():
                future.set_exception(engine_dead())


class _RefusedRequest(ValueError):
    """The engine refused a request (its ValueError, rebuilt here): maps to a 400 naming `param`."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


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

    async def outputs(self, partial: bool = True):
        """Yield RequestOutputs (cumulative) until every request has finished. States that queued up while the
        consumer was busy are coalesced to each request's latest (vLLM's output collector does the same), and
        each is decoded only when yielded. `partial=False` (a non-streamed response) yields finished requests
        only: their text is decoded once, at the end, never step by step."""
        detokenizer = self.engine_loop.detokenizer
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
                elif not partial:
                    continue
                yield item.output(detokenizer)
            if error is not None:  # close() aborts the group's requests still running (an isolated fault's siblings)
                raise error

    def close(self) -> None:
        """Idempotent: abort what is still running (client gone, error) and fix the counters."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.queued):
            self._release(request_id)
        if self.unfinished:
            try:
                self.engine_loop.abort(sorted(self.unfinished))
            except EngineError:
                pass  # the engine is gone: nothing holds their blocks
            self.unfinished.clear()
