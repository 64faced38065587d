"""Tuning sweeps and kernel studies (by name only, not in the default run): the GEMV and skinny GEMM
sweeps, cuBLAS by rows, the decode attention launch parameters by context and KV dtype, the sampler."""

from __future__ import annotations

import os

import torch

from tools.gpu_suite.common import error_of, show

HQ, HK, D, BLOCK = 32, 8, 128, 16  # Qwen3-8B heads, the engine's block size
TABLE_WIDTH = 4096 // BLOCK  # the latency engine's block-table width (max_model_len 4,096)


def gemv(args, results) -> dict:
    """Batch-1 GEMV sweep: Triton configs vs cuBLAS per decode shape, then the whole decode set with the
    winners (the `ab` section runs them in the engine)."""
    from tools.tune_gemv import format_report, sweep

    res = sweep()
    print(format_report(res), flush=True)
    return res


def gemm_rows(args, results) -> dict:
    """The decode set through cuBLAS at `--gemm-rows` rows (default 1..256: how far from the weight-streaming floor
    the batches between the GEMV and the compute-bound ones run), the untuned skinny GEMM beside it up to 64 rows."""
    from tools.tune_gemv import cublas_by_rows

    return cublas_by_rows(rows=args.gemm_rows)


def skinny_sweep(args, results) -> dict:
    """The skinny GEMM's configs per (decode shape, row bucket) against cuBLAS, then the decode set at
    8-64 rows with the winning table (the `ab` section runs that table in the engine)."""
    from tools.tune_skinny import sweep

    res = sweep()
    show("skinny_sweep", {"table": res["table"], "decode_set": res["decode_set"]})
    return res


def _tables(batch: int, blocks: int, dev) -> torch.Tensor:
    """Each row its own `blocks` blocks, padded with -1 to the engine's table width."""
    tables = torch.full((batch, TABLE_WIDTH), -1, device=dev, dtype=torch.int32)
    tables[:, :blocks] = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
    return tables


def _time_layers(call, caches) -> float:
    """us a launch: one CUDA graph of `call` over every (distinct) layer cache."""
    from tools.tune_gemv import time_graph

    return time_graph([lambda c=c: call(c) for c in caches], 10) * 1e3 / len(caches)


