"""`metainfer bench latency`: TTFT, TPOT, tok/s and achieved weight bandwidth vs a measured copy.

TTFT = wall time of a generate with max_tokens=1 (prefill + first sample). TPOT = (last token's time -
first token's time) / (output_len - 1) inside each full generate (its requests' own timestamps, the
median over the batch and then over iterations): the decode steps alone. The older figure, (median full
generate - median TTFT) / (output_len - 1), is kept as `tpot_e2e_ms`: it carries any delay at the start
of a generate call that the two timed calls do not share (run 41 on the H200: a ~15 ms start delay in
about half of the calls moved it by up to 3%). Weight bandwidth = decode weight bytes / TPOT, set
against a device-to-device copy measured in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from metainfer.bench.common import (
    add_batch_shape_args,
    add_skip_tokenizer_arg,
    copy_bandwidth,
    decode_weight_bytes,
    run_on_engine,
    sync,
    write_json,
)
from metainfer.entrypoints.cli import check_fits_context, int_at_least


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, min(vocab, 10000), (length,), generator=g).tolist()}
            for _ in range(batch)]


def run_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int = 3,
                warmup: int = 1, progress: bool = True) -> dict:
    from metainfer import SamplingParams

    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 (TPOT is measured over tokens after the first), got {output_len}")
    if min(batch_size, input_len, iters) < 1 or warmup < 0:
        raise ValueError(f"batch_size, input_len and iters must be >= 1 and warmup >= 0, got {batch_size}, "
                         f"{input_len}, {iters}, {warmup}")
    engine = llm.llm_engine
    if input_len + output_len > engine.config.max_model_len:  # the KV cache may have lowered it: outputs cut short
        raise ValueError(f"input_len + output_len is {input_len + output_len} tokens, more than the engine's "
                         f"max_model_len ({engine.config.max_model_len}; the KV cache may have lowered it)")
    device = engine.config.torch_device
    prompts = random_prompts(batch_size, input_len, engine.spec.vocab_size)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def timed(params) -> tuple[float, list]:
        sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
        return time.perf_counter() - start, outs

    def decode_seconds_per_token(outs) -> float:
        """The batch's median of each request's (last token time - first token time) / (tokens - 1)."""
        return statistics.median((o.metrics["finished_time"] - o.metrics["first_token_time"]) / (output_len - 1)
                                 for o in outs)

    for _ in range(warmup):
        timed(first), timed(full)
    ttfts, totals, tpots = [], [], []
    for i in range(iters):
        engine.block_manager.hash_to_block.clear()  # no prefix-cache hits between iterations
        ttfts.append(timed(first)[0])
        engine.block_manager.hash_to_block.clear()
        total_s, outs = timed(full)
        totals.append(total_s)
        tpots.append(decode_seconds_per_token(outs))
        if progress:
            print(f"  iter {i + 1}/{iters}: ttft {ttfts[-1] * 1e3:.2f} ms, total {totals[-1]:.3f} s, "
                  f"tpot {tpots[-1] * 1e3:.3f} ms", flush=True)
    ttft = statistics.median(ttfts)
    total = statistics.median(totals)
    tpot = statistics.median(tpots)
    tpot_e2e = (total - ttft) / (output_len - 1)
    runner = engine.runner  # the MLX runner counts its own arrays (metainfer/mlx/model_runner.py)
    weight_bytes = runner.decode_weight_bytes() if hasattr(runner, "decode_weight_bytes") else \
        decode_weight_bytes(runner.model)
    copy_bw = copy_bandwidth(device) if device.type == "cuda" else None
    achieved = weight_bytes / tpot
    record = {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iters": iters, "warmup": warmup,
        "ttfts_ms": [t * 1e3 for t in ttfts], "totals_s": totals, "tpots_ms": [t * 1e3 for t in tpots],
        "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "tpot_e2e_ms": tpot_e2e * 1e3, "total_s": total,
        "decode_tok_s": batch_size / tpot, "e2e_output_tok_s": batch_size * output_len / total,
        "weight_bytes": weight_bytes, "achieved_weight_bw_GBs": achieved / 1e9,
    }
    if copy_bw is not None:
        record.update({
            "copy_bw_GBs": copy_bw / 1e9, "bw_ratio": achieved / copy_bw,
            "roofline_tpot_ms": weight_bytes / copy_bw * 1e3,
            "roofline_tok_s": batch_size * copy_bw / weight_bytes,
        })
    return record


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("latency", help="TTFT / TPOT / bandwidth for one batch shape")
    add_engine_args(p)
    add_skip_tokenizer_arg(p)
    add_batch_shape_args(p)
    p.add_argument("--iters", type=int_at_least(1), default=3, help="timed iterations (medians are reported; "
                   "vLLM's benchmark_latency defaults to 30)")
    p.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed iterations first (vLLM's default: 10)")
    p.add_argument("--output-json", default=None, help="write the record (GPU name, library versions) here")
    p.set_defaults(bench_func=main)


def main(args: argparse.Namespace, engine_kwargs) -> dict:
    from metainfer.config import ConfigError

    if args.output_len < 2:  # checked before the engine is built: TPOT needs two tokens
        raise ConfigError(f"--output-len must be >= 2 (TPOT is timed over the tokens after the first), got "
                          f"{args.output_len}")
    check_fits_context(args, args.input_len + args.output_len, "--input-len + --output-len")
    record = run_on_engine("latency", args, engine_kwargs, lambda llm: run_latency(
        llm, args.batch_size, args.input_len, args.output_len, args.iters, warmup=args.warmup))
    print(f"batch {args.batch_size} in {args.input_len} out {args.output_len}: "
          f"TTFT {record['ttft_ms']:.2f} ms  TPOT {record['tpot_ms']:.3f} ms  "
          f"{record['decode_tok_s']:.1f} tok/s  weights {record['achieved_weight_bw_GBs']:.0f} GB/s"
          + (f" = {record['bw_ratio']:.1%} of copy {record['copy_bw_GBs']:.0f} GB/s" if "bw_ratio" in record else ""))
    write_json(args.output_json, record)
    return record
