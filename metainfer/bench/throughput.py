"""`metainfer bench throughput`: nano-vllm's offline protocol by default.

256 sequences, input and output lengths uniform in [100, 1024], random token ids in
[0, 10000], ignore_eos, temperature 0.6; one warm-up request. Output tok/s counts the
generated tokens only; total tok/s adds the prompt tokens.
"""

from __future__ import annotations

import argparse
import random
import time

from metainfer.bench.common import add_skip_tokenizer_arg, run_on_engine, sync, write_json
from metainfer.entrypoints.cli import check_fits_context


def make_requests(num_seqs: int, min_in: int, max_in: int, min_out: int, max_out: int, seed: int = 0,
                  vocab: int = 10001):
    from metainfer import SamplingParams

    rng = random.Random(seed)
    prompts, params = [], []
    top = min(vocab - 1, 10000)
    for _ in range(num_seqs):
        prompts.append({"prompt_token_ids": [rng.randint(0, top) for _ in range(rng.randint(min_in, max_in))]})
        params.append(SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(min_out, max_out)))
    return prompts, params


# Decode steps are grouped by their number of sequences (upper bounds of the bins).
DECODE_BINS = (2, 16, 64, 128, 192, 256)
FIRST_STEPS = 24


def summarize_timeline(trace: list[tuple], end: float) -> dict:
    """Where the run's time went, from the engine's step trace (LLMEngine.step_trace). A step's time
    is the interval from its launch to the next launch (the last: to `end`); with async scheduling
    that interval waits for the previous step's read-back, so in steady state it is one step's
    device time, shifted by one step."""
    out = {"prefill": {"steps": 0, "tokens": 0, "seconds": 0.0}, "decode": {}}
    for i, (t, is_prefill, num_seqs, num_tokens, *_) in enumerate(trace):
        seconds = (trace[i + 1][0] if i + 1 < len(trace) else end) - t
        if is_prefill:
            entry = out["prefill"]
            entry["tokens"] += num_tokens
        else:
            upper = next((b for b in DECODE_BINS if num_seqs <= b), num_seqs)
            entry = out["decode"].setdefault(f"<={upper}", {"steps": 0, "seqs": 0, "seconds": 0.0})
            entry["seqs"] += num_seqs
        entry["steps"] += 1
        entry["seconds"] += seconds
    for entry in [out["prefill"], *out["decode"].values()]:
        entry["ms_per_step"] = entry["seconds"] * 1e3 / max(entry["steps"], 1)
    out["decode_seconds"] = sum(e["seconds"] for e in out["decode"].values())
    # the first steps one by one (prefill, then the first decode steps): where a warm-up cost shows
    out["first_steps_ms"] = [[("prefill" if p else "decode"), n, tok, round(((trace[i + 1][0] if i + 1 < len(trace)
                              else end) - t) * 1e3, 2)] for i, (t, p, n, tok, *_) in enumerate(trace[:FIRST_STEPS])]
    return out


def _allocator_counts(device) -> dict:
    """CUDA caching-allocator counters: device mallocs/frees and retries (a retry frees the cache
    and synchronises the device: a sign that the KV pool left the activations too little room)."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def run_throughput(llm, num_seqs=256, min_in=100, max_in=1024, min_out=100, max_out=1024, progress=True) -> dict:
    from metainfer import SamplingParams

    engine = llm.llm_engine
    if max_in + max_out > engine.config.max_model_len:  # the KV cache may have lowered it: outputs cut short
        raise ValueError(f"max_input_len + max_output_len is {max_in + max_out} tokens, more than the engine's "
                         f"max_model_len ({engine.config.max_model_len}; the KV cache may have lowered it)")
    device = engine.config.torch_device
    prompts, params = make_requests(num_seqs, min_in, max_in, min_out, max_out, vocab=engine.spec.vocab_size)
    # warm-up on a prompt of its own: reusing a measured one would make its blocks prefix-cache hits
    llm.generate({"prompt_token_ids": list(range(1, 17))}, SamplingParams(max_tokens=8), use_tqdm=False)
    sync(device)
    kept = engine.step_trace  # an engine built with step_trace_path keeps its own record: this run's steps join it
    engine.step_trace = []
    allocs_before = _allocator_counts(device)
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=progress)
        sync(device)
        end = time.perf_counter()
        trace = engine.step_trace
    finally:
        engine.step_trace = None if kept is None else kept + engine.step_trace
    elapsed = end - start
    allocator = {k: v - allocs_before.get(k, 0) for k, v in _allocator_counts(device).items()}
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(p.max_tokens for p in params), "a request stopped early"
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {"num_seqs": num_seqs, "input_range": [min_in, max_in], "output_range": [min_out, max_out],
            "elapsed_s": elapsed, "input_tokens": in_tokens, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
            "preemptions": engine.scheduler.num_preemptions, "kv_reserve_ratio": engine.scheduler.kv_reserve.ratio,
            "timeline": summarize_timeline(trace, end),
            "allocator": allocator}


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("throughput", help="offline throughput (nano-vllm protocol by default)")
    add_engine_args(p)
    add_skip_tokenizer_arg(p)
    p.add_argument("--num-seqs", type=int, default=256, help="requests (default 256)")
    p.add_argument("--min-input-len", type=int, default=100, help="shortest random prompt (default 100)")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest random prompt (default 1024)")
    p.add_argument("--min-output-len", type=int, default=100, help="fewest tokens generated (default 100)")
    p.add_argument("--max-output-len", type=int, default=1024, help="most tokens generated (default 1024)")
    p.add_argument("--output-json", default=None, help="write the record (GPU name, library versions) here")
    p.set_defaults(bench_func=main)


def main(args: argparse.Namespace, engine_kwargs) -> dict:
    from metainfer.entrypoints.cli import usage_error

    if args.num_seqs < 1:  # before the model loads
        usage_error(f"--num-seqs must be >= 1, got {args.num_seqs}")
    for low, high in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        lo, hi = getattr(args, low), getattr(args, high)
        if not 1 <= lo <= hi:
            usage_error(f"--{low.replace('_', '-')} and --{high.replace('_', '-')} need 1 <= min <= max, "
                        f"got {lo}, {hi}")
    check_fits_context(args, args.max_input_len + args.max_output_len, "--max-input-len + --max-output-len")
    record = run_on_engine("throughput", args, engine_kwargs, lambda llm: run_throughput(
        llm, args.num_seqs, args.min_input_len, args.max_input_len, args.min_output_len, args.max_output_len))
    print(f"{record['num_seqs']} seqs: {record['output_tok_s']:.1f} output tok/s, "
          f"{record['total_tok_s']:.1f} total tok/s in {record['elapsed_s']:.1f} s "
          f"({record['preemptions']} preemptions)")
    timeline = record["timeline"]
    pre = timeline["prefill"]
    print(f"  prefill: {pre['steps']} steps, {pre['tokens']} tokens, {pre['seconds']:.2f} s; decode "
          f"{timeline['decode_seconds']:.2f} s: " + ", ".join(
              f"{k} seqs {v['steps']} steps x {v['ms_per_step']:.2f} ms" for k, v in timeline["decode"].items()))
    write_json(args.output_json, record)
    return record
