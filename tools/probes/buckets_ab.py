"""Throwaway A/B: decode graph buckets from the gemm_rows table (416 and 448 rows replay the 432 / 464 graphs on an
H100) against every bucket, in the engine: wall ms a decode step at R rows x 448-token prompts (bf16)."""
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.getcwd())
from metainfer import SamplingParams  # noqa: E402
from metainfer.worker import cuda_graphs  # noqa: E402
from tools.gpu_suite.common import bench_llm, release  # noqa: E402

args = SimpleNamespace(config="benchmarks/configs/qwen3-8b.json", tokenizer_dir=".gpu_assets/tokenizer")
res = {"gpu": torch.cuda.get_device_name()}
chosen = cuda_graphs.decode_batch_sizes


def step_ms(engine, rows, prompt=448, tag=""):
    g = torch.Generator().manual_seed(rows)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(rows):
        ids = torch.randint(0, 10000, (prompt,), generator=g).tolist()
        engine.add_request(f"{tag}{rows}-{i}", {"prompt_token_ids": ids}, params, stream=False)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(4):
        engine.step()
    running = len(sched.running)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(16):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / 16 * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return round(ms, 3), running


for variant in ("every_bucket", "table"):
    every = lambda n, m, t: cuda_graphs.graph_batch_sizes(n)  # noqa: E731
    cuda_graphs.decode_batch_sizes = every if variant == "every_bucket" else chosen
    llm = bench_llm(args, max_num_seqs=512)
    eng = llm.llm_engine
    row = {"buckets": eng.runner.graphs.batch_sizes[-12:]}
    for rows in (416, 448):
        row[f"m{rows}"] = step_ms(eng, rows, tag=variant)
    res[variant] = row
    print(variant, row, flush=True)
    del llm, eng
    release()
    with open(os.path.join(os.environ.get("OUT", "."), "buckets_ab.json"), "w") as f:
        json.dump(res, f, indent=1)
