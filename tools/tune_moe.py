"""Fused-MoE sweep on CUDA: pick a MoeConfig per (E, N, H) expert shape and max-tokens bucket.

    python -m tools.tune_moe [--json moe_sweep.json] [--budget-s 220] [--write-config] [--shapes NAME ...]
                             [--buckets 1 8 64 ...]

`--write-config` merges the winners into the `moe` section of this GPU's shipped JSON
(metainfer/kernels/configs/<device>.json, read by `metainfer.kernels.tuned_configs`): keys
"E{E}_N{N}_H{H}" -> {"<bucket>": MoeConfig dict}; kernels/fused_moe.py takes the smallest bucket >= T.

Why: the grouped GEMMs' best tiles change with T: at decode sizes each selected expert sees one or
two rows (16-row blocks, the weight stream is all that matters: narrow tiles, deep pipelines, many
programs), at prefill sizes each expert sees tens to hundreds of rows (compute-bound: wide tiles,
L2 grouping). The shapes are DeepSeek-V2-Lite (E=64, N=1408, H=2048, top-6) and Qwen3-30B-A3B
(E=128, N=768, H=2048, top-8), and their tensor-parallel halves (N/2 a rank).

Method: per (shape, bucket), T = bucket tokens routed by a softmax top-k of random logits (a
realistic, uneven load), a fresh routing for each launch of a CUDA graph of `calls` launches
(so the selected experts change from launch to launch, as between layers, and the L2 does not
keep them), the median of `replays` replays divided by `calls` (tools/tune_gemv.time_graph). Each
candidate is checked once against fused_moe_ref (relative L2 error < 1e-2, bf16). Every candidate
is compiled first on a tiny problem (warm_compile); `--budget-s` bounds the whole run: each shape
gets an equal share of what is left, and candidates not started within it are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from metainfer.kernels.fused_moe import MoeConfig, default_moe_config, fused_moe_triton, moe_table_key
from metainfer.kernels.moe_ref import fused_moe_ref, route_topk_ref
from metainfer.kernels.tuned_configs import config_path
from tools.tune_gemv import _env, _rel_err, save_sweep, time_graph, write_tuned_section

# name: (E, N, H, top_k, shared) as the engine runs them: E stacked experts, of which the last `shared` are
# DeepSeek's shared experts (layers/moe.py), chosen by every token on top of its top_k - shared routed ones;
# "/tp2": the per-rank expert width under tensor parallelism 2
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "deepseek-v2-lite": (66, 1408, 2048, 8, 2),
    "deepseek-v2-lite/tp2": (66, 704, 2048, 8, 2),
    "qwen3-30b-a3b": (128, 768, 2048, 8, 0),
    "qwen3-30b-a3b/tp2": (128, 384, 2048, 8, 0),
}
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)  # 8,192: the engine's prefill step
REL_TOL = 1e-2
MIN_GAIN = 0.02  # a tuned config replaces the default only when it is this much faster

_C = MoeConfig
# (block_m, block_n, block_k, group_m, num_warps, num_stages)
_DECODE = (  # <= 16 tokens: 16-row blocks; the weight stream through narrow/deep tiles
    _C(16, 32, 128, 1, 4, 4), _C(16, 32, 256, 1, 4, 3), _C(16, 64, 64, 1, 4, 4), _C(16, 64, 128, 1, 4, 3),
    _C(16, 64, 128, 1, 4, 4), _C(16, 64, 256, 1, 4, 3), _C(16, 128, 64, 1, 4, 4), _C(16, 128, 128, 1, 8, 3),
    _C(16, 16, 256, 1, 4, 4), _C(16, 32, 64, 1, 2, 5), _C(16, 64, 256, 1, 8, 2), _C(16, 32, 128, 1, 2, 4),
)
_MID = (  # 32..256 tokens: experts see a few to ~30 rows
    _C(16, 64, 128, 1, 4, 3), _C(16, 64, 128, 4, 4, 4), _C(16, 128, 128, 4, 8, 3), _C(32, 64, 128, 4, 4, 3),
    _C(32, 64, 64, 4, 4, 4), _C(32, 128, 64, 4, 4, 4), _C(32, 128, 128, 8, 8, 3), _C(64, 64, 64, 8, 4, 4),
    _C(64, 128, 64, 8, 4, 3), _C(64, 128, 64, 8, 8, 4), _C(32, 32, 128, 1, 4, 4), _C(16, 32, 256, 1, 4, 3),
)
_LARGE = (  # 512+ tokens: compute-bound grouped GEMMs (each compiles for sm_90 within 227 KB of shared memory)
    _C(64, 128, 64, 8, 8, 3), _C(64, 128, 64, 8, 4, 4), _C(64, 64, 64, 8, 4, 4), _C(64, 256, 64, 8, 8, 3),
    _C(128, 128, 64, 8, 8, 3), _C(128, 128, 32, 8, 8, 4), _C(128, 64, 64, 8, 4, 4), _C(128, 64, 64, 8, 8, 4),
    _C(64, 128, 128, 8, 8, 2), _C(128, 128, 64, 16, 8, 4), _C(32, 128, 64, 8, 4, 4), _C(64, 128, 32, 8, 4, 5),
    # deeper pipelines and taller tiles for the prefill steps (gate/up holds two [M, N] accumulators)
    _C(128, 128, 64, 8, 8, 4), _C(128, 64, 128, 8, 4, 3), _C(256, 64, 64, 8, 8, 3), _C(128, 64, 64, 8, 4, 5),
)


def sweep_configs(bucket: int) -> tuple[MoeConfig, ...]:
    """The candidates of a token bucket (the untuned default first, no duplicates)."""
    space = _DECODE if bucket <= 16 else _MID if bucket <= 256 else _LARGE
    return tuple(dict.fromkeys((default_moe_config(bucket), *space)))


def make_routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator, device="cpu",
                 shared: int = 0):
    """(weights f32[T, K], ids i32[T, K]): softmax top-(K - shared) of random logits over the first
    E - shared experts, renormalised (the uneven load of a real router: some experts get several rows, some
    none), then the `shared` last experts for every token with weight 1 (route_topk's num_shared)."""
    logits = torch.randn(num_tokens, num_experts - shared, generator=generator, device=device) * 2
    return route_topk_ref(logits, top_k - shared, renormalize=True, num_shared=shared)


def pick_winners(results: dict, min_gain: float = MIN_GAIN) -> dict[str, dict[str, dict]]:
    """{"E{E}_N{N}_H{H}": {"<bucket>": config dict}} from the sweep's `shapes` results: per bucket the
    fastest checked candidate (none where no candidate passed), but the untuned default (each bucket's first
    row) stays unless the fastest beats it by more than `min_gain`: a 0.6% "win" at one token is the timer's
    noise, and a changed config there can cost in the engine what it saved in the sweep (run 81)."""
    table: dict[str, dict[str, dict]] = {}
    for res in results.values():
        key = moe_table_key(res["E"], res["N"], res["H"])
        for bucket, rows in res["buckets"].items():
            good = [r for r in rows["configs"] if r.get("ok") and "us" in r]
            if not good:
                continue
            best, default = min(good, key=lambda r: r["us"]), rows["configs"][0]
            if default in good and best["us"] * (1 + min_gain) >= default["us"]:
                best = default
            table.setdefault(key, {})[str(bucket)] = best["config"]
    return table


def about_with_moe(about: str) -> str:
    """The shipped file's "about" text with a sentence on the moe section (added once)."""
    note = ("moe: fused-MoE grouped-GEMM configs per 'E{E}_N{N}_H{H}' expert shape and max-tokens bucket "
            "(tools/tune_moe.py).")
    return about if "moe:" in about else (about + " " + note).strip()


def sweep_shape(num_experts: int, n: int, hidden: int, top_k: int, buckets=BUCKETS, device="cuda",
                dtype=torch.bfloat16, calls: int = 12, replays: int = 5, deadline: float | None = None,
                configs_for=None, shared: int = 0) -> dict:
    """Every bucket's candidates on one expert shape; per bucket the rows and the best."""
    configs_for = configs_for or sweep_configs
    g = torch.Generator(device=device).manual_seed(num_experts * 7 + n)
    w13 = torch.randn(num_experts, 2 * n, hidden, generator=g, device=device, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, n, generator=g, device=device, dtype=dtype) / n ** 0.5
    out = {"E": num_experts, "N": n, "H": hidden, "top_k": top_k, "buckets": {}}
    for bucket in buckets:
        x = torch.randn(bucket, hidden, generator=g, device=device, dtype=dtype)
        n_calls = calls if bucket <= 256 else max(3, calls // 4)
        routings = [make_routing(bucket, num_experts, top_k, g, device, shared) for _ in range(n_calls)]
        ref = fused_moe_ref(x, w13, w2, *routings[0])
        rows = []
        for cfg in configs_for(bucket):
            row = {"config": cfg.to_dict()}
            if deadline is not None and time.perf_counter() > deadline:
                rows.append({**row, "ok": False, "error": "skipped: time budget spent"})
                continue
            try:
                row["rel_err"] = _rel_err(fused_moe_triton(x, w13, w2, *routings[0], config=cfg), ref)
                row["ok"] = row["rel_err"] < REL_TOL
                if row["ok"]:
                    launches = [lambda r=r, c=cfg, x=x, a=w13, b=w2: fused_moe_triton(x, a, b, *r, config=c)
                                for r in routings]
                    ms = time_graph(launches, replays)
                    row["us"] = round(ms * 1e3 / n_calls, 2)
            except Exception as exc:  # a config the compiler or the device rejects: record it, go on
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
        good = [r for r in rows if r.get("ok") and "us" in r]
        entry = {"configs": rows}
        if good:
            entry["best"] = min(good, key=lambda r: r["us"])
            if rows[0].get("us"):
                entry["speedup_vs_default"] = round(rows[0]["us"] / entry["best"]["us"], 3)
        out["buckets"][str(bucket)] = entry
        best = entry.get("best")
        print(f"moe sweep E={num_experts} N={n} T={bucket}: default {rows[0].get('us', '-')} us, best "
              f"{best['us'] if best else '-'} us {best['config'] if best else ''}", flush=True)
    del w13, w2
    torch.cuda.empty_cache()
    return out


def warm_compile(configs, top_ks, device="cuda", dtype=torch.bfloat16, deadline: float | None = None) -> dict:
    """Compile every config for every top-k (the gate/up GEMM's TOP_K is a constexpr) on a tiny problem
    whose sizes and strides have the real shapes' specialisation (multiples of 16), so the timed sweep
    pays no compile and no shape's time share goes to compiling. Returns {config: error} for failures."""
    g = torch.Generator(device=device).manual_seed(0)
    experts = max(8, *top_ks)
    w13 = torch.randn(experts, 128, 256, generator=g, device=device).to(dtype)
    w2 = torch.randn(experts, 256, 64, generator=g, device=device).to(dtype)
    x = torch.randn(2, 256, generator=g, device=device).to(dtype)
    failed = {}
    for cfg in dict.fromkeys(configs):
        for top_k in dict.fromkeys(top_ks):
            if deadline is not None and time.perf_counter() > deadline:
                return failed
            try:
                fused_moe_triton(x, w13, w2, *make_routing(2, experts, top_k, g, device), config=cfg)
            except Exception as exc:  # recorded again (with the shape) when the sweep reaches it
                failed[cfg] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return failed


def sweep(shapes=None, buckets=BUCKETS, budget_s: float = 220.0, device="cuda", dtype=torch.bfloat16,
          calls: int = 12) -> dict:
    """Sweep every shape (name -> (E, N, H, top_k, shared)); `["table"]` is the `moe` section's format. The
    configs are compiled first (warm_compile); each shape then gets an equal share of what is left."""
    shapes = SHAPES if shapes is None else shapes
    started = time.perf_counter()
    res = {"env": _env(torch.device(device)), "rel_tol": REL_TOL, "budget_s": budget_s, "shapes": {}}
    configs = [cfg for bucket in buckets for cfg in sweep_configs(bucket)]
    res["compile_failures"] = {str(c.to_dict()): e for c, e in warm_compile(
        configs, [s[3] for s in shapes.values()], device, dtype, started + budget_s / 2).items()}
    res["compile_s"] = round(time.perf_counter() - started, 1)
    print(f"moe sweep: {len(set(configs))} configs compiled in {res['compile_s']} s", flush=True)
    timed_from = time.perf_counter()
    left = max(0.0, started + budget_s - timed_from)
    for i, (name, (num_experts, n, hidden, top_k, shared)) in enumerate(shapes.items()):
        deadline = timed_from + left * (i + 1) / len(shapes)
        res["shapes"][name] = sweep_shape(num_experts, n, hidden, top_k, buckets, device, dtype, calls,
                                          deadline=deadline, shared=shared)
    res["table"] = pick_winners(res["shapes"])
    res["elapsed_s"] = round(time.perf_counter() - started, 1)
    return res


def write_moe_section(device_name: str, table: dict, path: str | None = None) -> str:
    """Merge `table` into the `moe` section of the GPU's JSON (tools.tune_gemv.write_tuned_section) bucket by
    bucket (a sweep of some buckets keeps the shape's others) and mention the section in the file's "about";
    returns the path."""
    path = path or config_path(device_name)
    current = {}
    if os.path.exists(path):
        with open(path) as f:
            current = json.load(f).get("moe") or {}
    table = {key: {**current.get(key, {}), **buckets} for key, buckets in table.items()}
    path = write_tuned_section(device_name, "moe", table, path)
    with open(path) as f:
        doc = json.load(f)
    doc["about"] = about_with_moe(doc.get("about", ""))
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--budget-s", type=float, default=220.0, help="seconds (wall) for the whole sweep")
    p.add_argument("--write-config", action="store_true",
                   help="merge the winners into the moe section of the GPU's kernels/configs JSON")
    p.add_argument("--shapes", nargs="*", choices=list(SHAPES), help="a subset of the shapes (default: all)")
    p.add_argument("--buckets", nargs="*", type=int, help=f"a subset of the buckets (default: {BUCKETS})")
    args = p.parse_args(argv)
    shapes = {name: SHAPES[name] for name in args.shapes} if args.shapes else None
    res = sweep(shapes, tuple(args.buckets) if args.buckets else BUCKETS, args.budget_s)
    print("table:", json.dumps(res["table"]))
    save_sweep(res, args.json, write_moe_section if args.write_config else None)
    return 0


__all__ = ["BUCKETS", "SHAPES", "about_with_moe", "main", "make_routing", "pick_winners", "sweep", "sweep_configs",
           "sweep_shape", "warm_compile", "write_moe_section"]


if __name__ == "__main__":
    raise SystemExit(main())
