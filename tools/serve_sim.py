"""`bench serve`'s closed loop against the engine's own scheduler, with no model: how admission rules move the share
of offline throughput and the inter-token latencies, priced by measured step costs.

    python -m tools.serve_sim [--arrival-ms 0.5] [--idle-window-ms 0,5] [--mixed-cap 256]

Why: the serve-vs-offline figure (issue 23: >= 90% of offline, ITL p99 <= 2x the median) is set by how the first
wave of a closed-loop benchmark is admitted (docs/PERFORMANCE.md, runs 93-94: ~130 extra steps of ramp and drain
under the 256-token mixed cap) and a rule's effect on it needs a GPU run to measure. This drives
`metainfer.engine.scheduler.Scheduler` and `BlockManager` (the engine's, unchanged) through `bench serve`'s
protocol: `concurrency` clients, each sending its next request when the previous one ends; the server takes
`arrival_ms` of one process's time per request (parsing, tokenizing: serialised), the engine takes what has arrived
before each step. A step costs `decode_ms(rows) + prompt_ms x prompt tokens` (run 90's H200 decode bins, run 65's
~21 us a prompt token beside decodes and ~24 us in a prefill-only step), every token of a step arrives at its end.
The offline run is the same engine with every request waiting at 0 and no mixed cap (the suite's offline side).
`idle_window_ms`: an idle engine that receives a request waits this long for more before its first step (the rule
this tool was written to price). The prices are the GPU's measured ones; what the tool measures is the schedule.
"""

from __future__ import annotations

import argparse
import bisect
import json

# H200, Qwen3-8B dims: decode ms a step by rows at the protocol's contexts (512-768 tokens), interpolated between:
# 1 row 4.0 (run 90's bs1 TPOT), 64 rows 6.2 (run 65's decode-only step beside its mixed one), 128-256 rows run 90's
# throughput bins (mixed contexts up to 2,048)
DECODE_MS = ((1, 4.0), (16, 4.6), (64, 6.2), (128, 9.65), (192, 11.81), (256, 13.69))
MIXED_PROMPT_MS = 0.021  # run 65: 64 decodes + a 512-token prompt 16.4 ms against 6.2 decode-only
PREFILL_PROMPT_MS = 0.021  # run 90: TTFT 25.3 ms at 1,024 tokens; fitted to run 93's offline 8.80 s


def decode_ms(rows: int) -> float:
    if rows <= 0:
        return 0.0
    xs = [r for r, _ in DECODE_MS]
    i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
    (r0, t0), (r1, t1) = DECODE_MS[i - 1], DECODE_MS[i]
    return t0 + (t1 - t0) * (min(rows, r1) - r0) / (r1 - r0)


def step_ms(decode_rows: int, prompt_tokens: int) -> float:
    if decode_rows == 0:
        return decode_ms(1) + PREFILL_PROMPT_MS * prompt_tokens
    return decode_ms(decode_rows) + MIXED_PROMPT_MS * prompt_tokens


