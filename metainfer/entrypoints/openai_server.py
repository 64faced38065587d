"""OpenAI-compatible HTTP server: FastAPI front end, one engine thread, continuous batching.

Threads and ownership:
- The engine is synchronous and not thread-safe, so ONE thread (`EngineLoop`) makes every
  engine call: it drains a FIFO of add/abort commands, runs `step()` while anything is
  unfinished, and sleeps on an Event when idle. Requests from all clients share its batches.
- HTTP handlers run on the asyncio loop. A handler submits its engine requests (one per
  prompt) with a concurrent Future that the engine thread resolves (a ValueError from
  `add_request` becomes a 400), and reads the engine's cumulative `RequestOutput`s from an
  asyncio.Queue that the engine thread feeds through `loop.call_soon_threadsafe`.
- Tokenization (text prompts, chat templates) happens in the engine thread too, so the
  tokenizer is never encoded from two threads at once.
- A client that goes away (streaming or not) has its unfinished engine requests aborted,
  which frees their KV blocks.

Streaming: text is sent as deltas of the cumulative output. When stop strings are set, the
last `len(longest stop) - 1` characters are held back until the request finishes, because the
engine may cut them off when the stop string completes; so the streamed text always equals
the non-streamed text.

Metrics (`GET /metrics`, Prometheus text format): vLLM's names under the `metainfer:` prefix.
TTFT and end-to-end latency count from the moment the handler submits the request. The
`metainfer:num_requests_running_max` gauge (peak batch) and the `metainfer:step_batch_size`
histogram (requests progressed per engine step) are our own and show that requests were batched;
`metainfer:request_aborted_total` counts requests aborted because their client went away.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from metainfer.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from metainfer.outputs import RequestOutput
from metainfer.sampling_params import SamplingParams

log = logging.getLogger("metainfer.server")

MAX_LOGPROBS = 20
# chat_template_kwargs may not override how the template is called
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})

# the first word of an engine / SamplingParams ValueError names the field
_PARAM_OF_MESSAGE = {name: name for name in (
    "prompt", "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "messages")}
_PARAM_OF_MESSAGE["prompt_token_ids"] = "prompt"


# -- errors ---------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An error answered as OpenAI's JSON body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, None)


def _from_engine_error(exc: BaseException) -> OpenAIError:
    """Map an exception raised while adding a request (tokenize, template, validate)."""
    if isinstance(exc, OpenAIError):
        return exc
    import jinja2

    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError)):
        msg = str(exc) or type(exc).__name__
        first_word = msg.split(" ", 1)[0]
        return _bad_request(msg, _PARAM_OF_MESSAGE.get(first_word))
    log.exception("adding a request failed", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


def _validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    if first.get("type") == "json_invalid":
        return _bad_request(f"request body is not valid JSON: {first['msg']}", None)
    loc = [str(x) for x in first.get("loc", ())]
    param = loc[0] if loc else None  # the top-level field, as OpenAI reports it
    where = f"field '{'.'.join(loc)}': " if loc else "request body: "
    return _bad_request(f"{where}{first['msg']}", param)


# -- metrics --------------------------------------------------------------------------------
class _Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1800)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    """Written by the engine thread, rendered by the HTTP thread (one lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.peak_running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.success: collections.Counter[str] = collections.Counter()
        self.aborted = 0
        self.engine_errors = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.batch = _Histogram(BATCH_BUCKETS)

    def render(self, model_name: str) -> str:
        label = f'model_name="{_escape(model_name)}"'
        out: list[str] = []

        def head(name, kind, text):
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        def gauge(name, value, text):
            head(name, "gauge", text)
            out.append(f"{name}{{{label}}} {_num(value)}")

        def counter(name, value, text):
            head(name, "counter", text)
            out.append(f"{name}{{{label}}} {_num(value)}")

        def histogram(name, h: _Histogram, text):
            head(name, "histogram", text)
            total = 0
            for bound, count in zip(h.buckets + (float("inf"),), h.counts):
                total += count
                le = "+Inf" if bound == float("inf") else _num(bound)
                out.append(f'{name}_bucket{{{label},le="{le}"}} {total}')
            out.append(f"{name}_sum{{{label}}} {_num(h.sum)}")
            out.append(f"{name}_count{{{label}}} {h.count}")

        with self.lock:
            gauge("metainfer:num_requests_running", self.running, "Sequences in the engine's running batch.")
            gauge("metainfer:num_requests_waiting", self.waiting, "Sequences waiting to be scheduled.")
            gauge("metainfer:kv_cache_usage_perc", self.kv_usage, "Fraction of KV cache blocks in use (0 to 1).")
            gauge("metainfer:num_requests_running_max", self.peak_running,
                  "Most requests running at once (or progressed in one step) since the server started.")
            counter("metainfer:prompt_tokens_total", self.prompt_tokens, "Prefill tokens computed.")
            counter("metainfer:generation_tokens_total", self.generation_tokens, "Tokens generated.")
            counter("metainfer:num_preemptions_total", self.preemptions, "Sequences preempted for KV space.")
            head("metainfer:request_success_total", "counter", "Requests finished, by finish reason.")
            for reason in sorted(set(self.success) | {"stop", "length"}):
                out.append(f'metainfer:request_success_total{{{label},finished_reason="{_escape(reason)}"}} '
                           f"{self.success[reason]}")
            counter("metainfer:request_aborted_total", self.aborted, "Requests aborted (client went away).")
            counter("metainfer:engine_errors_total", self.engine_errors, "Engine steps that raised.")
            histogram("metainfer:time_to_first_token_seconds", self.ttft, "Time to first token.")
            histogram("metainfer:inter_token_latency_seconds", self.itl, "Time between output tokens.")
            histogram("metainfer:e2e_request_latency_seconds", self.e2e, "Arrival to finish, per request.")
            histogram("metainfer:step_batch_size", self.batch, "Requests that progressed in one engine step.")
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


# -- the engine thread ----------------------------------------------------------------------
class _Timing:
    __slots__ = ("arrival", "last_time", "num_tokens")

    def __init__(self, arrival: float):
        self.arrival = arrival  # when the HTTP handler submitted it (time.monotonic, like the engine's)
        self.last_time = 0.0
        self.num_tokens = 0


class EngineError(RuntimeError):
    """The engine raised while stepping; the affected requests were aborted."""


class EngineLoop:
    """Owns the engine: every engine call happens on this one thread."""

    def __init__(self, llm, metrics: ServerMetrics):
        self.llm = llm
        self.engine = llm.llm_engine
        self.metrics = metrics
        self._commands: collections.deque = collections.deque()  # append/popleft are thread-safe
        self._wake = threading.Event()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._timing: dict[str, _Timing] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
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

    def add(self, items: list[tuple[str, Any, SamplingParams]], sink: asyncio.Queue) -> concurrent.futures.Future:
        """Queue engine requests (all or none are added); the Future resolves once they are."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append(("add", items, sink, future, time.monotonic()))
        self._wake.set()
        return future

    def abort(self, request_ids: list[str]) -> None:
        self._commands.append(("abort", request_ids))
        self._wake.set()

    # the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._drain()
                if self._stopping:
                    break
                if not self.engine.has_unfinished_requests():
                    self._publish()
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
            self._publish()

    def _drain(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])

    def _add(self, items, sink, future: concurrent.futures.Future, arrival: float) -> None:
        if not future.set_running_or_notify_cancel():
            return  # the handler went away before we got to it
        added = []
        try:
            for request_id, prompt, params in items:
                if callable(prompt):
                    prompt = prompt()
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except BaseException as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
            future.set_exception(exc)
            return
        for request_id in added:
            self._sinks[request_id] = sink
            self._timing[request_id] = _Timing(arrival)
        future.set_result(None)

    def _abort(self, request_ids) -> None:
        n = 0
        for request_id in request_ids:
            self._timing.pop(request_id, None)
            if self._sinks.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                n += 1
        if n:
            with self.metrics.lock:
                self.metrics.aborted += n
            self._publish()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; aborting the requests in flight")
            with self.metrics.lock:
                self.metrics.engine_errors += 1
            self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        now = time.monotonic()
        deliveries = []
        with self.metrics.lock:
            for out in outputs:
                self._observe(out, now)
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if out.finished:
                self._timing.pop(out.request_id, None)
            if sink is not None:
                deliveries.append((sink, out))
        self._publish(len(outputs))
        if deliveries:
            self._send(deliveries)

    def _send(self, deliveries) -> None:
        try:
            self._loop.call_soon_threadsafe(_deliver, deliveries)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _observe(self, out: RequestOutput, now: float) -> None:
        m, timing = self.metrics, self._timing.get(out.request_id)
        if timing is None:
            return
        num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        new = num_tokens - timing.num_tokens
        if new > 0:
            if timing.num_tokens == 0:
                first = out.metrics.get("first_token_time")
                m.ttft.observe((first if first is not None else now) - timing.arrival)
            else:
                gap = (now - timing.last_time) / new
                for _ in range(new):
                    m.itl.observe(gap)
            timing.last_time, timing.num_tokens = now, num_tokens
        if out.finished:
            finished = out.metrics.get("finished_time")
            m.e2e.observe((finished if finished is not None else now) - timing.arrival)
            m.success[out.outputs[0].finish_reason or "unknown"] += 1  # per request, as vLLM counts

    def _publish(self, batch_size: int | None = None) -> None:
        engine = self.engine
        running = engine.num_running()
        with self.metrics.lock:
            m = self.metrics
            m.running, m.waiting, m.kv_usage = running, engine.num_waiting(), engine.kv_cache_usage()
            m.prompt_tokens = engine.stats.get("prompt_tokens", 0)
            m.generation_tokens = engine.stats.get("generation_tokens", 0)
            m.preemptions = getattr(engine.scheduler, "num_preemptions", 0)
            m.peak_running = max(m.peak_running, running, batch_size or 0)
            if batch_size:
                m.batch.observe(batch_size)

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


def _deliver(items) -> None:
    for sink, item in items:
        sink.put_nowait(item)


# -- one HTTP request's engine requests -----------------------------------------------------
class _Group:
    """The engine requests of one HTTP request: their outputs, and cleanup on any exit."""

    def __init__(self, server: OpenAIServer, request_ids: list[str]):
        self.server = server
        self.ids = request_ids
        self.position = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.queued = set(request_ids)  # no output yet; counted against --max-queued-requests
        server.num_queued += len(request_ids)
        self.closed = False

    def _release(self, request_id: str) -> None:
        if request_id in self.queued:
            self.queued.discard(request_id)
            self.server.num_queued -= 1

    async def outputs(self):
        """Yield each RequestOutput (cumulative) until every request has finished."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.unfinished.clear()  # the engine already dropped them
                raise item
            self._release(item.request_id)
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Idempotent: abort what is still running (client gone, error) and fix the counters."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.queued):
            self._release(request_id)
        if self.unfinished:
            self.server.engine_loop.abort(sorted(self.unfinished))
            self.unfinished.clear()


class _EventStream(StreamingResponse):
    """An SSE response that always runs `on_close` (client gone, cancelled, or done)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the server -----------------------------------------------------------------------------
class OpenAIServer:
    def __init__(self, llm, served_model_names: list[str], api_key: str | None = None,
                 max_queued_requests: int | None = None, owns_llm: bool = False):
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.served_model_names = list(served_model_names)
        self.api_key = api_key
        self.max_queued_requests = max_queued_requests
        self.owns_llm = owns_llm
        self.metrics = ServerMetrics()
        self.engine_loop = EngineLoop(llm, self.metrics)
        self.num_queued = 0  # asyncio thread only
        self.created = int(time.time())

    # lifecycle
    def start(self, loop) -> None:
        self.engine_loop.start(loop)

    def shutdown(self) -> None:
        self.engine_loop.stop()
        if self.owns_llm:
            self.llm.close()

    # checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                              "model_not_found")
        return model

    @staticmethod
    async def parse(request: Request, model: type[BaseModel]):
        body = await request.body()
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    async def submit(self, items: list[tuple[str, Any, SamplingParams]]) -> _Group:
        if not self.engine_loop.alive:
            raise OpenAIError(503, "the engine is not running", "server_error", None, "engine_dead")
        cap = self.max_queued_requests
        if cap is not None and self.num_queued + len(items) > cap:
            raise OpenAIError(503, f"the server's request queue is full ({cap} queued); retry later",
                              "server_error", None, "queue_full")
        group = _Group(self, [item[0] for item in items])
        try:
            await asyncio.wrap_future(self.engine_loop.add(items, group.queue))
        except asyncio.CancelledError:
            group.close()
            raise
        except BaseException as exc:
            group.unfinished.clear()  # nothing was added
            group.close()
            raise _from_engine_error(exc) from None
        return group

    async def collect(self, group: _Group, request: Request) -> dict[str, RequestOutput] | None:
        """Wait for the final outputs; None if the client disconnected first."""
        finals: dict[str, RequestOutput] = {}

        async def consume():
            async for out in group.outputs():
                if out.finished:
                    finals[out.request_id] = out

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (consumer, watcher):
                if not task.done():
                    task.cancel()
        if consumer in done:
            exc = consumer.exception()
            if exc is not None:
                raise OpenAIError(500, str(exc), "server_error", None, "engine_error")
            return finals
        return None

    # -- pieces shared by both endpoints ----------------------------------------------------
    @staticmethod
    def sampling_params(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if req.logit_bias:
            raise _bad_request("logit_bias is not supported", "logit_bias")
        kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=req.ignore_eos,
                                  min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "stop_token_ids"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as exc:
            raise _from_engine_error(exc) from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def choice_logprobs(self, token_ids: list[int], dicts: list[dict[int, float]], text_offset: int) -> dict:
        """Completions-style logprobs for some output tokens."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, d in zip(token_ids, dicts):
            text = self.token_text(tid)
            tokens.append(text)
            token_logprobs.append(d.get(tid))
            top.append({self.token_text(t): lp for t, lp in sorted(d.items(), key=lambda kv: -kv[1])})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], dicts: list[dict[int, float]], k: int) -> list[dict]:
        content = []
        for tid, d in zip(token_ids, dicts):
            text = self.token_text(tid)
            ranked = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": text, "logprob": d.get(tid), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": (s := self.token_text(t)), "logprob": lp,
                                              "bytes": list(s.encode())} for t, lp in ranked]})
        return content

    @staticmethod
    def usage(finals: dict[str, RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- /v1/completions ----------------------------------------------------------------------
    async def completions(self, request: Request):
        self.check_auth(request)
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        model = self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise _bad_request("prompt must not be empty", "prompt")
        if req.suffix:
            raise _bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise _bad_request("best_of other than n is not supported", "best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise _bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
        if req.echo and req.logprobs is not None:
            raise _bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        base = f"cmpl-{uuid.uuid4().hex}"
        items = [(f"{base}-{i}", p if isinstance(p, str) else {"prompt_token_ids": p}, params)
                 for i, p in enumerate(prompts)]
        group = await self.submit(items)
        created = int(time.time())
        if req.stream:
            head, finals, include_usage = self._stream_head(req, base, "text_completion", created, model)
            return self._event_stream(group, self._completion_chunks(group, req, params, head, finals), head, finals,
                                      include_usage)
        try:
            finals = await self.collect(group, request)
        finally:
            group.close()
        if finals is None:
            return Response(status_code=499)
        choices = []
        for rid in group.ids:
            out = finals[rid]
            prefix = self._prompt_text(out) if req.echo else ""
            for c in out.outputs:
                logprobs = (self.choice_logprobs(c.token_ids, c.logprobs or [], len(prefix))
                            if req.logprobs is not None else None)
                choices.append({"index": group.position[rid] * req.n + c.index, "text": prefix + c.text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": self.usage(finals)})

    @staticmethod
    def _stream_head(req, base: str, obj: str, created: int, model: str) -> tuple[dict, dict, bool]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": base, "object": obj, "created": created, "model": model}
        if include_usage:
            head["usage"] = None  # OpenAI's chunks carry usage: null until the last one
        return head, {}, include_usage

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    async def _pieces(self, group: _Group, n: int, params: SamplingParams, echo: bool, want_tokens: bool,
                      finals: dict[str, RequestOutput]):
        """What is new per choice since its last yield: (choice, index, text, first new token).

        Text a stop string may still cut off (the last len(longest stop) - 1 characters) is held
        back until the choice finishes; a finished choice is yielded once, with finish_reason."""
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        sent: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        async for out in group.outputs():
            finals[out.request_id] = out
            for c in out.outputs:
                index = group.position[out.request_id] * n + c.index
                if index in done:
                    continue
                finished = c.finish_reason is not None
                start, first = sent.get(index, 0), sent_tokens.get(index, 0)
                end = len(c.text) if finished else max(start, len(c.text) - hold)
                text = c.text[start:end]
                if echo and index not in sent:
                    text = self._prompt_text(out) + text
                if not text and not finished and not (want_tokens and len(c.token_ids) > first):
                    continue
                sent[index], sent_tokens[index] = end, len(c.token_ids)
                if finished:
                    done.add(index)
                yield c, index, text, first

    def _event_stream(self, group: _Group, chunks, head: dict, finals: dict, include_usage: bool) -> _EventStream:
        """SSE framing for both endpoints: the chunks, an error event if the engine failed, the
        usage chunk (stream_options.include_usage), then [DONE]; the group is always released."""

        async def events():
            try:
                try:
                    async for obj in chunks:
                        yield _sse(obj)
                except EngineError as exc:
                    yield _sse(OpenAIError(500, str(exc), "server_error", None, "engine_error").body())
                else:
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": self.usage(finals)})
                yield "data: [DONE]\n\n"
            finally:
                group.close()

        return _EventStream(events(), group.close)

    async def _completion_chunks(self, group: _Group, req: CompletionRequest, params, head: dict, finals: dict):
        offsets: dict[int, int] = {}
        want_logprobs = req.logprobs is not None
        async for c, index, text, first in self._pieces(group, req.n, params, req.echo, want_logprobs, finals):
            logprobs = None
            if want_logprobs:
                logprobs = self.choice_logprobs(c.token_ids[first:], (c.logprobs or [])[first:], offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(text)
            yield {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat_completions(self, request: Request):
        self.check_auth(request)
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        model = self.check_model(req.model)
        if req.tools:
            raise _bad_request("tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise _bad_request("response_format other than text is not supported", "response_format")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise _bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise _bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        template_kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(template_kwargs))
        if reserved:
            raise _bad_request(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        top_k = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, top_k if req.logprobs else None)
        conversation = req.conversation()
        llm, add_generation_prompt = self.llm, req.add_generation_prompt

        def prompt():  # runs on the engine thread (the tokenizer's only encoder)
            ids = llm.apply_chat_template(conversation, template_kwargs, add_generation_prompt)
            return {"prompt_token_ids": ids}

        base = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.submit([(base, prompt, params)])
        created = int(time.time())
        if req.stream:
            head, finals, include_usage = self._stream_head(req, base, "chat.completion.chunk", created, model)
            return self._event_stream(group, self._chat_chunks(group, req, params, head, finals, top_k), head,
                                      finals, include_usage)
        try:
            finals = await self.collect(group, request)
        finally:
            group.close()
        if finals is None:
            return Response(status_code=499)
        out = finals[base]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": ({"content": self.chat_logprobs(c.token_ids, c.logprobs or [], top_k)}
                                 if req.logprobs else None),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return JSONResponse({"id": base, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": self.usage(finals)})

    async def _chat_chunks(self, group: _Group, req: ChatCompletionRequest, params, head: dict, finals: dict,
                           top_k: int):
        for index in range(req.n):
            yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        async for c, index, text, first in self._pieces(group, req.n, params, False, req.logprobs, finals):
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self.chat_logprobs(c.token_ids[first:], (c.logprobs or [])[first:], top_k)}
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            yield {**head, "choices": [choice]}

    # -- the rest ---------------------------------------------------------------------------
    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "metainfer",
                "root": self.engine.config.model, "max_model_len": self.engine.config.max_model_len}

    async def models(self, request: Request):
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in self.served_model_names]})

    async def model(self, request: Request, model_id: str):
        self.check_auth(request)
        return JSONResponse(self.model_card(self.check_model(model_id)))

    async def health(self, request: Request):
        if not self.engine_loop.alive:
            return OpenAIError(503, "the engine is not running", "server_error", None, "engine_dead").response()
        return Response(status_code=200)

    async def prometheus(self, request: Request):
        return Response(self.metrics.render(self.served_model_names[0]),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(llm_or_kwargs, *, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              max_queued_requests: int | None = None) -> FastAPI:
    """The ASGI app. `llm_or_kwargs`: an `LLM` (the caller keeps ownership) or a dict of `LLM`
    keyword arguments (the app builds the LLM and closes it at shutdown)."""
    from metainfer.llm import LLM

    owns = isinstance(llm_or_kwargs, dict)
    llm = LLM(**llm_or_kwargs) if owns else llm_or_kwargs
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [llm.llm_engine.config.model])
    server = OpenAIServer(llm, names, api_key, max_queued_requests, owns_llm=owns)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.shutdown()

    app = FastAPI(title="MetaInfer OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error", None,
                           "internal_error").response()

    return app


class ServerThread:
    """Run an app under uvicorn in a background thread on 127.0.0.1 (tests, notebooks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
