"""The engine's own scheduler on a throughput protocol, with no model: preemptions, recomputed prompt tokens and
a priced timeline for each admission rule, from a config.json and a KV pool size.

    python -m tools.schedule_sim --config benchmarks/configs/qwen3-8b.json --protocol 1000x1000 \
        --num-kv-blocks 49601 --kv-reserve-ratio auto,0

Why: `tools.throughput_floor` schedules ideally (an unbounded pool), so it cannot show what the pool costs. This
drives `metainfer.engine.scheduler.Scheduler` and `BlockManager` (the engine's, unchanged) through the protocol's
own requests (the bench's seed; whether the config routes experts passed on as the engine does, for the KV
reserve's rule below its threshold), every sampled token read back at once, and prices each step as the floor does
(`throughput_floor.model_costs`): max(weight bytes, GEMM FLOPs) + max(KV bytes, attention FLOPs). The
prices are a floor's, not the GPU's; what the tool measures is the schedule (steps, rows, recomputation) and
the difference between rules at those prices (`--step-overhead-ms` adds a fixed cost a step, to see how a rule
that runs more, emptier steps fares when steps cost more than their bytes). `--stop-fraction a,b` makes each
request stop (finish_reason "stop") after U[a, b] x its max_tokens, the case where reserving all of max_tokens
would be too cautious.
"""

from __future__ import annotations

import argparse
import json
import random

from tools.throughput_floor import PROTOCOLS, model_costs, weight_bytes


