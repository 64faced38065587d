"""Measure `metainfer serve`'s shutdown with a stream open: the seconds from SIGTERM to the stream's final
event, to `LLM.close()` (the server's "engine closed" log line) and to the process's exit, and its exit status.

    python -m tools.measure_shutdown --out docs/results/shutdown_cpu.json [--model DIR] [--runs 3]
        [--shutdown-timeouts 0.5 5]

Without --model it builds the tests' tiny random Qwen3 (real Qwen3 tokenizer) in a temporary folder. Each run
starts a CPU server, opens a stream of --max-tokens tokens (ignore_eos), sends SIGTERM after its first event;
a stream that ends on its own before the drain limit measured nothing, and the tool then exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tests.helpers.serve_process import stream_then_signal, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model: str, shutdown_timeout: float, max_tokens: int) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", model, "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--served-model-name", "m", "--log-level", "info",
           "--no-access-log", "--shutdown-timeout", str(shutdown_timeout)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    closed_at: list[float] = []
    log: list[str] = []

    def read_log():
        for line in proc.stdout:
            log.append(line)
            if "engine closed" in line:
                closed_at.append(time.monotonic())

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        wait_healthy(proc, port, timeout=180, output=lambda: "".join(log[-30:]))
        events, start = stream_then_signal(port, "m", max_tokens, lambda: proc.send_signal(signal.SIGTERM),
                                           timeout=120)
        final_event = time.monotonic() - start
        proc.wait(timeout=120)
        exited = time.monotonic() - start
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    last = json.loads(events[-2]) if len(events) >= 2 and events[-1] == "[DONE]" else None
    return {"shutdown_timeout_s": shutdown_timeout, "exit_status": proc.returncode,
            "stream_ended_with": (last or {}).get("error", {}).get("code", "finished" if last else "broken"),
            "signal_to_final_event_s": round(final_event, 3),
            "signal_to_close_s": round(closed_at[0] - start, 3) if closed_at else None,
            "signal_to_exit_s": round(exited, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--model", default=None, help="model folder (default: the tests' tiny Qwen3, built here)")
    p.add_argument("--runs", type=int, default=3, help="runs per shutdown timeout (default 3)")
    p.add_argument("--shutdown-timeouts", type=float, nargs="+", default=[0.5, 5.0],
                   help="--shutdown-timeout values to measure (default 0.5 5)")
    p.add_argument("--max-tokens", type=int, default=3000,
                   help="tokens the open stream asks for (default 3000: longer than the default 5-s drain on an idle "
                        "CPU, so the drain's cut-off is what is measured)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, ROOT)
            from tests.helpers.tiny_models import build_tiny_model

            build_tiny_model(tmp, "qwen3", vocab_size=151936, max_position_embeddings=4096)
            model = tmp
        runs = [one_run(model, t, args.max_tokens) for t in args.shutdown_timeouts for _ in range(args.runs)]
    result = {"command": "python -m tools.measure_shutdown " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": "tiny random Qwen3 (tests)" if args.model is None else os.path.basename(args.model),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
                         f"{os.getloadavg()[0]:.1f} at the end", "max_tokens": args.max_tokens, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in runs:
        print(r)
    finished = [r for r in runs if r["stream_ended_with"] == "finished"]
    if finished:  # the stream ended on its own before the drain limit: that run measured no cut-off
        print(f"{len(finished)} run(s) finished their stream before the drain limit: raise --max-tokens",
              file=sys.stderr)
    return 0 if all(r["exit_status"] == 0 for r in runs) and not finished else 1


if __name__ == "__main__":
    sys.exit(main())
