"""Issue 23's serving figures at Qwen3-8B dims (dummy bf16 weights):

- `prefix_hits`: an 8,192-token prompt computed once (max_tokens=1), then sent twice more; the first of
  those is the first prefix hit after start (a Triton compile there would show), the second a repeat.
  Target: first hit <= 2x the repeat. The requests' `num_cached_tokens` beside.
- `serve_vs_offline`: `metainfer serve` in a subprocess, `bench serve` with 256 prompts of 512 tokens, 256
  out, at concurrency 64, against the offline engine decoding the same shape with max_num_seqs=64
  (output tok/s both). Target >= 90% of offline, ITL p99 <= 2x median. Needs fastapi, uvicorn, httpx
  and aiohttp: installed from `.gpu_assets/wheels` when the machine lacks them.
- `throughput_1k`: 1,000 prompts of 1,000 tokens, 1,000 out, max_num_seqs 512, bf16 and fp8 KV (and greedy
  admission, `--throughput-1k-variants`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tools.gpu_suite.common import (
    ROOT,
    bench_llm,
    ensure_packages,
    error_of,
    model_dir,
    on_engine,
    out_dir,
    release,
    show,
)


def _timed_generate(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    from metainfer import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    return {"ms": (time.perf_counter() - start) * 1e3, "num_cached_tokens": getattr(out, "num_cached_tokens", None)}


def prefix_hits(args) -> dict:
    import torch

    start = time.perf_counter()
    llm = bench_llm(args, max_model_len=16384, max_num_batched_tokens=8192)
    startup = time.perf_counter() - start
    try:
        ids = torch.randint(10, 100000, (8192,), generator=torch.Generator().manual_seed(1)).tolist()
        other = torch.randint(10, 100000, (8192,), generator=torch.Generator().manual_seed(2)).tolist()
        res = {"startup_s": startup,
               "cold": _timed_generate(llm, ids, 1),
               "first_hit": _timed_generate(llm, ids, 1),
               "repeat_hit": _timed_generate(llm, ids, 1),
               "cold_other_prompt": _timed_generate(llm, other, 1)}
        res["first_over_repeat"] = res["first_hit"]["ms"] / res["repeat_hit"]["ms"]
    finally:
        del llm
        release()
    return res


# the server, the suite's /metrics reads, bench serve's client
SERVER_PACKAGES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "httpx": "httpx", "aiohttp": "aiohttp",
                   "uvloop": "uvloop", "httptools": "httptools"}  # the last two: uvicorn's faster loop and parser


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server not ready")


def serve_vs_offline(args, num_prompts=256, input_len=512, output_len=256, concurrency=64) -> dict:
    from metainfer import SamplingParams

    res = {"setup": {"installed": ensure_packages(SERVER_PACKAGES)}, "num_prompts": num_prompts, "input_len": input_len,
           "output_len": output_len, "concurrency": concurrency}

    def offline(llm) -> dict:
        import random

        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randint(10, 500) for _ in range(input_len)]}
                   for _ in range(num_prompts + concurrency)]
        prompts, warm = prompts[:num_prompts], prompts[num_prompts:]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        # the warm-up's prompts are not the measured ones: until session 28 they were its first 64, whose prefill
        # the measured run then took from the prefix cache (the first wave's 32,768 tokens, ~0.7 s on an H200)
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        engine = llm.llm_engine
        engine.step_trace = []
        start = time.perf_counter()
        try:
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            trace = engine.step_trace
        finally:
            engine.step_trace = None
        return {"output_tok_s": num_prompts * output_len / elapsed, "elapsed_s": elapsed,
                "steps": step_costs(trace, start, start + elapsed)}

    res["offline"] = on_engine(args, offline, max_num_seqs=concurrency)
    show("offline", res["offline"])
    variants = [v.strip() for v in args.serve_variants.split(";")] or [""]
    for i, extra in enumerate(variants):
        serve = _bench_server(args, concurrency, num_prompts, input_len, output_len, extra.split(),
                              tag="" if i == 0 else f"_{i}")
        serve["serve_over_offline"] = serve.get("output_throughput", 0) / res["offline"]["output_tok_s"]
        if i == 0:
            res["serve"] = serve
        res.setdefault("variants", {})[extra or "default"] = {
            k: serve.get(k) for k in ("output_throughput", "serve_over_offline", "median_itl_ms", "p99_itl_ms",
                                      "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "server_histograms")}
        show(f"serve {extra or 'default'}", res["variants"][extra or "default"])
        if "steps" in serve:
            res["variants"][extra or "default"]["steps"] = serve["steps"]
            show(f"serve {extra or 'default'} steps", compare_steps(serve["steps"], res["offline"]["steps"]))
    res["serve_over_offline"] = res["serve"]["serve_over_offline"]
    return res


def _bench_server(args, concurrency, num_prompts, input_len, output_len, extra: list[str], tag: str) -> dict:
    """`metainfer serve` (with the extra CLI args) in a subprocess, `bench serve` against it; its record."""
    port = 8311
    log_path = os.path.join(out_dir(), f"server_log{tag}.txt")
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", model_dir(args), "--load-format", "dummy",
           "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", str(concurrency), "--port", str(port),
           "--no-access-log", "--log-level", "warning", *extra]
    trace_path = os.path.join(out_dir(), f"server_steps{tag}.json")
    if os.path.exists(trace_path):  # an earlier call's, in the same folder
        os.remove(trace_path)
    cmd += ["--step-trace", trace_path]
    window = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(port, proc, timeout=180)
            record = os.path.join(out_dir(), f"bench_serve{tag}.json")
            window.append(time.perf_counter())  # CLOCK_MONOTONIC on Linux: the engine process's clock too
            subprocess.run([sys.executable, "-m", "metainfer.bench.serve", "--base-url", f"http://127.0.0.1:{port}",
                            "--num-prompts", str(num_prompts), "--input-len", str(input_len), "--output-len",
                            str(output_len), "--max-concurrency", str(concurrency), "--metric-percentiles", "50,99",
                            "--output-json", record], cwd=ROOT, check=True, timeout=300)
            window.append(time.perf_counter())
            with open(record) as f:
                result = json.load(f)
            import httpx

            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            # where the ITL tail comes from: the engine's step intervals, then the HTTP process's ITL (the client's
            # p99_itl_ms is the same after SSE framing and the client's own loop)
            names = {"engine_step_interval": "engine_step_interval_seconds",
                     "server_itl": "inter_token_latency_seconds"}
            result["server_histograms"] = {key: histogram_quantiles(text, f"metainfer:{name}")
                                           for key, name in names.items()}
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    if os.path.exists(trace_path):  # written by the engine process as it closed
        with open(trace_path) as f:
            steps = json.load(f)["steps"]
        result["steps"] = step_costs(steps, *window)
    return result


def _step_kind(is_prefill: bool, num_tokens: int, decode_rows: int) -> str:
    """A step's bin: decode rows in eighths of 64, or prompt tokens (mixed: beside decode rows) in powers of 2."""
    if not is_prefill:
        return f"decode <={-(-decode_rows // 8) * 8}"
    prompt = num_tokens - decode_rows
    upper = 1 << max(prompt - 1, 0).bit_length()
    return f"{'mixed' if decode_rows else 'prefill'} <={max(upper, 64)}"


