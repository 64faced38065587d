"""The MLX CPU micro-figures docs/PERFORMANCE.md ("Where the time goes") and docs/CONTRACTS.md (MLX KV stores)
cite, measured and written to a JSON: one SmolLM2-135M LM-head GEMV (576 -> 49,152) at 1 and 8 rows in the
layouts and dtypes the backend chooses between (fp32 `x @ W.T`, fp32 `x @ W` with W stored [in, out], bf16
`x @ W.T`, numpy's BLAS for scale, `mx.quantized_matmul` 4- and 8-bit), and a paged-KV store + gather step on a
1,000-slot and a 4-million-slot pool (in place: the pool's size must not matter). Random weights; medians of
`--repeats` after a warm-up; the 1-minute load average is recorded (the cores may be shared).

    python tools/measure_mlx_levers.py --output-json docs/results/mlx_cpu_levers.json
"""

# ruff: noqa: B023  (every closure below is timed at once, inside its own loop iteration)
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

IN, OUT = 576, 49152  # SmolLM2-135M's hidden size and vocabulary (the tied LM head)


def _median_ms(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemv_figures(repeats: int) -> dict:
    w = mx.random.normal((OUT, IN)) * 0.02
    w_io = mx.array(np.ascontiguousarray(np.array(w).T))
    w_bf16 = w.astype(mx.bfloat16)
    w_io_bf16 = w_io.astype(mx.bfloat16)
    quant = {bits: mx.quantize(w, group_size=64, bits=bits) for bits in (4, 8)}
    mx.eval(w, w_io, w_bf16, w_io_bf16, *[a for q in quant.values() for a in q])
    out = {}
    for rows in (1, 8):
        x = mx.random.normal((rows, IN))
        xb = x.astype(mx.bfloat16)
        mx.eval(x, xb)
        fig = {"fp32_x_WT_ms": _median_ms(lambda: x @ w.T, repeats),
               "fp32_x_W_in_out_ms": _median_ms(lambda: x @ w_io, repeats),
               "bf16_x_WT_ms": _median_ms(lambda: xb @ w_bf16.T, repeats),
               "bf16_x_W_in_out_ms": _median_ms(lambda: xb @ w_io_bf16, repeats)}
        for bits, (wq, scales, biases) in quant.items():
            fig[f"quantized_{bits}bit_ms"] = _median_ms(
                lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=bits),
                repeats)
        xn, wn = np.array(x), np.array(w)
        start = time.perf_counter()
        for _ in range(repeats):
            xn @ wn.T
        fig["numpy_fp32_x_WT_ms"] = (time.perf_counter() - start) / repeats * 1e3
        out[f"rows_{rows}"] = fig
    return out


def kv_store_figures(repeats: int) -> dict:
    """One layer's store of 1 token's K (3 kv heads of 64, SmolLM2) and a 130-token context gather."""
    out = {}
    for slots in (1000, 4_000_000):
        pool = mx.zeros((slots, 3, 64))
        mx.eval(pool)
        k = mx.random.normal((1, 3, 64))
        where = mx.array([slots // 2])
        ctx = mx.arange(130)

        def step():
            nonlocal pool
            pool[where] = k
            return pool[ctx], pool

        out[f"pool_{slots}_slots_store_gather_ms"] = _median_ms(step, repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    record = {"tool": "tools/measure_mlx_levers.py", "command": "python tools/measure_mlx_levers.py "
              + " ".join(sys.argv[1:]), "mlx": mx.__version__, "device": str(mx.default_device()),
              "cpus": os.cpu_count(), "load_1min_before": os.getloadavg()[0]}
    record["lm_head_gemv"] = gemv_figures(args.repeats)
    record["kv_store_gather"] = kv_store_figures(args.repeats)
    record["load_1min_after"] = os.getloadavg()[0]
    print(json.dumps(record, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
