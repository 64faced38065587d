"""cuBLAS's time per decode weight shape at every decode graph row count: the `gemm_rows` table of a GPU.

    python -m tools.tune_gemm_rows [--out gemm_rows.json] [--write-config]

`--write-config` merges the table into the `gemm_rows` section of this GPU's shipped JSON (metainfer/kernels/configs/
<device>.json), from which the engine leaves out a decode graph bucket whose GEMMs a larger bucket beats
(worker/cuda_graphs.py: decode_batch_sizes). Why: cuBLAS's kernel choice is not monotone in the row count (run 127,
H100: the Qwen3-8B decode set takes 11.05 ms at 416 rows and 9.30 at 432). Method: torch.mm (the engine's F.linear
without bias) in a CUDA graph of 20 launches rotating over 4 weight copies (larger than the L2 together), median of 5
replays (the shipped H100 table came from run 127's probe of the same launches, best of 5); rows from 32 (below it
the skinny GEMM and the GEMV take the rows) to 512 in the graph buckets' steps of 16.
"""

from __future__ import annotations

import argparse
import json

import torch

from tools.tune_gemv import QWEN3_8B_DECODE_SHAPES, _env, save_sweep, time_graph, write_tuned_section

ROWS = tuple(range(32, 513, 16))
DECODER_SHAPES = {name: shape for name, shape in QWEN3_8B_DECODE_SHAPES.items() if name != "lm_head"}  # in the graph


def sweep(shapes=DECODER_SHAPES, rows=ROWS, device="cuda", copies: int = 4, calls: int = 20, replays: int = 5) -> dict:
    """{"env", "us": {name: {rows: us}}, "table": {"NxK": {"rows": us}}} over `shapes` at `rows`."""
    res = {"env": _env(device), "us": {}, "table": {}}
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        per_rows = {}
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            launches = [lambda w=weights[i % copies], x=x: torch.mm(x, w.t()) for i in range(calls)]
            per_rows[m] = round(time_graph(launches, replays) * 1e3 / calls, 2)
        res["us"][name] = per_rows
        res["table"][f"{n}x{k}"] = {str(m): us for m, us in per_rows.items()}
        print(name, " ".join(f"{m}:{us:.1f}" for m, us in per_rows.items()), flush=True)
        del weights
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--write-config", action="store_true",
                   help="merge the table into the gemm_rows section of the GPU's kernels/configs JSON")
    args = p.parse_args(argv)
    res = sweep()
    print("table:", json.dumps(res["table"]))
    write = (lambda gpu, table: write_tuned_section(gpu, "gemm_rows", table)) if args.write_config else None
    save_sweep(res, args.out, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
