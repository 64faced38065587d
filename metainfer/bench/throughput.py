"""`metainfer bench throughput`: nano-vllm's offline protocol by default.

256 sequences, input and output lengths uniform in [100, 1024], random token ids in
[0, 10000), ignore_eos, temperature 0.6; one warm-up request. Output tok/s counts the
generated tokens only; total tok/s adds the prompt tokens.
"""

from __future__ import annotations

import argparse
import random
import time

from metainfer.bench.common import run_on_engine, sync, write_json


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


def run_throughput(llm, num_seqs=256, min_in=100, max_in=1024, min_out=100, max_out=1024, progress=True) -> dict:
    from metainfer import SamplingParams

    device = llm.llm_engine.config.torch_device
    prompts, params = make_requests(num_seqs, min_in, max_in, min_out, max_out,
                                    vocab=llm.llm_engine.spec.vocab_size)
    llm.generate(prompts[0], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    sync(device)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(p.max_tokens for p in params), "a request stopped early"
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {"num_seqs": num_seqs, "input_range": [min_in, max_in], "output_range": [min_out, max_out],
            "elapsed_s": elapsed, "input_tokens": in_tokens, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
            "preemptions": llm.llm_engine.scheduler.num_preemptions}


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("throughput", help="offline throughput (nano-vllm protocol by default)")
    add_engine_args(p)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--output-json", default=None)
    p.set_defaults(bench_func=main)


def main(args: argparse.Namespace, engine_kwargs) -> dict:
    record = run_on_engine("throughput", args, engine_kwargs, lambda llm: run_throughput(
        llm, args.num_seqs, args.min_input_len, args.max_input_len, args.min_output_len, args.max_output_len))
    print(f"{record['num_seqs']} seqs: {record['output_tok_s']:.1f} output tok/s, "
          f"{record['total_tok_s']:.1f} total tok/s in {record['elapsed_s']:.1f} s "
          f"({record['preemptions']} preemptions)")
    write_json(args.output_json, record)
    return record
