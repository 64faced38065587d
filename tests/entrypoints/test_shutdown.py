"""`metainfer serve` under SIGTERM / SIGINT with a stream open: the stream ends with a final error event
(code server_shutdown) and [DONE] instead of a broken read, the engine is closed, the process exits 0
within a bounded time, and tensor-parallel workers end with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.test_serve_cli import ROOT
from tests.helpers.processes import wait_gone
from tests.helpers.server import free_port


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (the TP workers and multiprocessing's helpers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        out += kids
        frontier += kids
    return out


def start_server(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", model_dir, "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--served-model-name", "tiny", "--log-level", "info",
           "--no-access-log", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.25)


def stop_and_time(proc: subprocess.Popen, port: int, sig: int, max_tokens: int = 480) -> tuple[list[str], float]:
    """Open a long stream, send `sig` after its first token; return the stream's events and the seconds
    from the signal to the process's exit."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        start = time.monotonic()
        proc.send_signal(sig)
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
    proc.wait(timeout=60)
    return events, time.monotonic() - start


@pytest.mark.slow  # starts a server process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_ends_streams_with_a_final_event_and_exits_0(model_dir, sig):
    port = free_port()
    proc = start_server(model_dir, port, "--shutdown-timeout", "0.5")
    try:
        events, seconds = stop_and_time(proc, port, sig)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    assert events[-1] == "[DONE]", events[-3:]
    final = json.loads(events[-2])
    assert final["error"]["code"] == "server_shutdown" and final["error"]["type"] == "server_error", final
    assert "engine closed" in out, out[-3000:]  # serve returned and LLM.close() ran
    assert seconds < 15, seconds
    print(f"{signal.Signals(sig).name}: exit 0 in {seconds:.2f} s with a stream open (--shutdown-timeout 0.5)")


@pytest.mark.slow
@pytest.mark.tp
def test_tp_workers_end_with_the_server(model_dir):
    port = free_port()
    proc = start_server(model_dir, port, "--tp", "2", "--shutdown-timeout", "0")
    try:
        workers = _descendants(proc.pid)
        assert workers, "no worker process found"
        events, seconds = stop_and_time(proc, port, signal.SIGTERM, max_tokens=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and events[-1] == "[DONE]"
    assert wait_gone(workers, timeout=20) == []
