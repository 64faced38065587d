"""Probe (session 33): the Qwen3-8B decode GEMMs (36 distinct weights a shape, as a decode graph runs them) through
cuBLAS and through cuBLASLt (torch.backends.cuda.preferred_blas_library) at 32-512 rows, per shape; cuBLAS twice in
the run (does a row count's time repeat on one machine: PERFORMANCE Pending 6). Writes $OUT/blas_lib_ab.json."""

import json
import os

import torch
import torch.nn.functional as F

from tools.tune_gemv import QWEN3_8B_DECODE_SHAPES, decode_set_weights, time_graph

SHAPES = {k: v for k, v in QWEN3_8B_DECODE_SHAPES.items() if k != "lm_head"}
ROWS = list(range(32, 513, 16))


def main():
    g = torch.Generator(device="cuda").manual_seed(3)
    weights, _ = decode_set_weights(SHAPES, {k: 36 for k in SHAPES}, g, "cuda")
    xs = {m: {k: torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16) for k in (4096, 12288)}
          for m in ROWS}
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": ROWS, "us": {}}
    for tag, lib in (("cublas_1", "cublas"), ("cublaslt", "cublaslt"), ("cublas_2", "cublas")):
        torch.backends.cuda.preferred_blas_library(lib)
        res = out["us"][tag] = {}
        for m in ROWS:
            row = res[m] = {}
            for nm, (_n, k) in SHAPES.items():
                calls = [lambda w=w, x=xs[m][k]: F.linear(x, w) for w in weights[nm]]
                row[nm] = round(time_graph(calls, 5) * 1000 / 36, 2)
            row["layer_set_ms"] = round(sum(row[nm] for nm in SHAPES) * 36 / 1000, 3)
            print(tag, m, row, flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    path = os.path.join(os.environ.get("OUT", "."), "blas_lib_ab.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    a, lt, b = (out["us"][t] for t in ("cublas_1", "cublaslt", "cublas_2"))
    print("rows  cublas_1  cublaslt  cublas_2  (ms, 4 layer GEMMs x 36)")
    for m in ROWS:
        print(f"{m:4d} {a[m]['layer_set_ms']:9.3f} {lt[m]['layer_set_ms']:9.3f} {b[m]['layer_set_ms']:9.3f}")


if __name__ == "__main__":
    main()
