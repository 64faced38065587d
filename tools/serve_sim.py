"""`bench serve`'s closed loop against the engine's own scheduler, with no model: how admission rules move the share
of offline throughput and the inter-token latencies, priced by measured step costs.

    python -m tools.serve_sim [--prices h100_run99,h200_run101] [--cap-rule fixed,budget1.5] [--seeds 5] [--validate]

Why: the serve-vs-offline figure (issue 23: >= 90% of offline, ITL p99 <= 2x the median) is set by how the first
wave of a closed-loop benchmark is admitted (docs/PERFORMANCE.md, runs 93-94 and 99: ~130 extra steps of ramp and
drain under the 256-token mixed cap) and a rule's effect on it needs a GPU run to measure. This drives
`metainfer.engine.scheduler.Scheduler` and `BlockManager` (the engine's, unchanged) the way `LLMEngine.step` does
with async scheduling (one step in flight): step k+1 is scheduled and launched before step k is read back, so a
sequence whose last token is in flight still holds its slot for one more schedule, and a request is taken in only
between steps (the engine loop drains its input pipe, `add_ms` of host time a request, hidden under the step in
flight up to that step's length). Every token of a step is visible at the step's end. `bench serve`'s protocol: the
warm-up request (the first prompt, so the run's first request hits the prefix cache), then `concurrency` clients
in a closed loop; the first request reaches the engine `start_ms` after the start (its connection is the warm-up's,
kept alive), the others `first_gap_ms` later and `arrival_ms` apart (the HTTP process, serialised); a finished
request's client has its next one at the engine `reply_ms + arrival_ms` later. The offline run (the suite's): the
same engine after a warm-up on `concurrency` prompts of its own (before session 28 the first measured ones, whose
prefill the measured run then found cached: `offline_warm_hits`, what runs 99 and 101 measured), every request added
up front (`offline_add_ms` each), no mixed cap. ITL as `bench serve` computes it: per request, the interval between
consecutive tokens (the first token is the TTFT, not an ITL), pooled over all requests, percentiles by linear
interpolation; the client adds a little delivery jitter on top (`client_itl_ms`: the client's median and p99 less
the engine's, measured).
`idle_window_ms`: an idle engine that receives a request waits this long for more before its first step.

Price sets (`PRICES`): `h100_run99` and `h200_run101`, each fitted to one run's measured step trace of the server
and its offline run (run 99 on an H100, run 101 on an H200; `--validate` prints each simulation beside its run), and
`h200_run90` (the tool's first: run 90's H200 decode bins, run 65's ~21 us a prompt token, no host costs; fitted
to run 93's offline duration, which had the warm-up's prefix hits, as a cold offline run). A step's
price varies by `step_sd` (seeded): `--seeds` averages runs. The prices are the GPU's measured ones; what the tool
measures is the schedule. Validated for the capped schedule only: it does not reproduce the uncapped A/Bs of runs
74 and 84 (H100: ~1,090 steps, 3-4 points under the capped serve, ITL p99 3.2-3.7x; simulated ~1,040 steps, -0.5
points, 1.3x), whose arrivals came in many small clumps where the simulation keeps the waves in step.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from dataclasses import dataclass, field

# H200, Qwen3-8B dims: decode ms a step by rows at the protocol's contexts (512-768 tokens), interpolated between:
# 1 row 4.0 (run 90's bs1 TPOT), 64 rows 6.2 (run 65's decode-only step beside its mixed one), 128-256 rows run 90's
# throughput bins (mixed contexts up to 2,048)
DECODE_MS = ((1, 4.0), (16, 4.6), (64, 6.2), (128, 9.65), (192, 11.81), (256, 13.69))
MIXED_PROMPT_MS = 0.021  # run 65: 64 decodes + a 512-token prompt 16.4 ms against 6.2 decode-only
PREFILL_PROMPT_MS = 0.021  # run 90: TTFT 25.3 ms at 1,024 tokens; fitted to run 93's offline 8.80 s


def _interp(points, x: float) -> float:
    """Piecewise linear through `points` ((x, y), ascending x); beyond the last, the last segment's slope."""
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Prices:
    """One GPU's step prices (ms) and the host's costs around the steps.

    A decode-only step costs `decode(rows)` (held flat past the table's ends). A step with prompt tokens costs a
    base plus `prompt(tokens)` (the prompt tokens' ms, piecewise linear, the last slope extended): the base is
    `mixed_base = (a, b)`: a + b x decode rows, or where None, `decode(rows)` (a step without decode rows: rows 1)."""

    name: str
    decode: tuple
    prompt: tuple
    mixed_base: tuple | None = None
    add_ms: float = 0.0  # serve: the engine loop's host time to take one request (pipe, add), serialised
    offline_add_ms: float = 0.0  # offline: LLM.generate's add a prompt, all before the first step
    arrival_ms: float = 0.5  # serve: the HTTP process's time a request (serialised)
    start_ms: float = 0.0  # serve: the bench's start to its first request at the engine
    first_gap_ms: float = 0.0  # serve: the first request to the rest of the first wave at the engine
    reply_ms: float = 1.0  # serve: a request's last token to its client's next request leaving the client
    reply_jitter_ms: float = 0.0  # serve: plus an exponential delay of this mean (the client's and HTTP's loops)
    client_itl_ms: tuple = (0.0, 0.0)  # what the client adds to the engine's ITL (median, p99)
    step_sd: float = 0.0  # a step's price varies by this share (normal, one standard deviation; seeded)
    source: str = field(default="", compare=False)

    def decode_ms(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        lo, hi = self.decode[0], self.decode[-1]
        return _interp(self.decode, min(max(rows, lo[0]), hi[0]))

    def prompt_ms(self, tokens: int) -> float:
        return _interp(self.prompt, tokens) if tokens > 0 else 0.0

    def step_ms(self, decode_rows: int, prompt_tokens: int) -> float:
        if prompt_tokens <= 0:
            return self.decode_ms(decode_rows)
        if self.mixed_base is None:
            base = self.decode_ms(max(decode_rows, 1))
        else:
            base = self.mixed_base[0] + self.mixed_base[1] * decode_rows
        return base + self.prompt_ms(prompt_tokens)

    def max_prompt_tokens(self, decode_rows: int, budget_ms: float, limit: int) -> int:
        """The most prompt tokens (<= limit) a step beside `decode_rows` takes within `budget_ms` (0 if none)."""
        lo, hi = 0, limit
        while lo < hi:  # step_ms is non-decreasing in the prompt tokens
            mid = (lo + hi + 1) // 2
            if self.step_ms(decode_rows, mid) <= budget_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo


H200_RUN90 = Prices(
    "h200_run90", DECODE_MS, ((0, 0.0), (1, MIXED_PROMPT_MS)),
    source="run 90's H200 decode bins, run 65's ~21 us a prompt token beside decodes and in prefill-only steps; no "
           "host costs (the tool's first prices; its schedule model then had no async scheduling)")

# H100 (run 99, gpu_run99.json and the server's step trace; Qwen3-8B dims, bf16). A step's price is the interval
# between the launches of the next two steps (async scheduling: a launch waits on the read-back of the step before).
# Decode-only by rows: the drain's pairs (64 -> 0 rows, contexts 512-768) and the 507 decode steps at 64 rows
# (8.46); the jumps are the decode graphs' batch buckets (8 -> 9, 16 -> 17 rows).
H100_DECODE_MS = ((1, 6.25), (8, 6.53), (9, 6.83), (16, 6.91), (17, 7.45), (24, 7.49), (32, 7.70), (40, 7.97),
                  (48, 8.25), (56, 8.42), (64, 8.46))
# a step's prompt tokens: run 99's profile_mixed (64 running rows; device ms over the decode step's 8.07): 128
# tokens +1.78, 256 +3.88, 512 +9.47 (the server's 374 steps of 62 rows + 256 tokens: 12.53 against 8.60 decode-only:
# +3.93); past 512 tokens 22.5 us a token (compute-bound), fitted to the offline run's 10.933 s (its 12 steps of
# ~8,192 prompt tokens; the other 1,018 steps priced by the tables)
H100_PROMPT_MS = ((0, 0.0), (128, 1.78), (256, 3.88), (512, 9.47), (8192, 9.47 + 7680 * 0.0225))
# a step with prompt tokens: 9.52 + 0.048 ms a decode row at 256 prompt tokens (least squares over the server's 504
# mixed steps with 3-63 decode rows: the ramp and the steady state), less the 256 tokens' 3.88
H100_RUN99 = Prices(
    "h100_run99", H100_DECODE_MS, H100_PROMPT_MS, mixed_base=(9.52 - 3.88, 0.048),
    # the engine took the first wave's other 63 requests in one drain of its pipe: the launch after took 28.3 ms
    # against ~6 ms for the 1-row step in flight, so ~0.45 ms each
    add_ms=0.45,
    offline_add_ms=41.7 / 256,  # the offline run's 41.7 ms before its first step, 256 prompts added
    arrival_ms=0.2,  # below add_ms: the trace's 63 adds came in one drain (any value under ~0.45 ms schedules alike)
    # the warm-up's last token (~124 ms before the ramp's first step) to the first request's step (42 ms before):
    # ~80 ms, which is also the bench's 11.698 s less the engine's 11.617 s from that step to the last token
    start_ms=80.0,
    first_gap_ms=14.0,  # the first request ran 3 one-row steps (~14 ms) alone before the others arrived
    reply_ms=1.0,
    # the client's ITL against the engine's per-token intervals in the trace (8.66 / 12.95 ms): +0.10 / +1.70 ms
    client_itl_ms=(0.10, 1.70),
    # the spread of a step kind's intervals in the trace: 64-row decode sd 0.153 of 8.46 ms, 62 rows + 256 tokens
    # 0.285 of 12.53 (the ITL median and p99 sit inside those spreads: a step kind's mean alone is 0.2 / 0.4 ms low)
    step_sd=0.02,
    source="run 99 (H100): the server's step trace and the offline run's bins, profile_mixed")

# H200 (run 101, gpu_run101.json and the server's step trace), fitted as the H100's set: decode-only by rows from the
# drain and the 496 decode steps at 64 rows (6.43); the prompt tokens from its profile_mixed (64 rows, device ms over
# the decode step's 6.12: 128 +2.24, 256 +4.66, 512 +10.77), past 512 fitted to offline's 8.838 s; a step with prompt
# tokens 8.815 + 0.0425 ms a decode row at 256 tokens (least squares over the server's 504 mixed steps with 3-63
# rows). Host: the first request ran alone for 14 one-row steps (~56 ms) before the rest of the first wave came; run
# 101's adds overlap the steps after it (~0.3 ms each); the warm-up's last token to the first request ~8 ms (the
# duration less the engine's span agrees). Client ITL against the trace's per-token 6.60 / 11.98 ms: +0.24 / +1.33.
H200_RUN101 = Prices(
    "h200_run101", ((1, 4.06), (8, 4.94), (9, 5.14), (16, 5.33), (17, 5.79), (24, 5.97), (32, 6.03), (40, 6.18),
                    (48, 6.32), (56, 6.40), (64, 6.43)),
    ((0, 0.0), (128, 2.24), (256, 4.66), (512, 10.77), (8192, 10.77 + 7680 * 0.0224)),
    mixed_base=(8.815 - 4.66, 0.0425),
    add_ms=0.3, offline_add_ms=29.1 / 256, arrival_ms=0.2, start_ms=8.0, first_gap_ms=56.0, reply_ms=1.0,
    client_itl_ms=(0.24, 1.33), step_sd=0.023,  # 64-row decode sd 0.160 of 6.43 ms, 62 rows + 256: 0.253 of 11.47
    source="run 101 (H200): the server's step trace and the offline run's bins, profile_mixed")

PRICES = {p.name: p for p in (H200_RUN90, H100_RUN99, H200_RUN101)}

# the measured runs the price sets were fitted to (gpu_run99.json, gpu_run101.json serving.serve_vs_offline; from
# the server's step traces: the run's launches after the warm-up request's 4, and the engine-side ITL per token: each
# decode row of a step gets the interval the step was priced at)
MEASURED = {
    "h100_run99": {"serve_s": 11.698, "serve_steps": 1162, "offline_s": 10.933, "offline_steps": 1030,
                   "of_offline": 0.9346, "itl_median_ms": 8.76, "itl_p99_ms": 14.65, "engine_itl_median_ms": 8.66,
                   "engine_itl_p99_ms": 12.95, "ttft_mean_ms": 232.2},
    "h200_run101": {"serve_s": 9.849, "serve_steps": 1173, "offline_s": 8.838, "offline_steps": 1030,
                    "of_offline": 0.8973, "itl_median_ms": 6.84, "itl_p99_ms": 13.31, "engine_itl_median_ms": 6.60,
                    "engine_itl_p99_ms": 11.98, "ttft_mean_ms": 204.4},
}


def decode_ms(rows: int) -> float:
    """The H200 set's decode price (the tool's first prices)."""
    return H200_RUN90.decode_ms(rows)


def step_ms(decode_rows: int, prompt_tokens: int) -> float:
    return H200_RUN90.step_ms(decode_rows, prompt_tokens)


CAP_RULES = """fixed: the engine's (max_mixed_prefill_tokens = the cap); rows: prompt tokens x running rows <= cap x
concurrency; belowN: uncapped while fewer than N sequences run; waitN: uncapped while N or more prompts wait and
fewer than N sequences run (a burst with few streams to delay); budgetK: prompt tokens such that the step's
predicted price <= K x the decode-only step at `concurrency` rows (at least the cap); budgetrowsK: the same
against the decode-only step at the running rows"""


def _cap(rule: str, sched, prices: Prices, fixed_cap: int, concurrency: int, max_batched_tokens: int) -> int:
    running, waiting = len(sched.running), len(sched.waiting)
    if rule == "fixed":
        return fixed_cap
    if rule == "rows":
        return max(fixed_cap, fixed_cap * concurrency // max(running, 1))
    if rule.startswith("below"):
        return max_batched_tokens if running < int(rule[5:]) else fixed_cap
    if rule.startswith("wait"):
        n = int(rule[4:])
        return max_batched_tokens if waiting >= n and running < n else fixed_cap
    if rule.startswith("budgetrows"):
        budget = float(rule[10:]) * prices.decode_ms(max(running, 1))
        return max(fixed_cap, prices.max_prompt_tokens(running, budget, max_batched_tokens - running))
    if rule.startswith("budget"):
        budget = float(rule[6:]) * prices.decode_ms(concurrency)
        return max(fixed_cap, prices.max_prompt_tokens(running, budget, max_batched_tokens - running))
    raise ValueError(f"unknown cap rule {rule!r}")


def simulate(*, num_prompts=256, input_len=512, output_len=256, concurrency=64, offline=False, mixed_cap=256,
             arrival_ms=None, reply_ms=None, idle_window_ms=0.0, max_batched_tokens=8192, block_size=16,
             num_kv_blocks=40000, max_model_len=4096, cap_rule: str = "fixed", prices: Prices | str = H200_RUN90,
             warmup: bool = True, offline_warm_hits: bool = False, seed: int = 0, trace: list | None = None) -> dict:
    """One run. `trace`, if a list, gets (is_prefill, num_seqs, num_tokens, decode_rows, start_ms, end_ms) a step.
    `offline_warm_hits`: the offline warm-up runs the first `concurrency` measured prompts (the suite's protocol up
    to runs 99-101, whose measured offline runs then found them cached); else prompts of its own (since session
    28's fix: a cold reference)."""
    from metainfer.bench.serve import percentile
    from metainfer.engine.block_manager import BlockManager
    from metainfer.engine.scheduler import Scheduler
    from metainfer.engine.sequence import Sequence
    from metainfer.sampling_params import SamplingParams

    prices = PRICES[prices] if isinstance(prices, str) else prices
    rng, reply_rng = random.Random(seed), random.Random(seed + 1)
    arrival_ms = prices.arrival_ms if arrival_ms is None else arrival_ms
    reply_ms = prices.reply_ms if reply_ms is None else reply_ms
    sched = Scheduler(BlockManager(num_kv_blocks, block_size), concurrency, max_batched_tokens, max_model_len,
                      max_mixed_prefill_tokens=None if offline else mixed_cap)
    fixed_cap = sched.max_mixed_prefill_tokens

    def request(i: int, params, tag: str = "") -> Sequence:  # distinct prompts: no prefix hits but the warm-up's
        return Sequence(f"{tag}{i}", 0, [1000 + (i * 7919 + j * 104729) % 100000 for j in range(input_len)], params)

    if warmup:  # the suite's offline warm-up: the first `concurrency` prompts; bench serve's: the first, 4 tokens
        params = SamplingParams(temperature=0, max_tokens=8 if offline else 4, ignore_eos=True)
        first = num_prompts if offline and not offline_warm_hits else 0
        for i in range(min(concurrency if offline else 1, num_prompts)):
            sched.add(request(first + i, params, "warm-"))
        while sched.running or sched.waiting:
            batch = sched.schedule()
            sampling = batch.sampling_seqs
            sched.after_step(batch)
            for seq in sampling:
                seq.token_ids.append(7)
            for seq in batch.seqs:
                sched.block_manager.register_full_blocks(seq)
            for seq in sampling:
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.finish_reason = "length"
                    sched.finish(seq)

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    made = 0
    sent: list[tuple[float, Sequence]] = []  # (time the engine can take it, request), in arrival order
    client_sent: dict[str, float] = {}  # request -> when its client sent it (the TTFT's start)
    server_free = 0.0  # the HTTP process handles one request at a time

    def send(client_at: float, engine_at: float) -> None:
        nonlocal made, server_free
        if made < num_prompts:
            server_free = max(server_free, engine_at) + arrival_ms
            seq = request(made, params)
            sent.append((server_free, seq))
            client_sent[seq.seq_id] = client_at
            made += 1

    first = min(concurrency, num_prompts)
    if offline:
        for _ in range(num_prompts):
            sent.append((0.0, request(made, params)))
            client_sent[sent[-1][1].seq_id] = 0.0
            made += 1
        add_ms = prices.offline_add_ms
    else:
        add_ms = prices.add_ms
        for i in range(first):
            send(0.0, prices.start_ms if i == 0 else prices.start_ms + prices.first_gap_ms)
    host = 0.0  # the engine loop's clock
    in_flight = None  # (batch, sampling seqs, end ms): the launched step not read back
    last_end = 0.0  # the device's end of the last launched step
    last_token: dict[str, float] = {}
    itls, ttfts, steps, end = [], [], 0, 0.0
    while made < num_prompts or sent or sched.running or sched.waiting or in_flight:
        if not (sched.running or sched.waiting or in_flight):  # idle: block on the pipe (and wait for more)
            host = max(host, sent[0][0]) + idle_window_ms
        while sent and sent[0][0] <= host:  # take everything queued; arrivals while adding are taken too
            t, seq = sent.pop(0)
            host = max(host, t) + add_ms
            sched.add(seq)
        if not offline:
            sched.max_mixed_prefill_tokens = _cap(cap_rule, sched, prices, fixed_cap, concurrency,
                                                  max_batched_tokens)
        batch = sched.schedule()
        launched = None
        if batch is not None:
            start = max(host, last_end)
            cost = prices.step_ms(batch.num_decode_rows, batch.num_prefill_tokens)
            last_end = start + cost * (1.0 + rng.gauss(0.0, prices.step_sd) if prices.step_sd else 1.0)
            steps += 1
            if trace is not None:
                trace.append((batch.is_prefill, len(batch.seqs), batch.num_tokens, batch.num_decode_rows, start,
                              last_end))
            sampling = batch.sampling_seqs
            sched.after_step(batch)
            index = [seq.add_pending(row) for row, seq in enumerate(sampling)]
            launched = (batch, sampling, index, last_end)
        done, in_flight = in_flight, launched  # nothing launched: read back what is in flight
        if done is None:
            if batch is None:
                if not sent:
                    raise RuntimeError("the scheduler made no progress")
                host = max(host, sent[0][0])
            continue
        batch_done, sampling, index, now = done
        host = max(host, now)
        end = now
        for i, seq in zip(index, sampling):
            seq.resolve_pending(i, 7)
            if seq.seq_id in last_token:
                itls.append(now - last_token[seq.seq_id])
            else:
                ttfts.append(now - client_sent[seq.seq_id])
            last_token[seq.seq_id] = now
        for seq in batch_done.seqs:
            sched.block_manager.register_full_blocks(seq)
        for seq in sampling:
            if seq.num_known_output_tokens >= output_len:  # its last token read back
                seq.finish_reason = "length"
                sched.finish(seq)
                if not offline:
                    delay = reply_ms + (reply_rng.expovariate(1 / prices.reply_jitter_ms) if prices.reply_jitter_ms
                                        else 0.0)
                    send(now + delay, now + delay)
    median, p99 = percentile(itls, 50), percentile(itls, 99)
    client_median, client_p99 = median + prices.client_itl_ms[0], p99 + prices.client_itl_ms[1]
    return {"seconds": round(end / 1e3, 3), "output_tok_s": round(num_prompts * output_len / end * 1e3, 1),
            "steps": steps, "itl_median_ms": round(client_median, 2), "itl_p99_ms": round(client_p99, 2),
            "itl_p99_over_median": round(client_p99 / client_median, 3),
            "engine_itl_median_ms": round(median, 2), "engine_itl_p99_ms": round(p99, 2),
            "ttft_mean_ms": round(sum(ttfts) / len(ttfts), 1), "ttft_max_ms": round(max(ttfts), 1)}


def validate(name: str, seed: int = 0) -> dict:
    """The simulation of a price set's run beside that run's measured figures (MEASURED)."""
    offline = simulate(offline=True, offline_warm_hits=True, prices=name, seed=seed)  # as those runs measured it
    serve = simulate(prices=name, seed=seed)
    sim = {"serve_s": serve["seconds"], "serve_steps": serve["steps"], "offline_s": offline["seconds"],
           "offline_steps": offline["steps"], "of_offline": round(offline["seconds"] / serve["seconds"], 4),
           "itl_median_ms": serve["itl_median_ms"], "itl_p99_ms": serve["itl_p99_ms"],
           "engine_itl_median_ms": serve["engine_itl_median_ms"], "engine_itl_p99_ms": serve["engine_itl_p99_ms"],
           "ttft_mean_ms": serve["ttft_mean_ms"]}
    return {"sim": sim, "measured": MEASURED[name]}


def _mean_run(seeds: int, **kw) -> dict:
    """simulate() over seeds 0..seeds-1: each figure's mean (the step prices' spread moves them a little)."""
    runs = [simulate(seed=s, **kw) for s in range(seeds)]
    return {k: round(sum(r[k] for r in runs) / len(runs), 4) for k in runs[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prices", default="h100_run99,h200_run101", help=f"comma list of price sets: {', '.join(PRICES)}")
    p.add_argument("--arrival-ms", default=None, help="comma list: the server's time a request (serialised); "
                   "default: the price set's")
    p.add_argument("--idle-window-ms", default="0", help="comma list: an idle engine's wait for more requests")
    p.add_argument("--mixed-cap", default="256", help="comma list: serve's max_mixed_prefill_tokens (0: none)")
    p.add_argument("--cap-rule", default="fixed", help="comma list: " + CAP_RULES)
    p.add_argument("--seeds", type=int, default=1, help="runs a row (step-price spread), figures averaged")
    p.add_argument("--validate", action="store_true", help="each price set's simulation beside its measured run")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.validate:
        for name in MEASURED:
            v = validate(name)
            pairs = (f"{key} {v['sim'][key]} ({measured})" for key, measured in v["measured"].items())
            print(f"{name}, simulated (measured): " + ", ".join(pairs))
        return
    rows = []
    for name in args.prices.split(","):
        prices = PRICES[name]
        offline = _mean_run(args.seeds, offline=True, prices=prices)
        print(f"{name}: offline {offline['output_tok_s']:.0f} tok/s, {offline['steps']:.0f} steps, "
              f"{offline['seconds']:.3f} s")
        arrivals = [None] if args.arrival_ms is None else [float(a) for a in args.arrival_ms.split(",")]
        grid = [(a, float(w), int(c), rule) for a in arrivals for w in args.idle_window_ms.split(",")
                for c in args.mixed_cap.split(",") for rule in args.cap_rule.split(",")]
        for arrival, window, cap, rule in grid:
            r = _mean_run(args.seeds, arrival_ms=arrival, idle_window_ms=window, mixed_cap=cap or None,
                          cap_rule=rule, prices=prices)
            r.update(prices=name, arrival_ms=arrival, idle_window_ms=window, mixed_cap=cap, cap_rule=rule,
                     of_offline=round(offline["seconds"] / r["seconds"], 4))
            rows.append(r)
            print(f"  cap {cap} {rule}, idle window {window} ms: {r['of_offline']:.2%} of offline, {r['steps']:.0f} "
                  f"steps, ITL {r['itl_median_ms']:.2f} / {r['itl_p99_ms']:.2f} ms ({r['itl_p99_over_median']:.3f}x; "
                  f"engine {r['engine_itl_median_ms']:.2f} / {r['engine_itl_p99_ms']:.2f}), TTFT mean "
                  f"{r['ttft_mean_ms']:.0f} max {r['ttft_max_ms']:.0f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rules": rows}, f, indent=1)


if __name__ == "__main__":
    main()
