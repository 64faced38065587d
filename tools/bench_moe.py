"""Fused-MoE benchmark on CUDA: the Triton fused MoE against torch._grouped_mm and the torch reference.

    python -m tools.bench_moe [--json moe_bench.json] [--tokens 1 8 32 128 512 2048] [--shapes NAME ...]
                              [--untuned]

Why: the fused MoE's case rests on two numbers: at batch 1 it should cost about what reading the
selected experts' weights costs (DeepSeek-V2-Lite: 6 of 64 experts), and at prefill sizes it should
not lose to the best grouped GEMM torch has (torch._grouped_mm, cuBLAS/CUTLASS grouped kernels on
sm_90). For each shape of tools/tune_moe.SHAPES and T in --tokens it times:
- `triton`: fused_moe_triton with this GPU's tuned `moe` table (kernels/configs/<gpu>.json; the
  untuned default_moe_config with --untuned or where the table lacks the shape), in a CUDA graph;
- `grouped_mm`: pairs sorted by expert in torch (no host sync), gate_up and down through
  torch._grouped_mm(offs = cumsum of counts, int32), SiLU*up, weighted index_add (bf16, sm_90;
  recorded as an error where torch lacks it or refuses the shapes), in a CUDA graph;
- `ref`: fused_moe_ref (a loop over experts with host syncs), eagerly with CUDA events.
Each launch in a graph gets its own routing (softmax top-k of random logits), as in tools/tune_moe.
Reported: microseconds a call, GB/s against the byte floor (the distinct experts the routing selects,
3*N*H elements each, plus x and y), % of the measured device-to-device copy bandwidth at that floor,
and each backend's relative L2 error against the reference.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from metainfer.kernels.fused_moe import fused_moe_triton
from metainfer.kernels.moe_ref import fused_moe_ref
from tools.tune_moe import SHAPES, make_routing

TOKENS = (1, 2, 8, 32, 128, 512, 2048)


def _backends(table) -> dict:
    """name -> fn(x, w13, w2, weights, ids) (see the module docstring)."""
    return {"triton": lambda *a: fused_moe_triton(*a, table=table), "grouped_mm": grouped_mm_moe}


def floor_bytes(topk_ids: torch.Tensor, num_experts: int, n: int, hidden: int, elem: int = 2) -> int:
    """Bytes a call must move at least: every distinct selected expert's w13 and w2 (3*N*H elements),
    x read and y written (T*H each); the routing tensors are negligible and left out."""
    ids = topk_ids.flatten().long().cpu()
    experts = torch.unique(ids[(ids >= 0) & (ids < num_experts)]).numel()
    return experts * 3 * n * hidden * elem + 2 * topk_ids.shape[0] * hidden * elem


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """(order i64[T*K], tokens i64[T*K], offs i32[E]): the pairs p = t*K + k sorted by expert (stable),
    their tokens, and the end offset of each expert's run (torch._grouped_mm's `offs`). No host sync."""
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.clamp(0, num_experts - 1), torch.ones_like(flat, dtype=torch.int32))
    return order, order // topk_ids.shape[1], torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_mm_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_ref's result through torch._grouped_mm (ids must lie in [0, E))."""
    num_experts, n2, _ = w13.shape
    order, tokens, offs = sort_by_expert(topk_ids, num_experts)
    gate_up = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)
    hidden = (F.silu(gate_up[:, : n2 // 2].float()) * gate_up[:, n2 // 2:].float()).to(x.dtype)
    down = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offs)
    routed = topk_weights.flatten()[order].float()
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    y.index_add_(0, tokens, (down.float() * routed[:, None]).to(x.dtype).float())  # each term rounded (moe_ref)
    return y.to(x.dtype)


def time_eager(fn, iters: int = 10, warmup: int = 2) -> float:
    """Median microseconds of `fn()` between CUDA events (host syncs inside fn included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def summarize(row: dict, nbytes: int, copy_gbps: float | None) -> dict:
    """Adds GB/s at the byte floor and % of the copy bandwidth to a timed row ({"us": ...})."""
    if "us" in row:
        row["gbps"] = round(nbytes / (row["us"] * 1e-6) / 1e9, 1)
        if copy_gbps:
            row["pct_of_copy"] = round(100 * row["gbps"] / copy_gbps, 1)
    return row


def bench_shape(num_experts: int, n: int, hidden: int, top_k: int, tokens=TOKENS, table=None, device="cuda",
                dtype=torch.bfloat16, calls: int = 8, replays: int = 5, copy_gbps: float | None = None,
                shared: int = 0) -> dict:
    from tools.tune_gemv import _rel_err, time_graph

    g = torch.Generator(device=device).manual_seed(num_experts + n)
    w13 = torch.randn(num_experts, 2 * n, hidden, generator=g, device=device, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, n, generator=g, device=device, dtype=dtype) / n ** 0.5
    out = {"E": num_experts, "N": n, "H": hidden, "top_k": top_k, "tokens": {}}
    for t in tokens:
        backends = _backends(table)
        x = torch.randn(t, hidden, generator=g, device=device, dtype=dtype)
        n_calls = calls if t <= 512 else max(2, calls // 4)
        routings = [make_routing(t, num_experts, top_k, g, device, shared) for _ in range(n_calls)]
        nbytes = round(statistics.mean(floor_bytes(r[1], num_experts, n, hidden, w13.element_size())
                                       for r in routings))
        ref = fused_moe_ref(x, w13, w2, *routings[0])
        res = {"floor_bytes": nbytes}
        if copy_gbps:
            res["floor_us"] = round(nbytes / (copy_gbps * 1e9) * 1e6, 2)
        for name, fn in backends.items():
            row = {}
            try:
                if name == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
                    raise RuntimeError("this torch has no torch._grouped_mm")
                row["rel_err"] = _rel_err(fn(x, w13, w2, *routings[0]), ref)
                launches = [lambda r=r, fn=fn, x=x: fn(x, w13, w2, *r) for r in routings]
                try:
                    row["us"] = round(time_graph(launches, replays) * 1e3 / n_calls, 2)
                except Exception as exc:  # not capturable: timed eagerly (launch gaps included)
                    row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    row["us"] = round(time_eager(lambda ls=launches: [c() for c in ls], replays) / n_calls, 2)
                    row["timing"] = "eager"
            except Exception as exc:  # record and go on (an unsupported torch, a refused shape)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            res[name] = summarize(row, nbytes, copy_gbps)
        ref_us = time_eager(lambda x=x, r=routings[0]: fused_moe_ref(x, w13, w2, *r), 5)
        res["ref"] = summarize({"us": round(ref_us, 2)}, nbytes, copy_gbps)
        out["tokens"][str(t)] = res
        print(f"moe bench E={num_experts} N={n} T={t}: " + ", ".join(
            f"{k} {v.get('us', v.get('error', '-'))} us" + (f" ({v['gbps']} GB/s)" if "gbps" in v else "")
            for k, v in res.items() if isinstance(v, dict)), flush=True)
    return out


def bench(shapes=None, tokens=TOKENS, untuned: bool = False, device="cuda") -> dict:
    from metainfer.bench.common import copy_bandwidth
    from metainfer.kernels.fused_moe import parse_moe_table
    from metainfer.kernels.tuned_configs import load_tuned_configs
    from tools.tune_gemv import _env

    env = _env(torch.device(device))
    table = None if untuned else parse_moe_table(load_tuned_configs(env["gpu"])["moe"])
    copy_gbps = round(copy_bandwidth(torch.device(device)) / 1e9, 1)
    res = {"env": env, "copy_gbps": copy_gbps, "tuned_table": bool(table), "shapes": {}}
    for name, (num_experts, n, hidden, top_k, shared) in (shapes or SHAPES).items():
        res["shapes"][name] = bench_shape(num_experts, n, hidden, top_k, tokens, table, device, copy_gbps=copy_gbps,
                                          shared=shared)
        torch.cuda.empty_cache()  # the shape's weights
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    p.add_argument("--shapes", nargs="*", choices=list(SHAPES), help="a subset of the shapes (default: all)")
    p.add_argument("--untuned", action="store_true", help="default_moe_config, not the GPU's moe table")
    args = p.parse_args(argv)
    shapes = {name: SHAPES[name] for name in args.shapes} if args.shapes else None
    res = bench(shapes, tuple(args.tokens), args.untuned)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


__all__ = ["TOKENS",
           "bench", "bench_shape", "floor_bytes", "grouped_mm_moe", "main", "sort_by_expert", "summarize",
           "time_eager"]


if __name__ == "__main__":
    raise SystemExit(main())
