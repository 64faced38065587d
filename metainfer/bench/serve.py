"""`metainfer bench serve`: load a running OpenAI-compatible server and report serving metrics.

Random prompts of `--input-len` token ids (sent as a token-id prompt to /v1/completions, so
the server sees exactly that many tokens; ids are drawn from `--token-id-range`), asking for
exactly `--output-len` tokens (`ignore_eos`). Requests arrive as a Poisson process at
`--request-rate` per second (`inf`: all at once), at most `--max-concurrency` in flight.
Every request streams; times are taken at each SSE chunk that carries tokens (a completion choice, or a chat delta
with content; not the chat's role chunk), as vLLM's benchmark counts them: a chunk whose tokens end inside a
character carries empty text and still counts:

- TTFT: request sent -> first token chunk.     - ITL: gaps between token chunks.
- TPOT: (E2EL - TTFT) / (output tokens - 1).   - E2EL: request sent -> stream done.

Metric names are vLLM's `benchmark_serving` names (`mean_ttft_ms`, `p99_itl_ms`,
`output_throughput`, ...). Needs only aiohttp: `python -m metainfer.bench.serve --base-url URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from metainfer.entrypoints.cli import checked, int_at_least

WORDS = ("the of and to in is was for on that with as by at from his her an which were are this be had "
         "not have it but one all their they can has been more its two new first other time some when "
         "who also would may after into only over city most such these made years many state world").split()


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    generated_text: str = ""  # the streamed text, joined (a chunk may carry several tokens' text, or none)
    error: str = ""


# -- workload -------------------------------------------------------------------------------
def make_payloads(args, model: str) -> list[dict]:
    rng = random.Random(args.seed)
    low_id, high_id = args.token_id_range
    ratio = args.random_range_ratio

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio)))) if ratio else max(1, n)

    payloads = []
    for _ in range(args.num_prompts):
        in_len, out_len = length(args.input_len), length(args.output_len)
        common = {"model": model, "max_tokens": out_len, "temperature": args.temperature, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
        if args.endpoint.endswith("chat/completions"):
            text = " ".join(rng.choice(WORDS) for _ in range(in_len))
            payloads.append({**common, "messages": [{"role": "user", "content": text}]})
        else:
            payloads.append({**common, "prompt": [rng.randrange(low_id, high_id) for _ in range(in_len)]})
    return payloads


# -- one streamed request ---------------------------------------------------------------------
async def send_request(session, url: str, payload: dict, headers: dict) -> RequestResult:
    result = RequestResult(prompt_len=len(payload.get("prompt", [])))
    start = last = time.perf_counter()
    result.start = start
    chunks = 0
    pieces: list[str] = []
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {body[:300]}"
                return result
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"])
                    return result
                now = time.perf_counter()
                usage = obj.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
                for choice in obj.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if "text" in choice or ("content" in delta and "role" not in delta):  # tokens, maybe no text
                        pieces.append((choice.get("text") if "text" in choice else delta["content"]) or "")
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(pieces)
        if chunks == 0:
            result.error = "no tokens were streamed"
            return result
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except Exception as exc:  # network errors, timeouts: count the request as failed
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(args) -> dict:
    """The client is aiohttp, as vLLM's benchmark_serving's: at concurrency 64 a step's 64 chunks arrive at once,
    and httpx spent ~80 us of CPU a chunk against aiohttp's ~30 (docs/PERFORMANCE.md), so an httpx client's
    own loop was busy half of each 9-ms step and its queueing showed up as inter-token latency."""
    import aiohttp

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    concurrency = args.max_concurrency or args.num_prompts
    connector = aiohttp.TCPConnector(limit=max(1, concurrency), force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.timeout, connect=min(args.timeout, 30.0))
    # read_bufsize: a chunk's SSE line must fit the stream reader's buffer (a long logprobs line is tens of KB)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2 ** 20) as session:
        model = args.model
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as resp:
                resp.raise_for_status()
                model = (await resp.json())["data"][0]["id"]
        url = f"{base}{args.endpoint}"
        payloads = make_payloads(args, model)
        if not args.no_warmup and payloads:
            warm = await send_request(session, url, {**payloads[0], "max_tokens": min(4, payloads[0]["max_tokens"])},
                                      headers)
            if not warm.ok:
                raise SystemExit(f"warm-up request failed: {warm.error}")

        semaphore = asyncio.Semaphore(concurrency)
        rng = random.Random(args.seed + 1)

        in_flight = 0
        peak = 0

        async def tracked(payload):
            nonlocal in_flight, peak
            async with semaphore:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await send_request(session, url, payload, headers)
                finally:
                    in_flight -= 1

        start = time.perf_counter()
        tasks = []
        for i, payload in enumerate(payloads):
            if i and math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.ensure_future(tracked(payload)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    record = summarize(results, duration, args.metric_percentiles)
    record.update({"backend": "metainfer-openai", "base_url": base, "endpoint": args.endpoint, "model": model,
                   "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                   "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                   "max_concurrency": args.max_concurrency, "max_concurrent_requests": peak,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    if args.save_detailed:
        record.update({"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
                       "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                       "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results]})
    return record


# -- statistics -----------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    record = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = [v * 1000.0 for v in values]
        record[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        record[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        record[f"std_{name}_ms"] = statistics.pstdev(ms) if len(ms) > 1 else 0.0
        for p in percentiles:
            record[f"p{_pct_name(p)}_{name}_ms"] = percentile(ms, p)
    failures = [r.error for r in results if not r.ok]
    if failures:
        record["first_errors"] = failures[:5]
    return record


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def format_table(record: dict, percentiles: list[float]) -> str:
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label, value, fmt="{:.2f}"):
        text = fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", record["completed"], "{}")
    row("Failed requests:", record["failed"], "{}")
    if record.get("max_concurrency"):
        row("Maximum request concurrency:", record["max_concurrency"], "{}")
    row("Request rate (req/s):", record["request_rate"])
    row("Benchmark duration (s):", record["duration"])
    row("Total input tokens:", record["total_input_tokens"], "{}")
    row("Total generated tokens:", record["total_output_tokens"], "{}")
    row("Request throughput (req/s):", record["request_throughput"])
    row("Output token throughput (tok/s):", record["output_throughput"])
    row("Total token throughput (tok/s):", record["total_token_throughput"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f" {title} ".center(width, "-"))
        row(f"Mean {name.upper()} (ms):", record[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", record[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{_pct_name(p)} {name.upper()} (ms):", record[f"p{_pct_name(p)}_{name}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------
def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1 (default http://127.0.0.1:8000)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="the endpoint to load (default /v1/completions)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("METAINFER_API_KEY"),
                   help="Bearer key of a server started with --api-key (default: $METAINFER_API_KEY)")
    p.add_argument("--num-prompts", type=int_at_least(1), default=100, help="requests to send (default 100)")
    p.add_argument("--input-len", type=int_at_least(1), default=256,
                   help="prompt tokens (chat endpoint: words; default 256)")
    p.add_argument("--output-len", type=int_at_least(1), default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--random-range-ratio", type=checked(float, lambda r: 0 <= r <= 1, "in [0, 1]"), default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (mixed lengths), r in [0, 1] (default 0)")
    p.add_argument("--token-id-range", type=int_at_least(0), nargs=2, default=[10, 500], metavar=("LOW", "HIGH"),
                   help="random prompt ids are drawn from [LOW, HIGH); keep HIGH <= the vocabulary size "
                        "(default 10 500)")
    p.add_argument("--request-rate", type=checked(float, lambda r: r > 0, "> 0 (inf: all at once)"),
                   default=float("inf"), help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int_at_least(1), default=None, help="most requests in flight at once")
    p.add_argument("--temperature", type=checked(float, lambda t: 0 <= t < math.inf, ">= 0 and finite"),
                   default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--timeout", type=checked(float, lambda t: 0 < t < math.inf, "> 0 and finite"), default=600.0,
                   help="per-request timeout, seconds (default 600)")
    p.add_argument("--metric-percentiles", type=_percentiles, default="99",
                   help="comma-separated, each in [0, 100], e.g. 50,90,99 (default 99)")
    p.add_argument("--no-warmup", action="store_true", help="skip the one untimed request before the run")
    p.add_argument("--save-detailed", action="store_true",
                   help="add per-request lists to the JSON (as vLLM's: input_lens, output_lens, ttfts, itls, "
                        "generated_texts, errors)")
    p.add_argument("--output-json", "--result-file", dest="output_json", default=None, help="write the record here")
    p.add_argument("--json", dest="print_json", action="store_true", help="print the JSON record instead of the table")


def _percentiles(text: str) -> list[float]:
    """--metric-percentiles as a list of floats in [0, 100]; anything else is argparse's one-line error."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in [0, 100], got {text!r}")
    return values


