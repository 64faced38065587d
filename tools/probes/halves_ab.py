"""Throwaway A/B: decode graphs as two halves on two streams (decode_halves_min_batch) against one stream, in the
engine: wall ms a decode step at R rows x context C, greedy token agreement between the variants, and the nano-vllm
protocol's throughput."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from metainfer import SamplingParams  # noqa: E402
from tools.gpu_suite.common import bench_llm, release  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config", default="benchmarks/configs/qwen3-8b.json")
p.add_argument("--tokenizer-dir", default=".gpu_assets/tokenizer")
p.add_argument("--parts", default="steps_bf16,steps_fp8,throughput")
args = p.parse_args()
OUT = os.environ.get("OUT", ".")
res = {"gpu": torch.cuda.get_device_name()}


def save():
    with open(os.path.join(OUT, "halves_ab.json"), "w") as f:
        json.dump(res, f, indent=1)


def step_case(engine, rows, prompt, tag):
    g = torch.Generator().manual_seed(rows * 7 + prompt)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": torch.randint(0, 10000, (prompt,), generator=g).tolist()},
                           params, stream=False)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    n = 16
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / n * 1e3
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return ms, outs


def steps(kv, cases, variants):
    part = {}
    tokens = {}
    for v in variants:
        llm = bench_llm(args, max_num_seqs=512, decode_halves_min_batch=v, **kv)
        eng = llm.llm_engine
        for rows, prompt in cases:
            key = f"m{rows}/ctx{prompt}"
            try:
                ms, outs = step_case(eng, rows, prompt, f"{key}-")
            except Exception as exc:  # keep what was measured
                part.setdefault(key, {})[f"halves{v}"] = f"error {type(exc).__name__}: {exc}"[:300]
                print(key, v, "error", exc, flush=True)
                continue
            part.setdefault(key, {})[f"halves{v}_ms"] = round(ms, 3)
            prev = tokens.setdefault(key, outs)
            if prev is not outs:
                same = sum(a == b for k in prev for a, b in zip(prev[k], outs.get(k, [])))
                total = sum(len(x) for x in prev.values())
                part[key][f"agreement_halves{v}"] = round(same / max(1, total), 4)
            print(key, v, part[key], flush=True)
        del llm, eng
        release()
    return part


if "steps_bf16" in args.parts:
    res["steps_bf16"] = steps({}, [(256, 576), (512, 448)], [0, 128])
    save()
if "steps_fp8" in args.parts:
    res["steps_fp8"] = steps({"kv_cache_dtype": "fp8"}, [(256, 576), (512, 1024)], [0, 128])
    save()
if "throughput" in args.parts:
    from metainfer.bench.throughput import run_throughput
    res["throughput"] = {}
    for v in (0, 128):
        llm = bench_llm(args, decode_halves_min_batch=v)
        r = run_throughput(llm, progress=False)
        res["throughput"][f"halves{v}"] = {"output_tok_s": round(r["output_tok_s"], 1),
                                           "decode_seconds": r["timeline"]["decode_seconds"]}
        print("throughput", v, res["throughput"][f"halves{v}"], flush=True)
        del llm
        release()
        save()
save()