def step_costs(trace: list, start: float, end: float, idle_s: float = 0.5) -> dict:
    """Where a run's time went, step by step, from an engine step trace (EngineConfig.step_trace_path, or
    LLMEngine.step_trace: [launch, is_prefill, seqs, tokens, decode rows, read back]). A step launched in
    [start, end] costs the time from the later of its launch and the previous step's read-back to its own
    read-back: the device's time on it while the GPU is the bound (async scheduling reads step n back after
    launching n + 1, so the gap between two launches is mostly the step before). A step that samples nothing has
    no read-back time: its cost goes to the next one. Costs over `idle_s` are idle engine time, counted apart.
    Binned by _step_kind: steps, mean ms, seconds."""
    steps = [s for s in trace if start <= s[0] <= end]
    bins: dict[str, dict] = {}
    idle = 0.0
    previous_done = None
    for launch, is_prefill, _, num_tokens, decode_rows, done in steps:
        if done is None:
            continue
        cost = done - (launch if previous_done is None else max(launch, previous_done))
        previous_done = done
        if cost > idle_s:
            idle += cost
            continue
        entry = bins.setdefault(_step_kind(is_prefill, num_tokens, decode_rows), {"steps": 0, "seconds": 0.0})
        entry["steps"] += 1
        entry["seconds"] += cost
    for entry in bins.values():
        entry["ms"] = round(entry["seconds"] * 1e3 / entry["steps"], 3)
        entry["seconds"] = round(entry["seconds"], 4)
    busy = sum(e["seconds"] for e in bins.values())
    return {"steps": sum(e["steps"] for e in bins.values()), "busy_s": round(busy, 4), "idle_s": round(idle, 4),
            "before_first_step_s": round(steps[0][0] - start, 4) if steps else None,
            "bins": dict(sorted(bins.items()))}


