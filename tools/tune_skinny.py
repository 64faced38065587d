"""Skinny-GEMM sweep on CUDA: pick a SkinnyConfig per (decode weight shape, row bucket), against cuBLAS.

    python -m tools.tune_skinny [--out skinny_sweep.json] [--time-budget 240] [--write-config]
                                [--model-config config.json] [--rows 8,16,32,64]

`--write-config` merges the table into the `skinny` section of this GPU's shipped JSON
(metainfer/kernels/configs/<device>.json, read by `metainfer.kernels.tuned_configs`). From a script:

    from tools.tune_skinny import sweep
    res = sweep()              # JSON-able dict; res["table"]: "NxK/mBLOCK_M" -> config dict

Why: run 20 (docs/PERFORMANCE.md) measured the untuned skinny GEMM (64 x 128 tiles, 4 stages) at
4.30 ms over the Qwen3-8B decode set at 8 rows against cuBLAS 4.46, but 4.57 / 5.33 ms at 32 / 64
rows against 4.37 / 4.41: its tiles were guesses. The sweep times every config on every shape at
the engine's graph row counts from 4 to 64 (one compile per BLOCK_M, the padded row count),
with the GEMV sweep's method (tools/tune_gemv.py: CUDA graphs of launches rotating over weight
copies larger than the L2, median of replays), checks each against cuBLAS (relative L2 error),
and then times the whole decode set at each row count with the best table next to cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from metainfer.kernels.skinny_gemm import SkinnyConfig, skinny_block_m, skinny_gemm_triton, skinny_table_key
from tools.tune_gemv import (
    QWEN3_8B_DECODE_COUNTS,
    QWEN3_8B_DECODE_SHAPES,
    REL_TOL,
    _env,
    _gemv_bytes,
    _measure,
    decode_set_weights,
    save_sweep,
    time_configs,
    time_graph,
    write_tuned_section,
)

_S = SkinnyConfig
SWEEP_CONFIGS: tuple[SkinnyConfig, ...] = (
    _S(64, 128, 4, 4),   # DEFAULT_CONFIG (run 20)
    _S(64, 128, 8, 4),
    _S(32, 128, 4, 4),
    _S(32, 256, 4, 3),
    _S(32, 256, 4, 4),
    _S(32, 512, 4, 2),
    _S(16, 256, 4, 4),
    _S(16, 512, 4, 3),
    _S(16, 1024, 4, 2),
    _S(64, 256, 4, 3),
    _S(64, 256, 8, 3),
    _S(64, 64, 4, 6),
    _S(128, 128, 8, 3),
    _S(128, 64, 4, 4),
    _S(32, 256, 4, 3, split_k=1),
    _S(16, 512, 4, 3, split_k=1),
)
ROWS = (4, 8, 16, 32, 64)  # run 21 swept 8-64; 4 added after its review (the 4-row graph bucket)


_NOT_DECODE_LINEAR = (".mlp.gate", ".kv_b_proj")


def model_linear_shapes(config_path: str, tp: int = 1) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """The (N, K) weights one decode step multiplies through the engine's linear (`KernelOps.linear`: every
    LinearBase and the LM head) for a model config at one rank of `tp`, and how many of each: the engine's own
    model built on the meta device, so fused projections (q + latent, gate + up) appear as the engine runs them.
    Names are the shapes' first module path with the layer index dropped. Left out: the MoE router (`mlp.gate`,
    its own routing kernel) and MLA's kv_b_proj (decode multiplies its absorbed halves, kernels/mla_absorb.py)."""
    from metainfer.config.model_spec import ModelSpec
    from metainfer.distributed.parallel_state import tp_state
    from metainfer.kernels import REF_OPS
    from metainfer.layers.embedding import ParallelLMHead
    from metainfer.layers.linear import LinearBase
    from metainfer.models.registry import model_class

    spec = ModelSpec.from_file(config_path)
    with tp_state(0, tp), torch.device("meta"):
        model = model_class(spec)(spec, REF_OPS, dtype=torch.bfloat16)
    shapes: dict[str, tuple[int, int]] = {}
    counts: dict[str, int] = {}
    names = {}
    for path, module in model.named_modules():
        if isinstance(module, LinearBase | ParallelLMHead) and not path.endswith(_NOT_DECODE_LINEAR):
            shape = tuple(module.weight.shape)
            name = names.setdefault(shape, ".".join(p for p in path.split(".") if not p.isdigit()))
            shapes[name] = shape
            counts[name] = counts.get(name, 0) + 1
    return shapes, counts