def simulate(*, num_prompts=256, input_len=512, output_len=256, concurrency=64, offline=False, mixed_cap=256,
             arrival_ms=0.5, reply_ms=1.0, idle_window_ms=0.0, max_batched_tokens=8192, block_size=16,
             num_kv_blocks=40000, max_model_len=4096, cap_rule: str = "fixed") -> dict:
    from metainfer.engine.block_manager import BlockManager
    from metainfer.engine.scheduler import Scheduler
    from metainfer.engine.sequence import Sequence
    from metainfer.sampling_params import SamplingParams

    sched = Scheduler(BlockManager(num_kv_blocks, block_size), concurrency, max_batched_tokens, max_model_len,
                      max_mixed_prefill_tokens=None if offline else mixed_cap)
    fixed_cap = sched.max_mixed_prefill_tokens
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    made = 0

    def request(i: int) -> Sequence:  # distinct prompts: no prefix hits, as bench serve's random ones
        return Sequence(str(i), 0, [1000 + (i * 7919 + j * 104729) % 100000 for j in range(input_len)], params)

    sent: list[tuple[float, Sequence]] = []  # (time the engine has it, request), in arrival order
    server_free = 0.0  # the HTTP process handles one request at a time

    def send(at: float) -> None:
        nonlocal made, server_free
        if made < num_prompts:
            server_free = max(server_free, at) + (0.0 if offline else arrival_ms)
            sent.append((server_free, request(made)))
            made += 1

    for _ in range(min(concurrency, num_prompts)):
        send(0.0)
    now, last_token = 0.0, {}
    itls, ttfts, steps = [], [], 0
    first_arrival = {seq.seq_id: t for t, seq in sent}
    while made < num_prompts or sent or sched.running or sched.waiting:
        if not sched.running and not sched.waiting:
            now = max(now, sent[0][0]) + idle_window_ms  # idle: wake on the first arrival (and wait for more)
        while sent and sent[0][0] <= now:
            t, seq = sent.pop(0)
            first_arrival[seq.seq_id] = t
            sched.add(seq)
        if cap_rule == "rows" and not offline:  # prompt tokens x decode rows <= cap x concurrency
            sched.max_mixed_prefill_tokens = max(fixed_cap, fixed_cap * concurrency // max(len(sched.running), 1))
        elif cap_rule.startswith("below") and not offline:  # uncapped below N running rows
            few = len(sched.running) < int(cap_rule[5:])
            sched.max_mixed_prefill_tokens = max_batched_tokens if few else fixed_cap
        batch = sched.schedule()
        if batch is None:
            now = sent[0][0] if sent else now
            continue
        now += step_ms(batch.num_decode_rows, batch.num_prefill_tokens)
        steps += 1
        sampling = batch.sampling_seqs
        sched.after_step(batch)
        for seq in sampling:
            seq.token_ids.append(7)
            if seq.seq_id in last_token:
                itls.append(now - last_token[seq.seq_id])
            else:
                ttfts.append(now - first_arrival[seq.seq_id])
            last_token[seq.seq_id] = now
            if seq.num_output_tokens >= output_len:
                seq.finish_reason = "length"
                sched.finish(seq)
                send(now + reply_ms)
        for seq in batch.seqs:
            sched.block_manager.register_full_blocks(seq)
    itls.sort()
    return {"seconds": round(now / 1e3, 3), "output_tok_s": round(num_prompts * output_len / now * 1e3, 1),
            "steps": steps, "itl_median_ms": round(itls[len(itls) // 2], 2),
            "itl_p99_ms": round(itls[int(len(itls) * 0.99)], 2),
            "ttft_mean_ms": round(sum(ttfts) / len(ttfts), 1), "ttft_max_ms": round(max(ttfts), 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arrival-ms", default="0.5", help="comma list: the server's time a request (serialised)")
    p.add_argument("--idle-window-ms", default="0,5", help="comma list: an idle engine's wait for more requests")
    p.add_argument("--mixed-cap", default="256", help="comma list: serve's max_mixed_prefill_tokens (0: none)")
    p.add_argument("--cap-rule", default="fixed",
                   help="comma list: fixed (the engine's), rows (prompt tokens x rows <= cap x concurrency), belowN "
                        "(uncapped while fewer than N sequences run)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    offline = simulate(offline=True)
    rows = []
    print(f"offline: {offline['output_tok_s']:.0f} tok/s, {offline['steps']} steps")
    grid = [(float(a), float(w), int(c), rule) for a in args.arrival_ms.split(",")
            for w in args.idle_window_ms.split(",") for c in args.mixed_cap.split(",")
            for rule in args.cap_rule.split(",")]
    for arrival, window, cap, rule in grid:
        r = simulate(arrival_ms=arrival, idle_window_ms=window, mixed_cap=cap or None, cap_rule=rule)
        r.update(arrival_ms=arrival, idle_window_ms=window, mixed_cap=cap, cap_rule=rule,
                 of_offline=round(r["output_tok_s"] / offline["output_tok_s"], 4))
        rows.append(r)
        itl_ratio = r["itl_p99_ms"] / r["itl_median_ms"]
        print(f"arrival {arrival} ms, idle window {window} ms, cap {cap} {rule}: {r['of_offline']:.1%} of offline, "
              f"{r['steps']} steps, ITL {r['itl_median_ms']} / {r['itl_p99_ms']} ms ({itl_ratio:.2f}x), "
              f"TTFT mean {r['ttft_mean_ms']} max {r['ttft_max_ms']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"offline": offline, "rules": rows}, f, indent=1)


if __name__ == "__main__":
    main()