def simulate(config: dict, protocol: str, num_kv_blocks: int, kv_reserve_ratio: float | None, *, block_size=16,
             max_num_seqs: int | None = None, max_batched_tokens=8192, max_model_len=4096, kv_elem_bytes=2.0,
             bw=4.3e12, flops=790e12, stop_fraction: tuple[float, float] | None = None, step_overhead_s=0.0,
             num_prompts: int | None = None, kv_reserve_min_running: int | None = None) -> dict:
    from metainfer.bench.throughput import DECODE_BINS, make_requests
    from metainfer.engine.block_manager import BlockManager
    from metainfer.engine.scheduler import Scheduler
    from metainfer.engine.sequence import Sequence

    num_seqs, (min_in, max_in), (min_out, max_out), default_seqs = PROTOCOLS[protocol]
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    num_seqs = num_prompts or num_seqs
    costs = model_costs(config, kv_elem_bytes)
    sched = Scheduler(BlockManager(num_kv_blocks, block_size), max_num_seqs or default_seqs, max_batched_tokens,
                      max_model_len, kv_reserve_ratio=kv_reserve_ratio, routed_experts=costs.moe_layers > 0,
                      **({} if kv_reserve_min_running is None else {"kv_reserve_min_running": kv_reserve_min_running}))
    prompts, params = make_requests(num_seqs, min_in, max_in, min_out, max_out, vocab=config["vocab_size"])
    rng = random.Random(1)
    stop_at = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        seq = Sequence(str(i), 0, prompt["prompt_token_ids"], sp)
        stop_at[seq.seq_id] = max(1, round(sp.max_tokens * rng.uniform(*stop_fraction))) if stop_fraction \
            else sp.max_tokens
        sched.add(seq)
    t = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0, "decode_steps": 0, "prefill_tokens": 0,
         "decode_rows": 0, "output_tokens": 0}
    bins: dict[str, dict] = {}  # decode steps by rows, the bench timeline's bins (its `decode`), at the floor's prices
    while (batch := sched.schedule()) is not None:
        tokens = batch.num_tokens
        context = sum(s.num_computed_tokens + s.num_scheduled_tokens for s in batch.seqs)
        pairs = sum((s.num_computed_tokens + (s.num_scheduled_tokens + 1) / 2) * s.num_scheduled_tokens
                    for s in batch.seqs)
        gemm = max(weight_bytes(costs, tokens) / bw, 2 * costs.active_params * tokens / flops)
        attention = max(context * costs.kv_bytes_per_token / bw, costs.attn_flops_per_pair * pairs / flops)
        kind = "prefill" if batch.is_prefill else "decode"
        t[f"{kind}_s"] += gemm + attention + step_overhead_s
        if not batch.is_prefill:
            rows = len(batch.seqs)
            entry = bins.setdefault(f"<={next((b for b in DECODE_BINS if rows <= b), rows)}",
                                    {"steps": 0, "seqs": 0, "seconds": 0.0})
            entry["steps"] += 1
            entry["seqs"] += rows
            entry["seconds"] += gemm + attention + step_overhead_s
        t[f"{kind}_steps"] += 1
        t["prefill_tokens"] += batch.num_prefill_tokens
        t["decode_rows"] += batch.num_decode_rows
        sampling = batch.sampling_seqs
        sched.after_step(batch)
        for seq in sampling:
            seq.token_ids.append(7)
            t["output_tokens"] += 1
            if seq.num_output_tokens >= stop_at[seq.seq_id]:
                seq.finish_reason = "length" if seq.num_output_tokens >= seq.params.max_tokens else "stop"
                sched.finish(seq)
        for seq in batch.seqs:
            sched.block_manager.register_full_blocks(seq)
    seconds = t["prefill_s"] + t["decode_s"]
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {"kv_reserve_ratio": "auto" if kv_reserve_ratio is None else kv_reserve_ratio,
            "preemptions": sched.num_preemptions, "recomputed_tokens": t["prefill_tokens"] - prompt_tokens,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()},
            "rows_per_step": round(t["decode_rows"] / max(t["prefill_steps"] + t["decode_steps"], 1), 1),
            "final_ratio": round(sched.kv_reserve.ratio, 3), "seconds": round(seconds, 3),
            "decode_bins": {k: {**v, "seconds": round(v["seconds"], 4),
                                "ms_per_step": round(v["seconds"] * 1e3 / v["steps"], 3)} for k, v in bins.items()},
            "output_tok_s": round(t["output_tokens"] / seconds, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a model's config.json")
    p.add_argument("--protocol", default="1000x1000", choices=sorted(PROTOCOLS))
    p.add_argument("--num-kv-blocks", type=int, required=True,
                   help="the engine's KV pool (a GPU record's num_kv_blocks)")
    p.add_argument("--kv-reserve-ratio", default="auto,0",
                   help="comma list of admission rules: auto (learned, the default) or a ratio in [0, 1]; 0 is vLLM's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the protocol's")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-elem-bytes", type=float, default=2.0, help="2 for bf16, 1 for fp8")
    p.add_argument("--bw-tbs", type=float, default=4.3, help="copy rate, TB/s (the H200's measured 4.3)")
    p.add_argument("--tflops", type=float, default=790.0, help="bf16 GEMM rate (the H200's cuBLAS 790)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="a fixed cost added to every step (launches, sampler, host; ~2 ms on an H100 at a few rows: "
                        "run 83's 7.7 ms steps of 9 rows against 5.5 ms of weights), so fewer, fuller steps weigh more")
    p.add_argument("--stop-fraction", default=None, help="a,b: each request stops after U[a, b] x its max_tokens")
    p.add_argument("--num-prompts", type=int, default=None, help="default: the protocol's")
    p.add_argument("--kv-reserve-min-running", type=int, default=None,
                   help="running sequences from which the reserve applies (default: the engine's)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    config = json.load(open(args.config))
    stop = tuple(float(x) for x in args.stop_fraction.split(",")) if args.stop_fraction else None
    rows = []
    for rule in args.kv_reserve_ratio.split(","):
        ratio = None if rule == "auto" else float(rule)
        rows.append(simulate(config, args.protocol, args.num_kv_blocks, ratio, block_size=args.block_size,
                             max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                             kv_elem_bytes=args.kv_elem_bytes, bw=args.bw_tbs * 1e12, flops=args.tflops * 1e12,
                             stop_fraction=stop, step_overhead_s=args.step_overhead_ms / 1e3,
                             num_prompts=args.num_prompts, kv_reserve_min_running=args.kv_reserve_min_running))
        r = rows[-1]
        print(f"reserve {r['kv_reserve_ratio']}: {r['output_tok_s']:.0f} tok/s at the floor's prices, "
              f"{r['seconds']:.1f} s (prefill {r['prefill_s']:.1f} s, {r['prefill_steps']} steps; decode "
              f"{r['decode_s']:.1f} s, {r['decode_steps']} steps), {r['preemptions']} preemptions, "
              f"{r['recomputed_tokens']} tokens recomputed, {r['rows_per_step']} decode rows a step")
    if args.output_json:
        record = {"config": config["architectures"][0], "protocol": args.protocol, "num_kv_blocks": args.num_kv_blocks,
                  "kv_elem_bytes": args.kv_elem_bytes, "stop_fraction": stop, "bw_tbs": args.bw_tbs,
                  "tflops": args.tflops, "step_overhead_ms": args.step_overhead_ms, "rules": rows}
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