def compare_steps(serve: dict, offline: dict) -> dict:
    """Serve's step bins beside offline's: for each bin, serve's steps and ms a step beside offline's ms (None where
    offline ran no such step), and serve's extra seconds over offline's price in the bins both ran."""
    rows, extra = {}, 0.0
    for kind, entry in serve["bins"].items():
        ref = offline["bins"].get(kind)
        rows[kind] = [entry["steps"], entry["ms"], None if ref is None else ref["ms"]]
        if ref is not None:
            extra += entry["steps"] * (entry["ms"] - ref["ms"]) / 1e3
    return {"serve_steps": serve["steps"], "offline_steps": offline["steps"], "serve_busy_s": serve["busy_s"],
            "offline_busy_s": offline["busy_s"], "serve_extra_s_at_offline_prices": round(extra, 4),
            "bins [serve steps, serve ms, offline ms]": rows}


def histogram_quantiles(text: str, name: str, quantiles=(0.5, 0.9, 0.99)) -> dict:
    """A Prometheus histogram's count, mean and quantiles in ms from the /metrics text (linear within a bucket, as
    PromQL's histogram_quantile; a quantile in the +Inf bucket reads as the last finite bound)."""
    buckets, total, count = [], 0.0, 0
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(name + "_sum{"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count{"):
            count = int(float(line.rsplit(" ", 1)[1]))
    out = {"count": count, "mean_ms": round(total / count * 1e3, 3) if count else None}
    for q in quantiles:
        value, lower, below = None, 0.0, 0.0
        for bound, cumulative in buckets:
            if count and cumulative >= q * count:
                if bound == float("inf"):
                    value = lower
                else:
                    inside = cumulative - below
                    value = lower + (bound - lower) * ((q * count - below) / inside if inside else 1.0)
                break
            lower, below = bound, cumulative
        out[f"p{round(q * 100)}_ms"] = None if value is None else round(value * 1e3, 3)
    return out


# the 1,000 x 1,000 runs: bf16 and fp8 KV with the engine's defaults; bf16_greedy: vLLM's greedy admission
# (kv_reserve_ratio 0: prompts admitted while they fit, preempted and recomputed later), the KV reserve's A/B
THROUGHPUT_1K_VARIANTS = {"bf16": {}, "fp8": {"kv_cache_dtype": "fp8"}, "bf16_greedy": {"kv_reserve_ratio": 0.0}}


def throughput_1k(args) -> dict:
    from metainfer.bench.throughput import run_throughput

    def brief(llm) -> dict:
        full = run_throughput(llm, num_seqs=1000, min_in=1000, max_in=1000, min_out=1000, max_out=1000,
                              progress=False)
        return {**{k: full[k] for k in ("output_tok_s", "total_tok_s", "elapsed_s", "preemptions", "kv_reserve_ratio")},
                "decode_seconds": full["timeline"]["decode_seconds"], "prefill": full["timeline"]["prefill"],
                "num_kv_blocks": llm.llm_engine.block_manager.num_blocks,
                "graph_batch_sizes": llm.llm_engine.runner.graph_batch_sizes}

    res = {}
    for name in args.throughput_1k_variants.split(","):
        kw = THROUGHPUT_1K_VARIANTS[name]
        key = next(k for k in (name, *(f"{name}#{i}" for i in range(2, 99))) if k not in res)  # A/B/A: fp8, fp8#2
        try:
            res[key] = on_engine(args, brief, max_num_seqs=512, **kw)
        except Exception as exc:
            res[key] = error_of(exc)
        show(f"throughput_1k {key}", res[key])
    return res


def serving(args, results) -> dict:
    """The parts of --serving-parts (prefix_hits, serve_vs_offline, throughput_1k); one failing part keeps
    the others."""
    parts = {"prefix_hits": prefix_hits, "serve_vs_offline": serve_vs_offline, "throughput_1k": throughput_1k}
    res = {}
    for name in args.serving_parts.split(","):
        try:
            res[name] = parts[name](args)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            res[name] = error_of(exc)
            release()
        show(name, res[name])
    return res
