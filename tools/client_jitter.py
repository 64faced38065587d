"""What `bench serve`'s client adds to the inter-token latency it reports, without an engine (CPU).

    python -m tools.client_jitter [--tick-ms 9] [--streams 64] [--num-prompts 256] [--output-len 256]
                                  [--repo DIR] [--json F]

A paced emitter (a bare asyncio HTTP server in its own process, no framework) answers /v1/completions like the
server does: a token-id prompt in, one pre-encoded SSE completion chunk per stream on every tick (a fake engine
step that gives every stream a token), `max_tokens` chunks, then the usage chunk and [DONE]. `bench serve` (from
`--repo`, default this checkout: an older checkout measures an older client) runs against it in another process.
Every stream gets its chunks at the same instants, so the emitter's own tick intervals are the true ITL; the
client's ITL beyond them is the client's: its loop's CPU a chunk, and the queueing when a tick's chunks arrive
together. Reports the emitter's tick p50 / p99, the client's ITL p50 / p99 and its CPU per chunk (user + sys of
the client process, less that of a process that only starts and imports it, over its streamed chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n" % len(event) + event + b"\r\n"


def _event(obj) -> bytes:
    return _chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


class Emitter:
    """The paced server: `streams` maps a connection's writer to [chunks left, its done future, its last bytes]."""

    def __init__(self, tick_s: float):
        self.tick_s = tick_s
        self.ticks: list[float] = []
        self.streams: dict = {}
        self.token = _event({"id": "cmpl-0", "object": "text_completion", "model": "m",
                             "choices": [{"index": 0, "text": " a", "finish_reason": None}]})

    async def tick(self) -> None:
        due = time.perf_counter()
        while True:
            due += self.tick_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            self.ticks.append(time.perf_counter())
            for writer, state in list(self.streams.items()):
                state[0] -= 1
                if state[0] > 0:
                    writer.write(self.token)
                else:
                    writer.write(state[2])
                    del self.streams[writer]
                    state[1].set_result(None)

    async def handle(self, reader, writer) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                path = head[0].split(" ")[1]
                fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
                length = int({k.lower(): v for k, v in fields.items()}.get("content-length", "0"))
                body = await reader.readexactly(length)
                if path == "/v1/models":
                    data = json.dumps({"data": [{"id": "m"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % len(data) + data)
                    continue
                payload = json.loads(body)
                n = int(payload["max_tokens"])
                usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": n, "total_tokens": n}
                last = _event({"id": "cmpl-0", "object": "text_completion", "model": "m", "usage": usage,
                               "choices": [{"index": 0, "text": " a", "finish_reason": "length"}]})
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                done = asyncio.get_running_loop().create_future()
                self.streams[writer] = [n, done, last + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
                await done
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


def serve_emitter(port: int, tick_s: float, ticks_path: str) -> None:
    """The emitter process: serve until SIGTERM, then write the tick intervals (seconds) to `ticks_path`."""
    emitter = Emitter(tick_s)

    async def main():
        server = await asyncio.start_server(emitter.handle, "127.0.0.1", port)
        ticker = asyncio.create_task(emitter.tick())
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()
        ticker.cancel()

    asyncio.run(main())
    with open(ticks_path, "w") as f:
        json.dump([b - a for a, b in zip(emitter.ticks, emitter.ticks[1:])], f)


def quantile(values: list[float], q: float) -> float:
    """The value at rank q of the sorted values (nan for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ticks_path, record_path = os.path.join(tmp, "ticks.json"), os.path.join(tmp, "bench.json")
        emitter = subprocess.Popen([sys.executable, "-m", "tools.client_jitter", "--emit", str(port),
                                    "--tick-ms", str(args.tick_ms), "--ticks-json", ticks_path], cwd=ROOT)
        try:
            deadline = time.time() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline or emitter.poll() is not None:
                        raise RuntimeError("the emitter did not start") from None
                    time.sleep(0.05)
            env = {**os.environ, "PYTHONPATH": os.path.abspath(args.repo)}
            # the client's start-up (interpreter, imports), counted apart so that the run's CPU is the chunks'
            mark = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
            subprocess.run([sys.executable, "-c", "import aiohttp, httpx, metainfer.bench.serve"], cwd=args.repo,
                           env=env, check=True)
            before = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
            start_up_cpu = before - mark
            subprocess.run([sys.executable, "-m", "metainfer.bench.serve", "--base-url", f"http://127.0.0.1:{port}",
                            "--num-prompts", str(args.num_prompts), "--input-len", "512", "--output-len",
                            str(args.output_len), "--max-concurrency", str(args.streams), "--no-warmup",
                            "--save-detailed", "--metric-percentiles", "50,99", "--output-json", record_path,
                            "--json"], cwd=args.repo, env=env, check=True, stdout=subprocess.DEVNULL)
            after = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
        finally:
            emitter.send_signal(signal.SIGTERM)
            emitter.wait(30)
        with open(ticks_path) as f:
            ticks = json.load(f)
        with open(record_path) as f:
            record = json.load(f)
    itls = [x for per_request in record["itls"] for x in per_request]
    chunks = record["total_output_tokens"]
    cpu = after - before - start_up_cpu
    return {"tick_ms": args.tick_ms, "streams": args.streams, "chunks": chunks,
            "emitter_tick_p50_ms": round(quantile(ticks, 0.5) * 1e3, 3),
            "emitter_tick_p99_ms": round(quantile(ticks, 0.99) * 1e3, 3),
            "client_itl_p50_ms": round(quantile(itls, 0.5) * 1e3, 3),
            "client_itl_p99_ms": round(quantile(itls, 0.99) * 1e3, 3),
            "client_cpu_s": round(cpu, 3), "client_cpu_us_per_chunk": round(cpu / chunks * 1e6, 1),
            "client_start_up_cpu_s": round(start_up_cpu, 3),
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.client_jitter", description=__doc__.splitlines()[0])
    p.add_argument("--tick-ms", type=float, default=9.0, help="the fake engine's step interval (default 9)")
    p.add_argument("--streams", type=int, default=64, help="--max-concurrency of the client (default 64)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repo", default=ROOT, help="the checkout whose `bench serve` runs (default this one)")
    p.add_argument("--json", default=None, help="write the result here too")
    p.add_argument("--emit", type=int, default=None, help=argparse.SUPPRESS)  # the emitter process's port
    p.add_argument("--ticks-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.emit is not None:
        serve_emitter(args.emit, args.tick_ms / 1e3, args.ticks_json)
        return
    report(measure(args), args.json)


def report(result: dict, path: str | None) -> None:
    """Print the result as JSON, and write it to `path` too when one is given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