def add_serve_bench_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add `serve` under `metainfer bench` (the caller dispatches to `main(args)`)."""
    p = bench_subparsers.add_parser("serve", help="load a running OpenAI-compatible server (TTFT, TPOT, ITL, E2EL)",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def main(args: argparse.Namespace) -> dict:
    from metainfer.entrypoints.cli import usage_error

    if isinstance(args.metric_percentiles, str):
        args.metric_percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        usage_error("--num-prompts, --input-len and --output-len must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        usage_error("--max-concurrency must be >= 1")
    low_id, high_id = args.token_id_range
    if not 0 <= low_id < high_id:
        usage_error(f"--token-id-range needs 0 <= LOW < HIGH, got {low_id} {high_id}")
    try:
        import aiohttp
    except ImportError:  # the HTTP client comes with the server's extra
        raise SystemExit("metainfer: error: bench serve needs aiohttp: pip install 'metainfer[serve]'") from None

    try:
        record = asyncio.run(run_benchmark(args))
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:  # no server, or /v1/models failed
        raise SystemExit(f"metainfer: error: --base-url {args.base_url}: {type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0]}") from None
    if args.print_json:
        print(json.dumps(record, indent=1))
    else:
        print(format_table(record, args.metric_percentiles))
        for error in record.get("first_errors", []):
            print(f"error: {error}", file=sys.stderr)
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metainfer.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    record = main(parser.parse_args(argv))
    return 0 if record["completed"] else 1


if __name__ == "__main__":
    sys.exit(_cli())
