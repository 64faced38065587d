"""The OpenAI server under test: run an app in a background uvicorn thread, read its metrics, post
raw bodies and check OpenAI error bodies. Shared by tests/entrypoints (and any test that needs a
live server)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from metainfer import SamplingParams

KEY = "sk-test-key"
MODEL = "tiny"


class ServerThread:
    """Run an app under uvicorn in a background thread on 127.0.0.1 (port 0: a free one)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
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


@contextmanager
def serving(llm, **app_kw) -> Iterator[ServerThread]:
    """`llm` served as MODEL by build_app(llm, **app_kw) in a ServerThread (its `app` and `state`, the app's
    server state, attached); on exit the server stops, then the LLM closes."""
    from metainfer.entrypoints.openai.api_server import build_app

    app = build_app(llm, served_model_names=[MODEL], **app_kw)
    srv = ServerThread(app).start()
    srv.app = app
    srv.state = app.state.server
    try:
        yield srv
    finally:
        srv.stop()
        llm.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def metrics(server) -> dict[str, float]:
    """Prometheus text -> {series: value}; series without labels other than model_name are
    also stored under their bare name."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        out[series] = float(value)
        name, _, labels = series.partition("{")
        if labels == f'model_name="{MODEL}"}}':
            out[name] = float(value)
    return out


def success(m: dict[str, float], reason: str) -> float:
    return m[f'metainfer:request_success_total{{model_name="{MODEL}",finished_reason="{reason}"}}']


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    """Wait until the engine holds no request, no KV block and no queued slot; return the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["metainfer:num_requests_running"] == 0 and m["metainfer:num_requests_waiting"] == 0
                and m["metainfer:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            assert idle, {k: v for k, v in m.items() if "num_requests" in k or "kv_cache" in k}
            if server.state.engine is not None:  # an LLM the test built: its engine runs in this process
                assert not server.state.engine.has_unfinished_requests()
            assert server.state.engine_loop.num_queued == 0
            return m
        time.sleep(0.05)


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    """POST a JSON body (or raw bytes) with the test key unless `headers` is given."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json", **(auth() if headers is None else headers)})


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`resp` is an OpenAI error body with this status (and param / code when given)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
