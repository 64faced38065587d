"""Where the server's inter-token latency spreads beyond the engine's steps, without a GPU (CPU).

    python -m tools.server_jitter [--tick-ms 9] [--streams 64] [--num-prompts 256] [--input-len 512]
                                  [--output-len 256] [--json F]

The engine is real (a tiny random Qwen3 with the real Qwen3 tokenizer, fp32, torch on one thread) but paced: in
its own process, as `metainfer serve` runs it, each step starts at least `--tick-ms` after the one before, so the
steps come at a GPU's cadence and the engine leaves the CPU free between them (on 2 cores an unpaced engine would
take a core and the HTTP process and the client would fight over the other). The HTTP process is the real one
(`build_app` over that engine process, the startup heap frozen, uvicorn), `bench serve` (aiohttp) loads it from a
third process. Reported, each as p50 / p90 / p99 in ms: the engine's step interval and the HTTP process's ITL (from
/metrics, 2.5-ms buckets from 5 to 20 ms), and the client's ITL (exact). The engine's spread is the steps'; the
HTTP process's adds the pipe and the event loop before its SSE events; the client's adds the framing, the socket
and the client (`tools/client_jitter` measures that last part alone).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time

from tools.client_jitter import free_port, quantile, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def paced_engine_main(engine_kwargs: dict, requests, outputs, tick_s: float) -> None:
    """The engine process: the real LLMEngine and EngineCore, each step held back to start `tick_s` after the
    last (never earlier; a step longer than the tick is not caught up with a burst)."""
    import torch

    torch.set_num_threads(1)
    from metainfer.entrypoints.openai.engine_core import EngineCore, freeze_startup_heap
    from metainfer.llm import LLM

    llm = LLM(**engine_kwargs)
    engine = llm.llm_engine
    step, due = engine.step, [time.perf_counter()]

    def paced_step():
        due[0] = max(due[0] + tick_s, time.perf_counter())
        time.sleep(max(0.0, due[0] - time.perf_counter()))
        return step()

    engine.step = paced_step
    core = EngineCore(engine, requests, outputs)
    info = core.info()
    freeze_startup_heap()
    outputs.send(("ready", info))
    try:
        core.run()
    finally:
        llm.close()


def start_paced_engine(engine_kwargs: dict, tick_s: float):
    from metainfer.entrypoints.openai.engine_core import EngineProcess, _wait_ready

    ctx = mp.get_context("spawn")
    req_r, req_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    process = ctx.Process(target=paced_engine_main, args=(engine_kwargs, req_r, out_w, tick_s), daemon=True)
    process.start()
    req_r.close()
    out_w.close()
    handle = EngineProcess(req_w, out_r, process=process)
    handle.ready_info = _wait_ready(out_r, process)
    return handle


def _quantiles(values: list[float]) -> dict:
    return {"count": len(values), **{f"p{q}_ms": round(quantile(values, q / 100) * 1e3, 3) for q in (50, 90, 99)}}


def measure(args, model: str, detailed: dict | None = None) -> dict:
    """The figures of one run; `detailed`, where given, receives the client's per-request lists (`bench serve
    --save-detailed`: output_lens, itls, generated_texts, ...; the requests in the order they were made)."""
    import httpx
    import uvicorn

    from metainfer.entrypoints.openai.api_server import build_app
    from metainfer.entrypoints.openai.engine_core import freeze_startup_heap
    from tools.gpu_suite.serving import histogram_quantiles

    kwargs = {"model": model, "device": "cpu", "dtype": "float32", "max_model_len": 1024,
              "max_num_seqs": args.streams, "max_num_batched_tokens": 8192, "enforce_eager": True}
    if args.max_mixed_prefill_tokens:
        kwargs["max_mixed_prefill_tokens"] = args.max_mixed_prefill_tokens
    handle = start_paced_engine(kwargs, args.tick_ms / 1e3)
    app = build_app(handle, served_model_names=["tiny"])
    freeze_startup_heap()  # as `serve` does for its HTTP process
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           loop=args.loop, http=args.http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        cpu_before = time.process_time()  # this process is the HTTP process (the engine and the client are not)
        with tempfile.TemporaryDirectory() as tmp:
            record_path = os.path.join(tmp, "bench.json")
            subprocess.run([sys.executable, "-m", "metainfer.bench.serve", "--base-url", f"http://127.0.0.1:{port}",
                            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--max-concurrency", str(args.streams),
                            "--save-detailed", "--metric-percentiles", "50,99", "--output-json", record_path,
                            "--json"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            with open(record_path) as f:
                record = json.load(f)
            if detailed is not None:
                detailed.update({key: value for key, value in record.items() if isinstance(value, list)})
        http_cpu_s = time.process_time() - cpu_before
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.should_exit = True
        thread.join(30)
        app.state.server.shutdown()
    itls = [x for per_request in record["itls"] for x in per_request]
    return {"tick_ms": args.tick_ms, "streams": args.streams, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len,
            "max_mixed_prefill_tokens": args.max_mixed_prefill_tokens, "loop": args.loop, "http": args.http,
            "output_tok_s": round(record["output_throughput"], 1),
            "http_process_cpu_us_per_token": round(http_cpu_s * 1e6 / record["total_output_tokens"], 1),
            "engine_step_interval": histogram_quantiles(metrics, "metainfer:engine_step_interval_seconds",
                                                        (0.5, 0.9, 0.99)),
            "server_itl": histogram_quantiles(metrics, "metainfer:inter_token_latency_seconds", (0.5, 0.9, 0.99)),
            "client_itl": _quantiles(itls),
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.server_jitter", description=__doc__.splitlines()[0])
    p.add_argument("--tick-ms", type=float, default=9.0, help="the least time between engine steps (default 9)")
    p.add_argument("--streams", type=int, default=64, help="concurrency and max_num_seqs (default 64)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-mixed-prefill-tokens", type=int, default=256,
                   help="as `serve`'s default (0: uncapped)")
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="uvicorn's event loop (default auto: uvloop where installed, as `serve`)")
    p.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"),
                   help="uvicorn's HTTP protocol (default auto: httptools where installed, as `serve`)")
    p.add_argument("--model", default=None, help="a model folder (default: tools.serve_overhead's tiny Qwen3)")
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    from tools.serve_overhead import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tmp
        if args.model is None:
            build_model(model)
        result = measure(args, model)
    report(result, args.json)


if __name__ == "__main__":
    main()
