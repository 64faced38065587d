"""Latency of the TP all-reduce on N GPUs: custom one-shot / two-shot / as chosen vs NCCL, JSON out.

    python -m tools.bench_all_reduce --world-size 2 --out all_reduce_tp2.json

Each rank joins a TP group through `init_tp_group` (so the factory makes its real choice),
then for every message size (8 KiB to 8 MiB by default, bf16) it checks each path's sum
once, and times it two ways: eager (host launch included) and in a CUDA graph of `--inner`
back-to-back calls replayed `--iters` times (device time only, as decode runs it). A size's
time is the slowest rank's median. `suggested_one_shot_max_bytes` is the largest size at which
one-shot beat two-shot in the graph; compare it with the threshold in custom_all_reduce.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time_eager(fn, x, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()  # start together, or the first rank's time includes waiting for the last
        t0 = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _time_graph(fn, x, inner: int, iters: int) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn(x)
    graph.replay()  # warm-up replay
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    return statistics.median(times)


def _bench_rank(rank: int, world: int, sizes: list[int], dtype_name: str, inner: int, iters: int) -> dict:
    from metainfer.distributed.custom_all_reduce import CustomAllReduce, all_reduce_kind, nccl_all_reduce
    from metainfer.distributed.parallel_state import get_group_all_reduce

    dtype, device = DTYPES[dtype_name], torch.device("cuda", rank)
    chosen = get_group_all_reduce()
    custom = chosen if isinstance(chosen, CustomAllReduce) else None
    paths = {"nccl": nccl_all_reduce}
    if custom is not None:
        paths.update({"one_shot": custom.one_shot, "two_shot": custom.two_shot, "chosen": custom.all_reduce})
    total = world * (world + 1) // 2
    rows = []
    for nbytes in sizes:
        n = nbytes // torch.tensor([], dtype=dtype).element_size()
        pattern = (torch.arange(n, device=device) % 7 - 3).to(dtype)
        x = torch.empty(n, dtype=dtype, device=device)
        row = {"bytes": nbytes, "chosen_path": custom.path_for(x) if custom else all_reduce_kind(chosen)}
        for name, fn in paths.items():
            if name in ("one_shot", "two_shot") and nbytes > custom.buffer_bytes:
                continue
            x.copy_(pattern * (rank + 1))
            fn(x)  # also the eager warm-up NCCL needs before graph capture
            row[f"{name}_ok"] = bool(torch.equal(x, pattern * total))
            row[f"{name}_eager_us"] = _time_eager(fn, x, iters)
            row[f"{name}_graph_us"] = _time_graph(fn, x, inner, iters)
        rows.append(row)
    return {"kind": all_reduce_kind(chosen), "rows": rows,
            "one_shot_max_bytes": custom.one_shot_max_bytes if custom else None,
            "buffer_bytes": custom.buffer_bytes if custom else None,
            "p2p": [torch.cuda.can_device_access_peer(rank, p) for p in range(world) if p != rank]}


def _merge(per_rank: list[dict]) -> list[dict]:
    """Per size: times are the slowest rank's, ok flags must hold on every rank."""
    merged = []
    for rows in zip(*(r["rows"] for r in per_rank)):
        row = dict(rows[0])
        for key in row:
            if key.endswith("_us"):
                row[key] = round(max(r[key] for r in rows), 2)
            elif key.endswith("_ok"):
                row[key] = all(r[key] for r in rows)
        merged.append(row)
    return merged


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--min-bytes", type=int, default=8 << 10)
    parser.add_argument("--max-bytes", type=int, default=8 << 20)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--inner", type=int, default=20, help="all-reduces per captured CUDA graph")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or args.world_size < 2 or args.world_size > torch.cuda.device_count():
        print(f"needs 2..{torch.cuda.device_count()} GPUs (one per rank); asked for {args.world_size}",
              file=sys.stderr)
        return 2
    sizes, n = [], args.min_bytes
    while n <= args.max_bytes:
        sizes.append(n)
        n *= 2

    # Import by module name so the spawned ranks can unpickle the function under `python -m`.
    from metainfer.distributed.launch import run_on_ranks
    from tools.bench_all_reduce import _bench_rank

    per_rank = run_on_ranks(_bench_rank, args.world_size, sizes, args.dtype, args.inner, args.iters,
                            device="cuda", timeout=600)
    rows = _merge(per_rank)
    faster_one_shot = [r["bytes"] for r in rows
                       if "one_shot_graph_us" in r and "two_shot_graph_us" in r
                       and r["one_shot_graph_us"] <= r["two_shot_graph_us"]]
    result = {
        "gpu": torch.cuda.get_device_name(0), "gpus": args.world_size, "world_size": args.world_size,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": _nccl_version(), "python": platform.python_version(),
        "dtype": args.dtype, "inner": args.inner, "iters": args.iters,
        "chosen_kind": per_rank[0]["kind"], "p2p": [r["p2p"] for r in per_rank],
        "one_shot_max_bytes": per_rank[0]["one_shot_max_bytes"], "buffer_bytes": per_rank[0]["buffer_bytes"],
        "suggested_one_shot_max_bytes": max(faster_one_shot) if faster_one_shot else None,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"{result['gpu']} x{args.world_size}, torch {result['torch']}, NCCL {result['nccl']}, "
          f"chosen: {result['chosen_kind']}", file=sys.stderr)
    print(f"{'bytes':>10} {'path':>9} {'nccl us':>9} {'1-shot us':>9} {'2-shot us':>9} {'chosen us':>9}  (CUDA graph)",
          file=sys.stderr)
    for r in rows:
        cells = [f"{r.get(k, float('nan')):9.2f}" for k in
                 ("nccl_graph_us", "one_shot_graph_us", "two_shot_graph_us", "chosen_graph_us")]
        print(f"{r['bytes']:>10} {r['chosen_path']:>9} " + " ".join(cells), file=sys.stderr)
    if not args.out:
        print(text)
    bad = [r["bytes"] for r in rows if not all(v for k, v in r.items() if k.endswith("_ok"))]
    if bad:
        print(f"WRONG SUMS at sizes {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
