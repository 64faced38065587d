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
from tests.helpers.serve_process import stream_then_signal, wait_healthy
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


def spawn_server(model_dir: str, port: int, *extra: str, new_session: bool = False) -> subprocess.Popen:
    """`metainfer serve` as a subprocess (its output on stdout); `new_session`: a process group of its own, as a
    terminal's foreground job (Ctrl-C reaches the whole group)."""
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", model_dir, "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--served-model-name", "tiny", "--log-level", "info",
           "--no-access-log", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=new_session)


def start_server(model_dir: str, port: int, *extra: str, new_session: bool = False) -> subprocess.Popen:
    proc = spawn_server(model_dir, port, *extra, new_session=new_session)
    wait_healthy(proc, port, timeout=120)
    return proc


def stop_and_time(proc: subprocess.Popen, port: int, sig: int, max_tokens: int = 480,
                  group: bool = False) -> tuple[list[str], float]:
    """Open a long stream, send `sig` after its first token (`group`: to the server's whole process group, as
    Ctrl-C in a terminal does); return the stream's events and the seconds from the signal to the process's
    exit."""
    def send():
        if group:
            os.killpg(os.getpgid(proc.pid), sig)
        else:
            proc.send_signal(sig)

    events, start = stream_then_signal(port, "tiny", max_tokens, send, timeout=60)
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
    assert "engine process closed its engine" in out, out[-3000:]  # the engine process ran LLM.close()
    assert "engine closed; exiting" in out, out[-3000:]  # and serve_cli saw it exit 0
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


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_ends_streams_and_exits_0(model_dir):
    """A real Ctrl-C: SIGINT to every process of the server's group (the HTTP process and the engine process, which
    ignores it and is stopped by the server after the drain)."""
    port = free_port()
    proc = start_server(model_dir, port, "--shutdown-timeout", "0.5", new_session=True)
    try:
        engine = _descendants(proc.pid)
        events, seconds = stop_and_time(proc, port, signal.SIGINT, group=True)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutdown", events[-3:]
    assert "engine process closed its engine" in out and "Traceback" not in out, out[-3000:]
    assert seconds < 15 and wait_gone(engine, timeout=10) == []


def _kill_after_spawn(proc: subprocess.Popen, sig: int) -> list[int]:
    """Wait until the server has spawned its engine process, let the build start, send `sig`; return the pids
    below the server then (the engine process and multiprocessing's helper)."""
    deadline = time.monotonic() + 60
    while not (pids := _descendants(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "no engine process was spawned"
        time.sleep(0.05)
    time.sleep(0.5)
    pids = _descendants(proc.pid)
    proc.send_signal(sig)
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_server_stopped_while_the_engine_builds_leaves_no_engine(model_dir, sig):
    """SIGTERM (a supervisor) or SIGKILL to `metainfer serve` while the engine process builds: the engine does not
    build on as an orphan (minutes of GPU memory on a GPU) and end with a BrokenPipe at its "ready"; the server
    stops it (SIGTERM) or it sees its parent gone (SIGKILL) and exits."""
    proc = spawn_server(model_dir, free_port(), new_session=True)
    try:
        pids = _kill_after_spawn(proc, sig)
        proc.wait(30)
        start = time.monotonic()
        left = wait_gone(pids, timeout=30)
        seconds = time.monotonic() - start
        out = proc.stdout.read()  # EOF: every process that held the output is gone
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], out[-3000:]
    assert "Traceback" not in out and "BrokenPipe" not in out, out[-3000:]
    assert "on http://" not in out, out[-3000:]  # it never served
    print(f"{signal.Signals(sig).name} during the build: the engine process was gone {seconds:.2f} s after the "
          f"server's exit")


@pytest.mark.slow
@pytest.mark.tp
def test_killing_the_http_process_ends_the_engine_and_its_ranks(model_dir):
    """SIGKILL to the HTTP process mid-stream (it cannot stop anything): the engine process sees its input pipe
    close, closes its engine, and its TP rank ends with it, within seconds."""
    port = free_port()
    proc = start_server(model_dir, port, "--tp", "2", new_session=True)
    try:
        pids = _descendants(proc.pid)
        assert len(pids) >= 2, pids  # the engine process and its rank (and multiprocessing's helper)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
            proc.kill()
            proc.wait(10)
        start = time.monotonic()
        left = wait_gone(pids, timeout=10)
        seconds = time.monotonic() - start
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], left
    print(f"HTTP process killed mid-stream: its engine process and TP rank were gone in {seconds:.2f} s")