def sweep_shape(n: int, k: int, m: int, configs=SWEEP_CONFIGS, device="cuda", calls: int = 20, replays: int = 5,
                rotate_bytes: int = 256 << 20, deadline: float | None = None, dtype=torch.bfloat16) -> dict:
    """cuBLAS and every config on one [n, k] weight at m rows; the per-config rows and the best."""
    elem = torch.empty((), dtype=dtype).element_size()
    copies = max(3, math.ceil(rotate_bytes / (n * k * elem)))
    g = torch.Generator(device=device).manual_seed(n * 31 + k + m)
    weights = [torch.randn(n, k, generator=g, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(m, k, generator=g, device=device, dtype=dtype)
    nbytes = _gemv_bytes(n, k, m, elem)
    ref = F.linear(x, weights[0])
    out = {"n": n, "k": k, "m": m, "cublas": _measure(lambda w: F.linear(x, w), weights, calls, replays, nbytes)}
    time_configs(out, configs, lambda cfg: lambda w: skinny_gemm_triton(x, w, config=cfg), weights, ref, calls,
                 replays, nbytes, deadline)
    del weights
    torch.cuda.empty_cache()
    return out


def decode_set(table: dict, rows=ROWS, shapes=QWEN3_8B_DECODE_SHAPES, counts=QWEN3_8B_DECODE_COUNTS,
               device="cuda", replays: int = 5, dtype=torch.bfloat16) -> dict:
    """The whole decode set (every distinct weight, the model's order) at each row count: cuBLAS
    against the skinny GEMM with `table`'s config per (shape, BLOCK_M), shapes it lacks on cuBLAS."""
    from metainfer.kernels.skinny_gemm import parse_skinny_table

    configs = parse_skinny_table(table)
    weights, order = decode_set_weights(shapes, counts, torch.Generator(device=device).manual_seed(13), device, dtype)
    g = torch.Generator(device=device).manual_seed(17)
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g, device=device, dtype=dtype) for k in {s[1] for s in shapes.values()}}

        def tuned(x, w, m=m):
            cfg = configs.get((w.shape[0], w.shape[1], skinny_block_m(m)))
            return F.linear(x, w) if cfg is None else skinny_gemm_triton(x, w, config=cfg)

        def timed(fn, xs=xs):
            return time_graph([lambda nm=nm, i=i: fn(xs[shapes[nm][1]], weights[nm][i]) for nm, i in order], replays)

        cublas_ms, skinny_ms = timed(F.linear), timed(tuned)
        out[f"m{m}"] = {"cublas_ms": round(cublas_ms, 4), "skinny_tuned_ms": round(skinny_ms, 4),
                        "ratio_cublas_over_skinny": round(cublas_ms / skinny_ms, 4)}
        print("skinny decode set", m, out[f"m{m}"], flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return out


def sweep(device="cuda", shapes=QWEN3_8B_DECODE_SHAPES, rows=ROWS, configs=SWEEP_CONFIGS,
          time_budget_s: float = 240.0, dtype=torch.bfloat16, counts=QWEN3_8B_DECODE_COUNTS) -> dict:
    """Every config on every (shape, row count) in 3..MAX_ROWS; `["table"]` keeps, per (shape, BLOCK_M), the
    config with the least time summed over that bucket's row counts, only where that sum beats
    cuBLAS's (a bucket entry may lose at one of its row counts: run 21's gate_up and down did at 16
    rows by 0.6% and 0.4%). `["shapes"]` keys are "name/rows M"; table keys "NxK/mBLOCK_M"."""
    from metainfer.kernels.skinny_gemm import MAX_ROWS

    if not rows or any(not 3 <= m <= MAX_ROWS for m in rows):
        raise ValueError(f"rows must lie in 3..{MAX_ROWS} (the engine uses the GEMV for 1-2), got {rows}")
    started = time.perf_counter()
    deadline = started + time_budget_s
    res = {"env": _env(torch.device(device)), "rel_tol": REL_TOL, "shapes": {}}
    for name, (n, k) in shapes.items():
        for m in rows:
            r = sweep_shape(n, k, m, configs, device, deadline=deadline, dtype=dtype)
            res["shapes"][f"{name}/rows{m}"] = r
            best = r.get("best")
            print(f"skinny sweep {name} m={m}: cuBLAS {r['cublas']['us']} us, best "
                  f"{best['us'] if best else '-'} us {best['config'] if best else ''}", flush=True)
    table = {}
    for name, (n, k) in shapes.items():
        buckets: dict[int, list[int]] = {}
        for m in rows:
            buckets.setdefault(skinny_block_m(m), []).append(m)
        for block_m, ms in buckets.items():
            per = [res["shapes"][f"{name}/rows{m}"] for m in ms]
            totals = {}
            for i, cfg in enumerate(configs):
                rows_i = [p["configs"][i] for p in per]
                if all(r.get("ok") and "us" in r for r in rows_i):
                    totals[cfg] = sum(r["us"] for r in rows_i)
            cublas = sum(p["cublas"]["us"] for p in per)
            if totals and min(totals.values()) < cublas:
                best = min(totals, key=totals.get)
                table[skinny_table_key(n, k, block_m)] = best.to_dict()
    res["table"] = table
    res["sweep_s"] = round(time.perf_counter() - started, 1)
    res["decode_set"] = decode_set(table, rows, shapes, counts, device=device, dtype=dtype)
    res["elapsed_s"] = round(time.perf_counter() - started, 1)
    return res


def _row_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows: a comma list of integers, got {text!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds (wall) for the config sweep")
    p.add_argument("--write-config", action="store_true",
                   help="merge the table into the skinny section of the GPU's kernels/configs JSON")
    p.add_argument("--model-config", help="a model's config.json: sweep its linear shapes (default: Qwen3-8B's)")
    p.add_argument("--rows", type=_row_list, default=ROWS, help="row counts, a comma list (default 4,8,16,32,64)")
    args = p.parse_args(argv)
    shapes, counts = ((QWEN3_8B_DECODE_SHAPES, QWEN3_8B_DECODE_COUNTS) if args.model_config is None
                      else model_linear_shapes(args.model_config))
    res = sweep(shapes=shapes, counts=counts, rows=args.rows, time_budget_s=args.time_budget)
    print("table:", json.dumps(res["table"]))
    write = (lambda gpu, table: write_tuned_section(gpu, "skinny", table)) if args.write_config else None
    save_sweep(res, args.out, write)
    return 0


__all__ = ["ROWS", "SWEEP_CONFIGS", "decode_set", "main", "model_linear_shapes", "sweep", "sweep_shape"]


if __name__ == "__main__":
    raise SystemExit(main())
