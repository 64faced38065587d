"""`metainfer serve` run as a subprocess (tests and tools/measure_shutdown): wait for its /health, stop it with a
signal while a stream is open, or end it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, output: Callable[[], str] | None = None) -> None:
    """Poll http://127.0.0.1:`port`/health until it answers 200; raise RuntimeError with the server's output
    (`output()`, by default the rest of its stdout) if it exits first, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + (output() if output is not None else proc.stdout.read()))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server did not come up")
        time.sleep(0.25)


def stream_then_signal(port: int, model: str, max_tokens: int, send: Callable[[], None],
                       timeout: float) -> tuple[list[str], float]:
    """Open a completion stream (ignore_eos), call `send()` (the signal) after its first event and read the stream
    to its end; return its events (the `data: ` payloads) and the monotonic time `send` was called at."""
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        start = time.monotonic()
        send()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
    return events, start


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, up to 30 s for the exit, then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
