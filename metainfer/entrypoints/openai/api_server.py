"""The FastAPI app of the OpenAI-compatible server: assembly, auth, the small routes, and `serve`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}] (all behind the
optional bearer key), GET /health (503 once the engine thread is gone), GET /metrics (Prometheus).
All live requests share one continuously batched engine, stepped by one `EngineLoop` thread.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from metainfer.entrypoints.openai.engine_loop import EngineLoop
from metainfer.entrypoints.openai.errors import OpenAIError, add_exception_handlers, engine_dead
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.entrypoints.openai.serving_base import check_model
from metainfer.entrypoints.openai.serving_chat import OpenAIServingChat
from metainfer.entrypoints.openai.serving_completion import OpenAIServingCompletion
from metainfer.llm import LLM

log = logging.getLogger("metainfer.server")


class OpenAIServer:
    """Everything one app serves from: the LLM, its engine thread, the metrics and the two endpoints."""

    def __init__(self, llm, served_model_names: list[str], api_key: str | None = None,
                 max_queued_requests: int | None = None, owns_llm: bool = False):
        self.llm = llm
        self.engine = llm.llm_engine
        self.served_model_names = list(served_model_names)
        self.api_key = api_key
        self.owns_llm = owns_llm
        self.metrics = ServerMetrics()
        self.engine_loop = EngineLoop(self.engine, self.metrics, max_queued_requests)
        self.completion = OpenAIServingCompletion(llm, self.engine_loop, self.served_model_names)
        self.chat = OpenAIServingChat(llm, self.engine_loop, self.served_model_names)
        self.created = int(time.time())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.engine_loop.start(loop)

    def shutdown(self) -> None:
        self.engine_loop.stop()
        if self.owns_llm:
            self.llm.close()

    async def check_auth(self, request: Request) -> None:
        """With an API key set, /v1/* needs 'Authorization: Bearer KEY' (compared in constant time)."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "metainfer",
                "root": self.engine.config.model, "max_model_len": self.engine.config.max_model_len}

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in self.served_model_names]})

    async def model(self, request: Request, model_id: str):
        return JSONResponse(self.model_card(check_model(self.served_model_names, model_id)))

    async def health(self, request: Request):
        if not self.engine_loop.alive:
            return engine_dead().response()
        return Response(status_code=200)

    async def prometheus(self, request: Request):
        return Response(self.metrics.render(self.served_model_names[0]),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(llm_or_kwargs, *, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              max_queued_requests: int | None = None) -> FastAPI:
    """The ASGI app. `llm_or_kwargs`: an `LLM` (the caller keeps ownership) or a dict of `LLM`
    keyword arguments (the app builds the LLM and closes it at shutdown)."""
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
    auth = [Depends(server.check_auth)]
    app.add_api_route("/v1/completions", server.completion.create, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", server.chat.create, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    add_exception_handlers(app)
    return app


def serve(llm, *, served_model_names: list[str], host: str, port: int, api_key: str | None = None,
          max_queued_requests: int | None = None, log_level: str = "info", access_log: bool = True) -> None:
    """Serve `llm` under uvicorn until interrupted (the caller keeps ownership of `llm`)."""
    app = build_app(llm, served_model_names=served_model_names, api_key=api_key,
                    max_queued_requests=max_queued_requests)
    log.info("serving %s on http://%s:%d (max_model_len %d)", served_model_names, host, port,
             llm.llm_engine.config.max_model_len)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
