"""Prometheus metrics of the server (`GET /metrics`, text format): vLLM's names under `metainfer:`.

TTFT and end-to-end latency count from the moment the handler submits the request. The
`metainfer:num_requests_running_max` gauge (peak batch) and the `metainfer:step_batch_size`
histogram (requests progressed per engine step) are our own and show that requests were batched;
`metainfer:engine_step_interval_seconds` (also ours) is the time between the engine process's consecutive step
messages while requests run: the inter-token latency as the engine produced it, before the pipe, the event loop
and the SSE framing (their share is what the ITL histogram adds to it);
`metainfer:request_aborted_total` counts requests aborted because their client went away.
The latency histograms are observed in the HTTP process as each step's message arrives; the engine's gauges and
counters come in every message from the engine process (`publish_stats`, engine_core.STATS_FIELDS). One lock
keeps a renderer on another thread apart from the writer.
"""

from __future__ import annotations

import bisect
import collections
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 300)
# 2.5-ms steps from 5 to 20 ms, where a GPU's decode steps fall: a p99 read from 10-ms-wide buckets is the
# interpolation's guess (run 79's "19.8 ms" lay anywhere in 10-20), not the tail it is meant to show
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.06, 0.08, 0.15,
               0.3, 0.6, 1.2, 2.5, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1800)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.012, 0.015, 0.02, 0.025, 0.03, 0.04, 0.06, 0.1, 0.25, 1)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class ServerMetrics:
    """Written from the engine's messages, rendered by GET /metrics (one lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.peak_running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, found there
        self.prefix_cache_preempted_queries = 0  # the same at preempted requests' re-admissions
        self.prefix_cache_preempted_hits = 0
        self.kv_reserve_ratios = (0.0, 0.0)  # the KV reserve's learned ratios: requests with / without max_tokens
        self.success: collections.Counter[str] = collections.Counter()
        self.aborted = 0
        self.engine_errors = 0  # the engine died (counted here) ...
        self.core_engine_errors = 0  # ... or a step raised (counted by the engine process)
        self.failed_requests = 0  # finished with an error by the engine's fault isolation
        self.failed_steps = 0  # steps that raised and were bisected to the requests causing it
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.batch = Histogram(BATCH_BUCKETS)
        self.step_interval = Histogram(STEP_BUCKETS)

    # -- written on the event loop ---------------------------------------------------------
    def count_aborted(self, n: int) -> None:
        with self.lock:
            self.aborted += n

    def count_engine_error(self) -> None:
        """The engine process died (the steps that raised come in its stats)."""
        with self.lock:
            self.engine_errors += 1

    def observe(self, timing, num_tokens: int, finished: bool, finish_reason: str | None,
                failed: bool, now: float) -> None:
        """One request's progress: it holds `num_tokens` (its longest choice) at `now`. `timing` is what the
        histograms remember of it (`arrival`, `last_time`, `num_tokens`: engine_loop.RequestState's fields)."""
        with self.lock:
            new = num_tokens - timing.num_tokens
            if new > 0:
                if timing.num_tokens == 0:
                    self.ttft.observe(now - timing.arrival)
                else:
                    gap = (now - timing.last_time) / new
                    for _ in range(new):
                        self.itl.observe(gap)
                timing.last_time, timing.num_tokens = now, num_tokens
            if finished:
                self.e2e.observe(now - timing.arrival)
                if not failed:  # failed requests: metainfer:request_failed_total
                    self.success[finish_reason or "unknown"] += 1  # per request, as vLLM counts

    def publish_stats(self, stats: tuple) -> None:
        """The engine's gauges and counters as the engine process sent them (engine_core.STATS_FIELDS)."""
        (running, waiting, kv_usage, prompt_tokens, generation_tokens, preemptions, failed_requests, failed_steps,
         prefix_queries, prefix_hits, preempted_queries, preempted_hits, engine_errors, batch_size, step_interval,
         ratio_bounded, ratio_open) = stats
        with self.lock:
            self.running, self.waiting, self.kv_usage = running, waiting, kv_usage
            self.prompt_tokens, self.generation_tokens, self.preemptions = prompt_tokens, generation_tokens, preemptions
            self.failed_requests, self.failed_steps = failed_requests, failed_steps
            self.prefix_cache_queries, self.prefix_cache_hits = prefix_queries, prefix_hits
            self.prefix_cache_preempted_queries, self.prefix_cache_preempted_hits = preempted_queries, preempted_hits
            self.core_engine_errors = engine_errors
            self.kv_reserve_ratios = (ratio_bounded, ratio_open)
            self.peak_running = max(self.peak_running, running, batch_size)
            if batch_size:
                self.batch.observe(batch_size)
            if step_interval > 0:
                self.step_interval.observe(step_interval)

    # -- read by the HTTP handlers --------------------------------------------------------------
    def render(self, model_name: str) -> str:
        label = f'model_name="{_escape(model_name)}"'
        out: list[str] = []

        def head(name, kind, text):
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        def scalar(name, kind, value, text):
            head(name, kind, text)
            out.append(f"{name}{{{label}}} {_num(value)}")

        def histogram(name, h: Histogram, text):
            head(name, "histogram", text)
            total = 0
            for bound, count in zip(h.buckets + (float("inf"),), h.counts):
                total += count
                le = "+Inf" if bound == float("inf") else _num(bound)
                out.append(f'{name}_bucket{{{label},le="{le}"}} {total}')
            out.append(f"{name}_sum{{{label}}} {_num(h.sum)}")
            out.append(f"{name}_count{{{label}}} {h.count}")

        with self.lock:
            for name, kind, value, text in (
                ("metainfer:num_requests_running", "gauge", self.running, "Sequences in the engine's running batch."),
                ("metainfer:num_requests_waiting", "gauge", self.waiting, "Sequences waiting to be scheduled."),
                ("metainfer:kv_cache_usage_perc", "gauge", self.kv_usage,
                 "Fraction of KV cache blocks in use (0 to 1)."),
                ("metainfer:num_requests_running_max", "gauge", self.peak_running,
                 "Most requests running at once (or progressed in one step) since the server started."),
                ("metainfer:prompt_tokens_total", "counter", self.prompt_tokens, "Prefill tokens computed."),
                ("metainfer:generation_tokens_total", "counter", self.generation_tokens, "Tokens generated."),
                ("metainfer:num_preemptions_total", "counter", self.preemptions, "Sequences preempted for KV space."),
                ("metainfer:prefix_cache_queries_total", "counter", self.prefix_cache_queries,
                 "Prompt tokens looked up in the prefix cache."),
                ("metainfer:prefix_cache_hits_total", "counter", self.prefix_cache_hits,
                 "Prompt tokens found in the prefix cache."),
                ("metainfer:prefix_cache_preempted_queries_total", "counter", self.prefix_cache_preempted_queries,
                 "Prompt and output tokens looked up again when preempted requests were readmitted."),
                ("metainfer:prefix_cache_preempted_hits_total", "counter", self.prefix_cache_preempted_hits,
                 "Of those, found in the prefix cache."),
            ):
                scalar(name, kind, value, text)
            head("metainfer:kv_reserve_ratio", "gauge", "Share of its allowed tokens a request is expected to "
                 "generate, learned from finished requests, by whether they set max_tokens (0: ratio fixed at 0; "
                 "the reserve applies from kv_reserve_min_running running sequences, below only while their "
                 "remaining lengths are spread).")
            for requests, ratio in zip(("bounded", "open"), self.kv_reserve_ratios):
                out.append(f'metainfer:kv_reserve_ratio{{{label},requests="{requests}"}} {_num(ratio)}')
            head("metainfer:request_success_total", "counter", "Requests finished, by finish reason.")
            for reason in sorted(set(self.success) | {"stop", "length"}):
                out.append(f'metainfer:request_success_total{{{label},finished_reason="{_escape(reason)}"}} '
                           f"{self.success[reason]}")
            for name, value, text in (
                ("metainfer:request_aborted_total", self.aborted, "Requests aborted (client went away)."),
                ("metainfer:engine_errors_total", self.engine_errors + self.core_engine_errors,
                 "Engine steps that raised and failed every request in flight."),
                ("metainfer:request_failed_total", self.failed_requests,
                 "Requests finished with an error because a step failed on their data (the rest went on)."),
                ("metainfer:isolated_step_failures_total", self.failed_steps,
                 "Engine steps that raised and were bisected to the requests that caused it."),
            ):
                scalar(name, "counter", value, text)
            for name, hist, text in (
                ("metainfer:time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("metainfer:inter_token_latency_seconds", self.itl, "Time between output tokens."),
                ("metainfer:e2e_request_latency_seconds", self.e2e, "Arrival to finish, per request."),
                ("metainfer:step_batch_size", self.batch, "Requests that progressed in one engine step."),
                ("metainfer:engine_step_interval_seconds", self.step_interval,
                 "Time between the engine's consecutive step outputs while requests run."),
            ):
                histogram(name, hist, text)
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
