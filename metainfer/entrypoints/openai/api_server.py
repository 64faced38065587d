"""The FastAPI app of the OpenAI-compatible server: assembly, auth, the small routes, and `serve`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], POST /tokenize, /detokenize
(vLLM's), GET /docs, /redoc, /openapi.json (all behind the optional bearer key; the docs can be turned off),
GET (or HEAD) /health (503 once the engine is gone), GET /metrics (Prometheus), GET /version; those three stay open, as
in vLLM.
POST bodies must be `application/json` (415 otherwise: a text/plain body is a CORS "simple request" a
web page could send to a key-less loopback server). All live requests share one continuously batched
engine, stepped by the engine core in its own process (engine_core.py; this process tokenizes, decodes and
frames: engine_loop.py). `serve` handles SIGTERM / SIGINT itself: new requests get
503, those in flight may finish for `shutdown_timeout` seconds, the rest end with a final error event,
and `serve` returns (so the caller's `close()` runs and the process exits 0).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from metainfer import __version__
from metainfer.config import ConfigError
from metainfer.engine.tokenizer import load_tokenizer
from metainfer.entrypoints.openai.engine_core import (
    EngineProcess,
    freeze_startup_heap,
    start_engine_process,
    start_engine_thread,
)
from metainfer.entrypoints.openai.engine_loop import EngineLoop
from metainfer.entrypoints.openai.errors import OpenAIError, add_exception_handlers, engine_dead
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.entrypoints.openai.serving_base import check_model
from metainfer.entrypoints.openai.serving_chat import OpenAIServingChat
from metainfer.entrypoints.openai.serving_completion import OpenAIServingCompletion
from metainfer.entrypoints.openai.serving_tokenize import OpenAIServingTokenization

log = logging.getLogger("metainfer.server")

# A POST body over this many MiB is a 413 (a 128k-token prompt is ~0.5 MB of text, ~1 MB as token ids)
DEFAULT_MAX_REQUEST_MB = 32.0


class OpenAIServer:
    """Everything one app serves from: the engine (its process or thread handle), this process's tokenizer,
    the engine loop, the metrics and the two endpoints."""

    def __init__(self, handle, served_model_names: list[str], api_key: str | None = None,
                 max_queued_requests: int | None = None, max_request_mb: float = DEFAULT_MAX_REQUEST_MB):
        self.handle = handle
        self.max_request_mb, self.max_request_bytes = max_request_mb, int(max_request_mb * 2**20)
        self.engine = handle.engine  # the LLMEngine where it runs in this process (a caller's LLM), else None
        info = handle.ready_info
        self.max_model_len, self.max_logprobs = info["max_model_len"], info["max_logprobs"]
        self.served_model_names = list(served_model_names)
        self.api_key = api_key
        self.metrics = ServerMetrics()
        tokenizer = load_tokenizer(info["model_dir"], info["gguf_file"], info["tokenizer"])  # this process's own
        self.engine_loop = EngineLoop(handle, tokenizer, self.metrics, max_queued_requests, self.max_model_len)
        self.completion = OpenAIServingCompletion(self.engine_loop, self.served_model_names, self.max_logprobs,
                                                  info["vocab_size"])
        self.chat = OpenAIServingChat(self.engine_loop, self.served_model_names, self.max_logprobs, info["vocab_size"])
        self.tokenization = OpenAIServingTokenization(self.engine_loop, self.served_model_names, self.max_logprobs,
                                                      self.max_model_len, info["vocab_size"])
        self.created = int(time.time())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.engine_loop.start(loop)

    def shutdown(self) -> None:
        self.engine_loop.stop()

    async def check_auth(self, request: Request) -> None:
        """With an API key set, /v1/*, /tokenize, /detokenize and the docs need 'Authorization: Bearer KEY' (compared
        in constant time)."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    async def require_json(self, request: Request) -> None:
        """POST bodies must say they are JSON: anything else is 415, before the body is read."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise OpenAIError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                              "invalid_request_error", None, "unsupported_media_type")

    async def limit_body(self, request: Request) -> None:
        """A POST body over max_request_bytes is a 413 before it is parsed or tokenized: by its Content-Length
        before it is read, or, sent in chunks without one, as soon as the chunks pass the cap (what was read is
        kept for the endpoint: Starlette's Request caches its body)."""
        cap = self.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit():
            if int(length) > cap:
                raise _too_large(self.max_request_mb)
            return
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise _too_large(self.max_request_mb)
            chunks.append(chunk)
        request._body = b"".join(chunks)

    def model_card(self, name: str) -> dict:
        # root is the served name too: the model's filesystem path is not the clients' business
        return {"id": name, "object": "model", "created": self.created, "owned_by": "metainfer",
                "root": name, "max_model_len": self.max_model_len}

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in self.served_model_names]})

    async def model(self, request: Request, model_id: str):
        return JSONResponse(self.model_card(check_model(self.served_model_names, model_id)))

    async def health(self, request: Request):
        if not self.engine_loop.alive:
            return engine_dead().response()
        return Response(status_code=200)

    async def version(self, request: Request):
        return JSONResponse({"version": __version__})

    async def prometheus(self, request: Request):
        return Response(self.metrics.render(self.served_model_names[0]),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def default_served_name(model: str) -> str:
    """The model id clients see when none is given: the folder's (or .gguf file's) name, never its path."""
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _too_large(cap_mb: float) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than the server's limit of {cap_mb:g} MiB "
                            "(metainfer serve --max-request-mb)", "invalid_request_error", None, "request_too_large")


def build_app(llm_or_kwargs, *, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              max_queued_requests: int | None = None, docs: bool = True,
              trust_request_chat_template: bool = False, max_request_mb: float = DEFAULT_MAX_REQUEST_MB) -> FastAPI:
    """The ASGI app. `llm_or_kwargs`: a dict of `LLM` keyword arguments (the server's way: the engine is built
    in its own process, started here; this returns once it is ready, CUDA graphs and warm-up done, and raises
    its build error: a ConfigError stays one; the process ends with the app), an `LLM` the caller built and
    keeps (its engine core runs in a thread of this process: same messages, shared GIL), or an `EngineProcess`
    already started and ready (its `ready_info` set). `docs=False` drops
    /docs, /redoc and /openapi.json (with an API key they need it, like /v1/*). `trust_request_chat_template`
    lets a request bring its own chat template (chat_template_kwargs.chat_template; refused otherwise). A POST body
    over `max_request_mb` MiB is a 413, before it is parsed."""
    if max_queued_requests is not None and max_queued_requests < 1:  # 0 would refuse every request
        raise ValueError(f"max_queued_requests must be >= 1 (None: no cap), got {max_queued_requests}")
    if not 0 < max_request_mb < math.inf:
        raise ValueError(f"max_request_mb must be > 0 and finite, got {max_request_mb}")
    engine = getattr(llm_or_kwargs, "llm_engine", None)
    skip = (llm_or_kwargs.get("skip_tokenizer_init") if isinstance(llm_or_kwargs, dict)
            else engine is not None and engine.config.skip_tokenizer_init)
    if skip:  # before an engine is built for it
        raise ConfigError("skip_tokenizer_init=True: the server needs a tokenizer (it encodes prompts, renders chat "
                          "templates and decodes the text it answers with); use it with the offline LLM or the benches")
    if isinstance(llm_or_kwargs, dict):
        handle = start_engine_process(llm_or_kwargs)
    elif isinstance(llm_or_kwargs, EngineProcess):  # a core the caller started and saw ready (tools/server_jitter)
        handle = llm_or_kwargs
    else:
        handle = start_engine_thread(llm_or_kwargs)
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [default_served_name(handle.ready_info["model"])])
    try:
        server = OpenAIServer(handle, names, api_key, max_queued_requests, max_request_mb)
    except BaseException:
        handle.stop(timeout=10)
        raise
    server.chat.trust_request_chat_template = trust_request_chat_template
    server.tokenization.trust_request_chat_template = trust_request_chat_template

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.shutdown()

    # FastAPI's own docs routes would be open to anyone: ours below sit behind the key
    app = FastAPI(title="MetaInfer OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    auth = [Depends(server.check_auth)]
    post = [*auth, Depends(server.require_json), Depends(server.limit_body)]
    app.add_api_route("/v1/completions", server.completion.create, methods=["POST"], dependencies=post)
    app.add_api_route("/v1/chat/completions", server.chat.create, methods=["POST"], dependencies=post)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"], dependencies=auth)
    app.add_api_route("/tokenize", server.tokenization.tokenize, methods=["POST"], dependencies=post)
    app.add_api_route("/detokenize", server.tokenization.detokenize, methods=["POST"], dependencies=post)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["HEAD"], include_in_schema=False)  # load balancers' probes
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    if docs:
        _add_docs(app, auth)
    add_exception_handlers(app)
    return app


def _add_docs(app: FastAPI, auth: list) -> None:
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    title = app.title

    async def openapi(request: Request):
        return JSONResponse(app.openapi())

    async def swagger(request: Request):
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} - Swagger UI")

    async def redoc(request: Request):
        return get_redoc_html(openapi_url="/openapi.json", title=f"{title} - ReDoc")

    for path, endpoint in (("/openapi.json", openapi), ("/docs", swagger), ("/redoc", redoc)):
        app.add_api_route(path, endpoint, methods=["GET"], dependencies=auth, include_in_schema=False)


class _Server(uvicorn.Server):
    """uvicorn with our shutdown: the first SIGTERM / SIGINT starts the drain; the signal is not re-raised
    after shutdown (uvicorn does that, and it kills the process before the caller's close() runs)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()
        if first:
            self._on_exit()


def serve(llm_or_kwargs, *, served_model_names: list[str], host: str, port: int, api_key: str | None = None,
          max_queued_requests: int | None = None, log_level: str = "info", access_log: bool = True,
          docs: bool = True, shutdown_timeout: float = 5.0, trust_request_chat_template: bool = False,
          max_request_mb: float = DEFAULT_MAX_REQUEST_MB) -> int | None:
    """Serve under uvicorn until SIGTERM / SIGINT: `llm_or_kwargs` as `build_app` takes it (engine keyword
    arguments: the engine process, ended here; an `LLM`: the caller keeps it). At the signal, requests in
    flight may finish for `shutdown_timeout` seconds; the rest end with a final error event (code
    server_shutdown); then this returns the engine process's exit code (0: it closed its engine; None for an
    `LLM`)."""
    app = build_app(llm_or_kwargs, served_model_names=served_model_names, api_key=api_key,
                    max_queued_requests=max_queued_requests, docs=docs,
                    trust_request_chat_template=trust_request_chat_template, max_request_mb=max_request_mb)
    engine_loop = app.state.server.engine_loop
    freeze_startup_heap()  # this process is the server from here on (engine_core.freeze_startup_heap says why)

    def on_exit() -> None:  # in the signal handler, on the event loop's thread
        log.info("shutting down: draining %d request(s) for up to %g s", engine_loop.num_in_flight,
                 shutdown_timeout)
        engine_loop.request_drain(shutdown_timeout)

    log.info("serving %s on http://%s:%d (max_model_len %d; engine pid %d)", served_model_names, host, port,
             app.state.server.max_model_len, app.state.server.handle.pid)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + 2)
    _Server(config, on_exit).run()
    process = app.state.server.handle.process
    return process.exitcode if process is not None else None
