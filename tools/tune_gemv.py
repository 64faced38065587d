"""Batch-1 GEMV sweep on CUDA: pick a GemvConfig per decode weight shape, against cuBLAS.

    python -m tools.tune_gemv [--out gemv_sweep.json] [--quick] [--write-config gemv|gemv_no_pdl]

`--write-config SECTION` merges the winners into this GPU's shipped table
(metainfer/kernels/configs/<device>.json, the format `metainfer.kernels.tuned_configs` loads): the
`gemv` section is the table used under PDL, `gemv_no_pdl` the one without. Or from a script (on the GPU):

    from tools.tune_gemv import sweep
    res = sweep()                                  # JSON-able dict
    # res["table"]: "NxK" -> config, the format of a configs/<device>.json section (the engine reads those)

Timing: every measurement is a CUDA graph of `calls` back-to-back launches that rotate over
several copies of the weight (at least 3, and at least `rotate_bytes` in all), so no weight is
still in the L2 (~60 MB) when it is read again; the median of `replays` replays, divided by
`calls`. Graphs also take the launch overhead out, as in the engine's decode graphs. Every
config is checked against F.linear on the same data (relative L2 error < 1e-2, bf16). Bytes per
call: N*K*2 (weight) + K*2 (x) + N*2 (y). The decode set (36 x the four layer shapes + the LM
head, every weight a distinct tensor as in the model) is timed as one graph for cuBLAS, for the
best Triton configs (through `linear_triton` and the installed table) and for DEFAULT_CONFIG,
next to a device-to-device copy measured in the same run (the roofline of the team's design notes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from metainfer.kernels._triton import pdl_supported
from metainfer.kernels.gemv import (
    DEFAULT_CONFIG,
    GemvConfig,
    gemv_plan,
    gemv_triton,
    get_gemv_configs,
    linear_triton,
    set_gemv_configs,
)
from metainfer.kernels.tuned_configs import SECTIONS, config_path

QWEN3_8B_DECODE_SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
# how many distinct weights of each shape one decode step reads (36 layers, one LM head)
QWEN3_8B_DECODE_COUNTS: dict[str, int] = {"qkv": 36, "o_proj": 36, "gate_up": 36, "down": 36, "lm_head": 1}

_C = GemvConfig
SWEEP_CONFIGS: tuple[GemvConfig, ...] = (
    _C(8, 1024, 8),    # the design notes' first kernel (DEFAULT_CONFIG)
    _C(8, 1024, 4),
    _C(4, 1024, 4),
    _C(4, 1024, 8),
    _C(8, 512, 4),
    _C(8, 512, 8),
    _C(16, 512, 8),
    _C(16, 512, 4),
    _C(16, 1024, 8),
    _C(4, 2048, 8),
    _C(8, 2048, 8),
    _C(16, 256, 4),
    _C(8, 256, 4),
    _C(4, 512, 4),
    _C(8, 1024, 8, split_k=2),
    _C(8, 1024, 8, split_k=4),
    _C(4, 1024, 4, split_k=2),
    _C(16, 512, 8, split_k=2),
    _C(8, 1024, 4, split_k=2),
    # for the 4096-row shapes (256-512 programs on 132 SMs): more rows or more warps a program
    _C(32, 512, 8),
    _C(32, 256, 8),
    _C(16, 1024, 16),
    _C(32, 1024, 16),
    _C(16, 2048, 16),
    _C(8, 2048, 16),
    _C(8, 4096, 16),
    _C(4, 4096, 8),
    _C(16, 512, 16),
    _C(2, 2048, 4),
    _C(2, 1024, 2),
    _C(4, 1024, 4, split_k=4),
    _C(16, 1024, 8, split_k=2),
)
QUICK_CONFIGS: tuple[GemvConfig, ...] = (
    _C(8, 1024, 8), _C(8, 1024, 4), _C(4, 1024, 4), _C(16, 512, 8), _C(4, 2048, 8), _C(8, 1024, 8, split_k=2),
)

REL_TOL = 1e-2


def _key(n: int, k: int) -> str:
    return f"{n}x{k}"


def _gemv_bytes(n: int, k: int, m: int = 1, elem: int = 2) -> int:
    return (n * k + m * k + m * n) * elem


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    err = ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) else float("inf")


def time_graph(calls, replays: int) -> float:
    """Median ms of one replay of a CUDA graph that runs `calls` in order."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, cuBLAS workspaces)
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def write_tuned_section(device_name: str, section: str, table: dict, path: str | None = None) -> str:
    """Merge `table` into `section` of the per-device JSON that `load_tuned_configs(device_name)` reads
    (the other sections and the file's notes kept); returns the path written."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {SECTIONS}, got {section!r}")
    path = path or config_path(device_name)
    doc = {}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    doc["device"] = device_name
    doc[section] = {**(doc.get(section) or {}), **table}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return path


def save_sweep(res: dict, out: str | None, write_section=None) -> None:
    """A tuner's last step: the whole result as JSON at `out`, and where given, the table merged into the GPU's
    kernels/configs JSON by `write_section(device_name, table)` (which returns the path it wrote)."""
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    if write_section is not None:
        print("wrote", write_section(res["env"]["gpu"], res["table"]))


def time_configs(out: dict, configs, launcher, weights, ref, calls, replays, nbytes, deadline=None,
                 row_of=lambda cfg: {"config": cfg.to_dict()}) -> None:
    """Check each config's launch (`launcher(cfg)`: w -> y) against `ref` and time the good ones over the
    rotating `weights`; sets `out["configs"]` (a row each, failures recorded) and, against `out["cublas"]`,
    `out["best"]` and `out["speedup_vs_cublas"]`. Configs not started by `deadline` are skipped."""
    rows = []
    for cfg in configs:
        row = row_of(cfg)
        if deadline is not None and time.perf_counter() > deadline:
            rows.append({**row, "ok": False, "error": "skipped: time budget spent"})
            continue
        try:
            fn = launcher(cfg)
            row["rel_err"] = _rel_err(fn(weights[0]), ref)
            row["ok"] = row["rel_err"] < REL_TOL
            if row["ok"]:
                row.update(_measure(fn, weights, calls, replays, nbytes))
        except Exception as exc:  # a config the compiler or the device rejects: record it, go on
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    out["configs"] = rows
    good = [r for r in rows if r.get("ok") and "us" in r]
    if good:
        out["best"] = min(good, key=lambda r: r["us"])
        out["speedup_vs_cublas"] = round(out["cublas"]["us"] / out["best"]["us"], 3)


def _rotating_calls(fn, weights, calls: int):
    return [lambda w=weights[i % len(weights)]: fn(w) for i in range(calls)]


def _measure(fn, weights, calls, replays, nbytes):
    us = time_graph(_rotating_calls(fn, weights, calls), replays) * 1e3 / calls
    return {"us": round(us, 3), "gbps": round(nbytes / (us * 1e-6) / 1e9, 1)}


def _copy_gbps(device, replays: int, nbytes: int = 1 << 31) -> float:
    """Device-to-device copy (read + write bytes counted), as the design notes' roofline."""
    from metainfer.bench.common import copy_bandwidth

    return copy_bandwidth(torch.device(device), gib=nbytes / 2**30) / 1e9


