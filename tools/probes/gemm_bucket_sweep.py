"""Throwaway probe: cuBLAS time of the Qwen3-8B decode GEMMs at every graph bucket (16..512 rows), as x @ W^T and as
(W @ x^T)^T, so that a bucket whose GEMM is slower than a larger bucket's (a heuristic miss) shows."""
import json
import os

import torch


def time_graph(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps * 1000)
    return best


SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
res = {"gpu": torch.cuda.get_device_name(), "us": {}}
for name, (n, k) in SHAPES.items():
    copies = 2 if name == "lm_head" else 4
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
    rows = {}
    for m in range(16, 513, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        direct = time_graph(lambda i, x=x, ws=ws, copies=copies: torch.mm(x, ws[i % copies].t()))
        swapped = time_graph(lambda i, x=x, ws=ws, copies=copies: torch.mm(ws[i % copies], x.t()))
        rows[m] = [round(direct, 2), round(swapped, 2)]
    res["us"][name] = rows
    line = " ".join(f"{m}:{d:.0f}/{t:.0f}" for m, (d, t) in rows.items())
    print(name, line, flush=True)
    del ws
with open(os.path.join(os.environ.get("OUT", "."), "gemm_bucket_sweep.json"), "w") as f:
    json.dump(res, f, indent=1)