def attn_sweep(args, results) -> dict:
    """Batch-1 decode attention at the bs1 bench's contexts per (block_n, min_split_tokens): one graph of
    36 launches over distinct layer caches, PDL where supported. us a launch, against the shipped pair."""
    import metainfer.kernels.attention_decode as attn
    from metainfer.kernels import paged_decode_attention_ref, pdl_supported

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    pdl = pdl_supported(dev)
    shipped = (attn._DECODE_SPLIT_BLOCK_N, attn._DECODE_MIN_SPLIT_TOKENS)  # bs1: a split launch
    res = {"pdl": pdl, "table_width": TABLE_WIDTH, "shipped": shipped, "rows": []}
    contexts = (32, 96, 160, 1024)  # the bs1 bench's contexts run 32..160
    for ctx in contexts:
        blocks = -(-ctx // BLOCK)
        caches = [torch.randn(2, blocks, BLOCK, HK, D, device=dev, dtype=bf16) for _ in range(36)]
        q = torch.randn(1, HQ, D, device=dev, dtype=bf16)
        tables, lens = _tables(1, blocks, dev), torch.tensor([ctx], device=dev, dtype=torch.int32)
        ref = paged_decode_attention_ref(q.float(), caches[0][0].float(), caches[0][1].float(), tables[:, :blocks],
                                         lens, D ** -0.5)
        for block_n in (16, 32, 64):
            for min_split in (32, 64, 128, 256):
                def call(c, block_n=block_n, min_split=min_split, q=q, tables=tables, lens=lens):
                    return attn.paged_decode_attention_triton(q, c[0], c[1], tables, lens, D ** -0.5, block_n=block_n,
                                                              min_split_tokens=min_split, pdl=pdl)
                err = (call(caches[0]).float() - ref).abs().max().item()
                res["rows"].append({"ctx": ctx, "block_n": block_n, "min_split": min_split,
                                    "us": round(_time_layers(call, caches), 3), "max_err": err})
        del caches
    for ctx in contexts:
        rows = [r for r in res["rows"] if r["ctx"] == ctx]
        res[f"ctx{ctx}"] = {"best": min(rows, key=lambda r: r["us"]),
                            "shipped": next(r for r in rows if (r["block_n"], r["min_split"]) == shipped)}
        show(f"ctx {ctx}", res[f"ctx{ctx}"])
    totals: dict = {}
    for r in res["rows"]:
        if r["ctx"] <= 160:
            totals[(r["block_n"], r["min_split"])] = totals.get((r["block_n"], r["min_split"]), 0) + r["us"]
    best = min(totals, key=totals.get)
    res["best_over_bench_contexts"] = {"block_n_min_split": best, "us_sum": totals[best],
                                       "shipped_us_sum": totals[shipped]}
    torch.cuda.empty_cache()
    return res


COMMON = [("default", {}), ("warps4_stages3", dict(num_warps=4, num_stages=3)), ("block_n64", dict(block_n=64)),
          ("block_n128", dict(block_n=128)), ("maxnreg104", dict(maxnreg=104)), ("maxnreg96", dict(maxnreg=96)),
          ("maxnreg80", dict(maxnreg=80)), ("maxnreg72", dict(maxnreg=72)),
          ("block_n64_maxnreg96", dict(block_n=64, maxnreg=96))]
RAGGED = [("default", {}), ("splits2", dict(num_splits=2, block_n=64)), ("splits4", dict(num_splits=4, block_n=64))]
# token-major V: the context's tail in 32- and 16-token tiles
FP8_ONLY = [("tail32", dict(tail_block_n=32)), ("tail16", dict(tail_block_n=16)),
            # run 142: the tiles pass through registers to shared memory a tile at a time, the stores waiting on the
            # loads (a third of the stall samples); the pipeliner's two buffers, and a 128-token tile on two warpgroups
            # (sm_90 AOT: two stages take 103 registers, capped at 96 without spills: 5 programs an SM instead of 4)
            ("stages2", dict(num_stages=2)), ("stages2_maxnreg96", dict(num_stages=2, maxnreg=96)),
            ("stages2_maxnreg80", dict(num_stages=2, maxnreg=80)),
            ("block_n128_warps8", dict(block_n=128, num_warps=8)),
            ("block_n128_warps8_stages2", dict(block_n=128, num_warps=8, num_stages=2))]


def _kv_dtype_cases() -> list:
    """(batch, contexts, {cache: variants}): the throughput bench's big steps (256 / 128 x 600, 64 x
    1,088), batch 1 at 160 (a split launch), 256 ragged rows (uniform in [100, 1,100], the bench's
    spread) in random order and longest first (the scheduler's decode order)."""
    uniform = {"bf16": COMMON, "fp8": COMMON + FP8_ONLY}
    ragged = torch.randint(100, 1101, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    return [(256, [600] * 256, uniform), (128, [600] * 128, uniform), (64, [1088] * 64, uniform),
            (1, [160], uniform), (256, ragged, {"bf16": RAGGED, "fp8": RAGGED + FP8_ONLY}),
            (256, sorted(ragged, reverse=True), {"bf16": RAGGED[:1], "fp8": RAGGED[:1] + FP8_ONLY})]


def attn_kv_dtype(args, results) -> dict:
    """Decode attention alone over a bf16 and an fp8 KV cache (V token-major, the engine's fp8 layout),
    launch variants (warps, stages, block_n, splits, tail tiles); us a launch over a graph of 8 launches
    on distinct caches, and the KV read rate. Then 256 x 600 with GQA groups of 1 and 2 (8 and 16 q heads over
    the same 8 kv heads: the same bytes, a quarter and half the real rows of the padded 16-row tiles)."""
    from metainfer.kernels import FP8_KV_DTYPE, paged_decode_attention_ref, paged_decode_attention_triton
    from metainfer.kernels.kv_cache import fp8_cache_copy, to_cache_dtype

    dev, bf16, res = torch.device("cuda"), torch.bfloat16, {}
    # the GQA group probe (session 19's hypothesis; PERFORMANCE "Experiments that lost", run 73): the same KV bytes
    # read by groups of 1, 2 and 4 q heads a kv head; the default launch only
    probe = [(256, [600] * 256, {c: COMMON[:1] for c in ("bf16", "fp8")}, hq) for hq in (HK, 2 * HK)]
    for batch, ctxs, case_variants, hq in [(*case, HQ) for case in _kv_dtype_cases()] + probe:
        name = f"b{batch}_ctx{ctxs[0]}" if len(set(ctxs)) == 1 else f"b{batch}_ragged{min(ctxs)}-{max(ctxs)}"
        name += "_longest_first" if len(set(ctxs)) > 1 and ctxs == sorted(ctxs, reverse=True) else ""
        name += "" if hq == HQ else f"_group{hq // HK}"
        per_seq = -(-max(ctxs) // BLOCK)
        tables, lens = _tables(batch, per_seq, dev), torch.tensor(ctxs, device=dev, dtype=torch.int32)
        q = torch.randn(batch, hq, D, device=dev, dtype=bf16)
        row = res.setdefault(name, {"mean_ctx": sum(ctxs) / batch})
        for cache_name, cache_dtype in (("bf16", bf16), ("fp8", FP8_KV_DTYPE)):
            caches = []
            for _ in range(8):
                kv = to_cache_dtype(torch.randn(2, batch * per_seq, BLOCK, HK, D, device=dev, dtype=bf16), cache_dtype)
                caches.append(fp8_cache_copy(kv[0], kv[1]) if cache_name == "fp8" else (kv[0], kv[1]))
            kv_bytes = sum(ctxs) * HK * D * 2 * caches[0][0].element_size()
            ref = paged_decode_attention_ref(q.float(), caches[0][0], caches[0][1], tables[:, :per_seq], lens,
                                             D ** -0.5)
            for variant, kw in case_variants[cache_name]:
                def call(c, kw=kw, q=q, tables=tables, lens=lens):
                    return paged_decode_attention_triton(q, c[0], c[1], tables, lens, D ** -0.5, **kw)
                key = f"{cache_name}_{variant}"
                try:  # one failing variant must not lose the section's other rows
                    err = (call(caches[0]).float() - ref).abs().max().item()
                    us = _time_layers(call, caches)
                except Exception as exc:
                    row[key] = error_of(exc)
                    print(f"{name} {key}: FAILED {exc}", flush=True)
                    continue
                row[key] = {"us": round(us, 2), "GBs": round(kv_bytes / us / 1e3, 1), "max_err": err}
                print(f"{name} {key}: {us:.2f} us, {kv_bytes / us / 1e3:.0f} GB/s, err {err:.2e}", flush=True)
            del caches
        torch.cuda.empty_cache()
    return res


def _kernel_graph_ms(kernel, logits, temps, calls: int = 20, replays: int = 10) -> float:
    """The sampling kernel alone: `calls` launches (a new seed each) in one CUDA graph, ms a launch over `replays`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for seed in range(calls):
            kernel(logits, temps, seed=seed)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / (calls * replays), 4)


def sampler(args, results) -> dict:
    """The torch sampler against the one-pass Gumbel-max kernel on [B, 151936] bf16 logits (greedy and
    temperature 0.6): ms a call (CUDA events, after a warm-up), and the greedy tokens compared; then the kernel
    alone in CUDA graphs (no host time) at 1-512 rows. Run by another tree's `metainfer` (cwd .tree_ab/COMMIT,
    PYTHONPATH this checkout) it times that tree's kernel: a kernel A/B across commits."""
    from metainfer.engine.sequence import Sequence
    from metainfer.kernels.sampling import GumbelSampler
    from metainfer.sampling_params import SamplingParams
    from metainfer.worker.sampler import Sampler

    vocab, res = 151936, {}
    kernel = GumbelSampler(256, vocab, "cuda", warmup_dtype=torch.bfloat16)  # every variant compiled here
    paths = {"torch": Sampler(vocab, (0,), "cuda"), "fused": Sampler(vocab, (0,), "cuda", fused=kernel)}
    for batch in (1, 256):
        logits = torch.randn(batch, vocab + 64, device="cuda", dtype=torch.bfloat16) * 3
        for temperature in (0.0, 0.6):
            seqs = [Sequence(f"r{i}", i, [1], SamplingParams(temperature=temperature, max_tokens=8))
                    for i in range(batch)]
            row, tokens = {}, {}
            for name, path in paths.items():
                for _ in range(3):
                    path(logits, seqs)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    tokens[name] = path(logits, seqs).token_ids
                end.record()
                end.synchronize()
                row[f"{name}_ms"] = round(start.elapsed_time(end) / 20, 4)
            if temperature == 0.0:
                row["greedy_equal"] = bool(torch.equal(tokens["torch"], tokens["fused"]))
            res[f"b{batch}_t{temperature}"] = row
            show(f"sampler b{batch} t{temperature}", row)
    big = GumbelSampler(512, vocab, "cuda", warmup_dtype=torch.bfloat16)
    for batch in (1, 64, 256, 512):
        logits = torch.randn(batch, vocab + 64, device="cuda", dtype=torch.bfloat16) * 3
        row = {f"t{t}_ms": _kernel_graph_ms(big, logits, torch.full((batch,), t, device="cuda")) for t in (0.0, 0.6)}
        res[f"kernel_graph_b{batch}"] = row
        show(f"sampler kernel in graphs b{batch}", row)
    import metainfer

    res["metainfer_from"] = os.path.dirname(metainfer.__file__)
    return res


NCU_CASES = [("fp8", 256, 600), ("bf16", 256, 600), ("fp8", 512, 1500)]
NCU_METRICS = (  # the ncu details rows kept in the JSON (the whole CSV goes to $OUT beside it)
    "Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Registers Per Thread",
    "Achieved Occupancy", "Theoretical Occupancy", "Block Limit Registers", "Block Limit Shared Mem",
    "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block", "Warp Cycles Per Issued Instruction",
    "Issue Slots Busy", "No Eligible", "Executed Ipc Active", "L1/TEX Hit Rate", "L2 Hit Rate",
    "Mem Busy", "Max Bandwidth", "Mem Pipes Busy", "Executed Instructions", "Waves Per SM",
)


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu `--csv --page details` output (program lines mixed in) -> one {metric: "value unit"} a kernel launch,
    plus its section rows under "sections" and its rule messages under "rules"."""
    import csv

    rows = list(csv.DictReader(line for line in text.splitlines() if line.startswith('"')))
    launches: dict[str, dict] = {}
    for r in rows:
        launch = launches.setdefault(r.get("ID", "0"), {"kernel": r.get("Kernel Name", ""), "sections": {},
                                                         "rules": []})
        name, value = r.get("Metric Name") or "", r.get("Metric Value") or ""
        if name:
            launch["sections"].setdefault(r.get("Section Name", ""), {})[name] = f"{value} {r.get('Metric Unit') or ''}"
            if name in NCU_METRICS:
                launch[name] = f"{value} {r.get('Metric Unit') or ''}".strip()
        if r.get("Rule Name") and r.get("Rule Description"):
            launch["rules"].append(f"{r['Rule Name']}: {r['Rule Description'][:300]}")
    return list(launches.values())


def summarize_sass_csv(text: str, top: int = 12) -> dict:
    """ncu's source page per SASS instruction (`--page source --print-source sass --csv`) -> the executed
    instruction mix by opcode, the warp stall reasons (shares of all samples), and the global loads whose L2
    sectors exceed the ideal (the uncoalesced ones: sectors against ideal sectors)."""
    import collections
    import csv

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        return {"error": "no source table"}
    rows = list(csv.DictReader(lines[start:]))

    def num(value) -> float:
        try:
            return float(str(value).replace(",", ""))
        except ValueError:
            return 0.0

    executed, stalls, excessive = collections.Counter(), collections.Counter(), {"sectors": 0, "ideal": 0}
    stall_keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] if rows else []
    for r in rows:
        words = (r.get("Source") or "").split()
        if words and words[0].startswith("@"):  # a predicate guard
            words = words[1:]
        if not words:
            continue
        executed[words[0]] += num(r.get("Instructions Executed", 0))
        for k in stall_keys:
            stalls[k] += num(r.get(k, 0))
        if num(r.get("L2 Theoretical Sectors Global Excessive", 0)) > 0:
            excessive["sectors"] += num(r.get("L2 Theoretical Sectors Global", 0))
            excessive["ideal"] += num(r.get("L2 Theoretical Sectors Global Ideal", 0))
    total, samples = sum(executed.values()) or 1.0, sum(stalls.values()) or 1.0
    return {"warp_instructions": total,
            "mix_pct": {op: round(100 * n / total, 1) for op, n in executed.most_common(top)},
            "stall_pct": {k: round(100 * n / samples, 1) for k, n in stalls.most_common(top)},
            "uncoalesced_loads": excessive}


def attn_ncu(args, results) -> dict:
    """Nsight Compute's full set on one warm launch of the decode attention kernel per case (tools.decode_attn_case):
    fp8 and bf16 at 256 x 600, fp8 at 512 x 1,500. Where ncu cannot read the counters (a gVisor machine), the
    error is the record. The whole CSV goes to $OUT/ncu_<case>.csv."""
    import os
    import shutil
    import subprocess
    import sys

    from tools.gpu_suite.common import ROOT, out_dir

    ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if ncu is None:
        return {"error": "ncu not found"}
    res = {"ncu": ncu}
    for cache, batch, ctx in NCU_CASES:
        name = f"{cache}_b{batch}_ctx{ctx}"
        report = os.path.join(out_dir(), f"ncu_{name}")
        cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:_decode_split_kernel", "--launch-skip", "1",
               "--launch-count", "1", "--set", "full", "--import-source", "yes", "-f", "-o", report,
               sys.executable, "-m", "tools.decode_attn_case", "--cache", cache, "--batch", str(batch),
               "--ctx", str(ctx), "--iters", "2"]
        try:
            profiled = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
            if profiled.returncode or not os.path.exists(report + ".ncu-rep"):
                res[name] = {"error": f"ncu rc {profiled.returncode}: {(profiled.stderr or profiled.stdout)[-600:]}"}
                print(name, res[name], flush=True)
                continue
            proc = subprocess.run([ncu, "-i", report + ".ncu-rep", "--csv", "--page", "details"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
            # per instruction and per source line: stall samples, excessive sectors, bank conflicts
            src = subprocess.run([ncu, "-i", report + ".ncu-rep", "--csv", "--page", "source", "--print-source",
                                  "sass"], cwd=ROOT, capture_output=True, text=True, timeout=120)
            with open(f"{report}_source_sass.csv", "w") as f:
                f.write(src.stdout + src.stderr)
        except subprocess.TimeoutExpired:
            res[name] = {"error": "ncu timed out"}
            continue
        with open(report + ".csv", "w") as f:
            f.write(proc.stdout + proc.stderr)
        launches = parse_ncu_csv(proc.stdout)
        if proc.returncode or not launches:
            res[name] = {"error": f"rc {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}
        else:
            res[name] = {k: v for k, v in launches[0].items() if k != "sections"}
            res[name]["sass"] = summarize_sass_csv(src.stdout)
        print(name, {k: v for k, v in res[name].items() if k not in ("rules",)}, flush=True)
    return res