def _env(device) -> dict:
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}


def sweep_shape(n: int, k: int, configs=SWEEP_CONFIGS, device="cuda", calls: int = 20, replays: int = 5,
                rotate_bytes: int = 256 << 20, deadline: float | None = None, dtype=torch.bfloat16) -> dict:
    """Time cuBLAS and every config on one [n, k] weight (M = 1); returns the per-config rows."""
    elem = torch.empty((), dtype=dtype).element_size()
    wbytes = n * k * elem
    copies = max(3, math.ceil(rotate_bytes / wbytes))
    g = torch.Generator(device=device).manual_seed(n * 31 + k)
    weights = [torch.randn(n, k, generator=g, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(1, k, generator=g, device=device, dtype=dtype)
    nbytes = _gemv_bytes(n, k, 1, elem)
    ref = F.linear(x, weights[0]).float()
    out = {"n": n, "k": k, "bytes": nbytes, "weight_copies": copies}
    out["cublas"] = _measure(lambda w: F.linear(x, w), weights, calls, replays, nbytes)
    out["cublas"]["rel_err"] = _rel_err(F.linear(x, weights[0]), ref)
    def row_of(cfg):
        plan = gemv_plan(1, n, k, cfg, elem)
        return {"config": cfg.to_dict(), "programs": plan.grid[0] * plan.grid[1]}

    time_configs(out, configs, lambda cfg: lambda w: gemv_triton(x, w, config=cfg), weights, ref, calls, replays,
                 nbytes, deadline, row_of)
    del weights
    torch.cuda.empty_cache()
    return out


def _decode_set(shapes, counts, table, device, replays, dtype=torch.bfloat16) -> dict:
    """All decode weights (counts[name] distinct tensors per shape), one graph per backend."""
    g = torch.Generator(device=device).manual_seed(7)
    weights, order = decode_set_weights(shapes, counts, g, device, dtype)  # the model's launch order
    xs = {k: torch.randn(1, k, generator=g, device=device, dtype=dtype) for k in {s[1] for s in shapes.values()}}
    total = sum(_gemv_bytes(*shapes[nm], 1, torch.empty((), dtype=dtype).element_size()) for nm, _ in order)

    def calls(fn):
        return [lambda nm=nm, i=i: fn(xs[shapes[nm][1]], weights[nm][i]) for nm, i in order]

    res = {"launches": len(order), "bytes": total}
    res["cublas_ms"] = time_graph(calls(F.linear), replays)
    res["triton_default_ms"] = time_graph(calls(lambda x, w: gemv_triton(x, w, config=DEFAULT_CONFIG)), replays)
    previous = set_gemv_configs(table)
    try:
        res["triton_best_ms"] = time_graph(calls(linear_triton), replays)
        if pdl_supported(device):  # the same launches chained by programmatic dependent launch
            res["triton_best_pdl_ms"] = time_graph(calls(lambda x, w: gemv_triton(x, w, pdl=True)), replays)
    finally:
        set_gemv_configs(previous)
    weights.clear()
    torch.cuda.empty_cache()
    for name in [nm for nm in ("cublas", "triton_default", "triton_best", "triton_best_pdl") if f"{nm}_ms" in res]:
        res[f"{name}_gbps"] = round(total / (res[f"{name}_ms"] * 1e-3) / 1e9, 1)
    res["ratio_cublas_over_triton_best"] = round(res["cublas_ms"] / res["triton_best_ms"], 4)
    res["ratio_cublas_over_triton_default"] = round(res["cublas_ms"] / res["triton_default_ms"], 4)
    return res


def decode_set_weights(shapes, counts, generator, device, dtype=torch.bfloat16):
    """(weights, order): counts[name] distinct random tensors of each shape, and the model's launch
    order over them (per layer every shape with a count > 1, then the shapes used once)."""
    weights = {nm: [torch.randn(*shapes[nm], generator=generator, device=device, dtype=dtype)
                    for _ in range(counts.get(nm, 1))] for nm in shapes}
    layers = max(counts.values(), default=0)
    order = [(nm, i) for i in range(layers) for nm in shapes if i < counts.get(nm, 1) and counts.get(nm, 1) > 1]
    order += [(nm, 0) for nm in shapes if counts.get(nm, 1) <= 1]
    return weights, order


def cublas_by_rows(rows=(1, 2, 4, 8, 16, 32, 64, 128, 256), shapes=QWEN3_8B_DECODE_SHAPES,
                   counts=QWEN3_8B_DECODE_COUNTS, device="cuda", replays: int = 5, dtype=torch.bfloat16) -> dict:
    """The whole decode set through cuBLAS at M rows (one graph of every distinct weight in the model's
    order per M): ms, GB/s of weight + activation bytes and TFLOP/s, to show where cuBLAS leaves the
    weight-streaming floor between the Triton GEMV's M <= 2 and the compute-bound batches; for M <= 64
    the same set through the tensor-core skinny GEMM (kernels/skinny_gemm.py, automatic K splits) and
    its largest error against cuBLAS."""
    from metainfer.kernels.skinny_gemm import MAX_ROWS as SKINNY_ROWS
    from metainfer.kernels.skinny_gemm import skinny_gemm_triton

    elem = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(11)
    weights, order = decode_set_weights(shapes, counts, g, device, dtype)
    out = {"launches": len(order)}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g, device=device, dtype=dtype) for k in {s[1] for s in shapes.values()}}
        calls = [lambda nm=nm, i=i, xs=xs: F.linear(xs[shapes[nm][1]], weights[nm][i]) for nm, i in order]
        ms = time_graph(calls, replays)
        nbytes = sum(_gemv_bytes(*shapes[nm], m, elem) for nm, _ in order)
        flops = sum(2 * m * shapes[nm][0] * shapes[nm][1] for nm, _ in order)
        out[f"m{m}"] = {"ms": round(ms, 4), "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
                        "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}
        if m <= SKINNY_ROWS:
            try:
                skinny = [lambda nm=nm, i=i, xs=xs: skinny_gemm_triton(xs[shapes[nm][1]], weights[nm][i])
                          for nm, i in order]
                sms = time_graph(skinny, replays)
                errs = [_rel_err(skinny_gemm_triton(xs[shapes[nm][1]], weights[nm][0]),
                                 F.linear(xs[shapes[nm][1]], weights[nm][0])) for nm in shapes]
                out[f"m{m}"].update(skinny_ms=round(sms, 4), skinny_gbps=round(nbytes / (sms * 1e-3) / 1e9, 1),
                                    skinny_max_rel_err=max(errs))
            except Exception as exc:  # a compile or launch failure: record it, go on with cuBLAS
                out[f"m{m}"]["skinny_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print("decode set by rows", m, out[f"m{m}"], flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return out


def _multi_row_check(n, k, cfg, device, calls, replays, dtype=torch.bfloat16) -> list[dict]:
    """Correctness (and time, against cuBLAS) of M = 2..4 and of the bias path on one shape."""
    g = torch.Generator(device=device).manual_seed(11)
    weights = [torch.randn(n, k, generator=g, device=device, dtype=dtype) for _ in range(3)]
    bias = torch.randn(n, generator=g, device=device, dtype=dtype)
    rows = []
    for m, b in ((1, bias), (2, None), (3, None), (4, bias)):
        x = torch.randn(m, k, generator=g, device=device, dtype=dtype)
        row = {"m": m, "bias": b is not None, "n": n, "k": k, "config": cfg.to_dict()}
        try:
            row["rel_err"] = _rel_err(gemv_triton(x, weights[0], b, config=cfg), F.linear(x, weights[0], b))
            row["ok"] = row["rel_err"] < REL_TOL
            nbytes = _gemv_bytes(n, k, m)
            row["triton"] = _measure(lambda w, x=x, b=b: gemv_triton(x, w, b, config=cfg), weights, calls, replays,
                                     nbytes)
            row["cublas"] = _measure(lambda w, x=x, b=b: F.linear(x, w, b), weights, calls, replays, nbytes)
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def sweep(device="cuda", shapes=QWEN3_8B_DECODE_SHAPES, configs=SWEEP_CONFIGS, counts=QWEN3_8B_DECODE_COUNTS,
          calls: int = 20, replays: int = 5, decode_replays: int = 10, decode_set: bool = True,
          multi_row_check: bool = True, time_budget_s: float = 75.0, install: bool = False) -> dict:
    """Sweep `configs` on every shape (name -> (N, K)) at M = 1 against cuBLAS, then time the whole
    decode set. Returns a JSON-able dict; `["table"]` ("NxK" -> config dict, the best config of
    each shape) is what `set_gemv_configs` takes. `install=True` leaves that table installed.
    Configs not yet started when `time_budget_s` (wall, compiles included) is spent are skipped."""
    started = time.perf_counter()
    deadline = started + time_budget_s
    device = torch.device(device)
    if isinstance(shapes, list | tuple):
        shapes = {_key(n, k): (n, k) for n, k in shapes}
    res = {"env": _env(device), "calls_per_graph": calls, "replays": replays, "rel_tol": REL_TOL, "shapes": {}}
    table = {}
    for name, (n, k) in shapes.items():
        shape_res = sweep_shape(n, k, configs, device, calls, replays, deadline=deadline)
        res["shapes"][name] = shape_res
        if "best" in shape_res:
            table[_key(n, k)] = shape_res["best"]["config"]
    res["table"] = table
    res["sweep_s"] = round(time.perf_counter() - started, 1)
    if decode_set:
        try:
            res["copy_gbps"] = round(_copy_gbps(device, replays), 1)
            ds = _decode_set(shapes, counts, table, device, decode_replays)
            ds["floor_ms"] = round(ds["bytes"] / (res["copy_gbps"] * 1e9) * 1e3, 4)
            ds["triton_best_pct_of_floor"] = round(100 * ds["floor_ms"] / ds["triton_best_ms"], 1)
            ds["cublas_pct_of_floor"] = round(100 * ds["floor_ms"] / ds["cublas_ms"], 1)
            res["decode_set"] = ds
        except Exception as exc:
            res["decode_set"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if multi_row_check and shapes:
        name = min(shapes, key=lambda nm: shapes[nm][0] * shapes[nm][1])
        n, k = shapes[name]
        cfg = GemvConfig.from_any(table.get(_key(n, k), DEFAULT_CONFIG))
        res["multi_row"] = _multi_row_check(n, k, cfg, device, calls, replays)
    if install:
        set_gemv_configs(table)
    res["installed_table"] = {_key(*key): c.to_dict() for key, c in get_gemv_configs().items()}
    res["elapsed_s"] = round(time.perf_counter() - started, 1)
    return res


def _cfg_str(c: dict) -> str:
    s = f"{c['block_n']}x{c['block_k']} w{c['num_warps']}"
    return s + (f" sk{c['split_k']}" if c.get("split_k", 1) > 1 else "") + (
        f" st{c['num_stages']}" if c.get("num_stages", 1) != 1 else "")


def format_report(res: dict) -> str:
    lines = [f"{res['env']['gpu']}  torch {res['env']['torch']}  triton {res['env']['triton']}",
             f"{'shape':<10}{'N x K':>14}{'cuBLAS us':>11}{'GB/s':>8}{'Triton us':>11}{'GB/s':>8}"
             f"{'speedup':>9}  best config"]
    for name, s in res["shapes"].items():
        b = s.get("best")
        lines.append(f"{name:<10}{_key(s['n'], s['k']):>14}{s['cublas']['us']:>11.2f}{s['cublas']['gbps']:>8.0f}"
                     + (f"{b['us']:>11.2f}{b['gbps']:>8.0f}{s['speedup_vs_cublas']:>9.3f}  {_cfg_str(b['config'])}"
                        if b else "   (no valid config)"))
        bad = [r for r in s["configs"] if not r.get("ok")]
        if bad:
            why = [f"{_cfg_str(r['config'])}: " + (r["error"] if "error" in r else f"rel_err {r['rel_err']:.3g}")
                   for r in bad[:3]]
            lines.append(f"{'':<10}{len(bad)} config(s) failed/skipped: " + "; ".join(why))
    ds = res.get("decode_set")
    if ds and "error" not in ds:
        lines.append(f"decode set ({ds['launches']} GEMVs, {ds['bytes'] / 1e9:.2f} GB): "
                     f"cuBLAS {ds['cublas_ms']:.3f} ms, "
                     f"Triton best {ds['triton_best_ms']:.3f} ms "
                     f"(with PDL {ds.get('triton_best_pdl_ms', float('nan')):.3f}), "
                     f"Triton default {ds['triton_default_ms']:.3f} ms; "
                     f"cuBLAS/Triton {ds['ratio_cublas_over_triton_best']:.3f}; copy {res['copy_gbps']:.0f} GB/s -> "
                     f"floor {ds['floor_ms']:.3f} ms ({ds['triton_best_pct_of_floor']}% reached)")
    elif ds:
        lines.append(f"decode set: {ds['error']}")
    for r in res.get("multi_row", []):
        lines.append(f"M={r['m']} bias={r['bias']} {_key(r['n'], r['k'])}: "
                     + (f"rel_err {r['rel_err']:.2e} ok={r['ok']}  Triton {r['triton']['us']:.2f} us, "
                        f"cuBLAS {r['cublas']['us']:.2f} us" if "triton" in r else r.get("error", "")))
    lines.append(f"table: {json.dumps(res['table'])}")
    lines.append(f"elapsed {res['elapsed_s']} s (sweep {res['sweep_s']} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK_CONFIGS)} configs instead of {len(SWEEP_CONFIGS)}")
    p.add_argument("--no-decode-set", action="store_true")
    p.add_argument("--time-budget", type=float, default=75.0, help="seconds (wall) for the config sweep")
    p.add_argument("--write-config", choices=("gemv", "gemv_no_pdl"),
                   help="merge the winners into this section of the GPU's kernels/configs JSON")
    args = p.parse_args(argv)
    res = sweep(configs=QUICK_CONFIGS if args.quick else SWEEP_CONFIGS, decode_set=not args.no_decode_set,
                time_budget_s=args.time_budget)
    print(format_report(res))
    write = (lambda gpu, table: write_tuned_section(gpu, args.write_config, table)) if args.write_config else None
    save_sweep(res, args.out, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
