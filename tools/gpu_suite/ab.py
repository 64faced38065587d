"""A/B in the engine (by name only, not in the default run): kernel sets swapped into one engine
(`runner.swap_kernels` binds them and re-captures the graphs), then the kill switches, each an engine
of its own (LLM keywords)."""

from __future__ import annotations

from dataclasses import replace

import torch

from tools.gpu_suite.common import bench_llm, release, show, variant

QKV, O_PROJ, GATE_UP, DOWN, LM_HEAD = "6144x4096", "4096x4096", "24576x4096", "4096x12288", "151936x4096"
EIGHT_WARPS_8_ROWS, EIGHT_WARPS_16_ROWS = {"block_n": 8, "num_warps": 8}, {"block_n": 16, "num_warps": 8}
# kill switch -> (LLM keywords, the batch size it matters at)
SWITCHES = {"no_pdl": ({"enable_pdl": False}, 1), "sync": ({"async_scheduling": False}, 1),
            "torch_sampler": ({"enable_fused_sampler": False}, 1), "no_skinny_gemm": ({"enable_skinny_gemm": False}, 8)}


def _measure(llm, batches, iters: int) -> dict:
    from metainfer.bench.latency import run_latency

    return {f"bs{b}": run_latency(llm, batch_size=b, input_len=32, output_len=128, iters=iters) for b in batches}


def _kernel_variants(args, runner, results) -> tuple[list, list]:
    """(bs1 variants, 4-32-row variants) as (name, KernelOps). bs1: the GEMV launch shapes around the
    shipped table under PDL (it was swept in isolation without PDL), cuBLAS, the torch step inputs, a
    `gemv` sweep's winners of this run and `--ab-tables-of` GPU's tables; the default first and last (the
    run's own noise). Rows: a `skinny_sweep` of this run and the other GPU's tables against the shipped
    skinny table."""
    from metainfer.kernels import select_ops, step_inputs_ref
    from metainfer.kernels.gemv import GemvConfig
    from metainfer.kernels.tuned_configs import load_tuned_configs

    gpu, dev, pdl, default = torch.cuda.get_device_name(), runner.device, runner.ops.pdl, runner.ops
    shipped = load_tuned_configs(gpu)["gemv"]

    def shaped(fields, *keys):
        table = {key: replace(GemvConfig.from_any(cfg), **(fields if key in keys else {})).to_dict()
                 for key, cfg in shipped.items()}
        return select_ops(dev, gpu_name=gpu, pdl=pdl, gemv_table=table)

    bs1 = [("default", default), ("cublas", select_ops(dev, gpu_name=gpu, pdl=pdl, gemv_table={})),
           ("torch_step_inputs", replace(default, step_inputs=step_inputs_ref))]
    if pdl and shipped:
        bs1 += [("gemv_qkv_gate_up_lm_head_8_warps", shaped(EIGHT_WARPS_8_ROWS, QKV, GATE_UP, LM_HEAD)),
                ("gemv_qkv_16_rows", shaped(EIGHT_WARPS_16_ROWS, QKV)),
                ("gemv_gate_up_16_rows", shaped(EIGHT_WARPS_16_ROWS, GATE_UP)),
                ("gemv_lm_head_16_rows", shaped(EIGHT_WARPS_16_ROWS, LM_HEAD)),
                ("gemv_o_down_split_k2", shaped({"split_k": 2}, O_PROJ, DOWN))]
    swept = results.get("gemv", {}).get("table")
    if swept:
        bs1.append(("gemv_this_sweep", select_ops(dev, gpu_name=gpu, pdl=pdl, gemv_table=swept)))
    # another GPU's GEMV and skinny tables on this one, where they differ from its own (an H200's on another GPU;
    # the H100 ships them since run 111, so there the variant would time the default again)
    other = args.ab_tables_of if args.ab_tables_of and args.ab_tables_of != gpu else ""
    if other and all(load_tuned_configs(other)[k] == load_tuned_configs(gpu)[k] for k in ("gemv", "skinny")):
        other = ""
    if other:
        bs1.append((f"tables_of {other}", select_ops(dev, gpu_name=other, pdl=pdl)))
    bs1.append(("default_again", default))
    rows = []
    skinny = results.get("skinny_sweep", {}).get("table")
    if skinny:
        rows.append(("skinny_this_sweep", select_ops(dev, gpu_name=gpu, pdl=pdl, skinny_table=skinny)))
    if other:
        rows.append((f"tables_of {other}", select_ops(dev, gpu_name=other, pdl=pdl)))
    return bs1, [("default", default), *rows] if rows else []


def ab(args, results) -> dict:
    """bs1 tok/s per kernel variant (3 timed iterations each), 4 / 8 / 16 / 32 rows per skinny table,
    then bs1 (bs8 for the skinny GEMM) per kill switch against the default engine's figure."""
    llm = bench_llm(args)
    runner = llm.llm_engine.runner
    default = runner.ops
    res = {"bs1": {}, "rows": {}, "switches": {}, "graph_batch_sizes": runner.graph_batch_sizes, "pdl": default.pdl}
    try:
        bs1, rows = _kernel_variants(args, runner, results)
        for name, ops in bs1:
            runner.swap_kernels(ops)
            res["bs1"][name] = _measure(llm, (1,), 3)["bs1"]
            print("ab bs1", name, round(res["bs1"][name]["decode_tok_s"], 1), flush=True)
        for name, ops in rows:
            runner.swap_kernels(ops)
            res["rows"][name] = _measure(llm, (4, 8, 16, 32), 2)
            show(f"ab rows {name}", {b: r["decode_tok_s"] for b, r in res["rows"][name].items()})
        runner.swap_kernels(default)
        res["switches"]["default"] = _measure(llm, (1, 8), 3)
    finally:
        del llm, runner, default
        release()
    for name, (kw, batch) in SWITCHES.items():
        res["switches"][name] = variant(args, lambda llm, batch=batch: _measure(llm, (batch,), 3), **kw)
        show(f"ab switch {name}", res["switches"][name])
    return res


def tree_ab(args, results) -> dict:
    """The nano-vllm or 1,000 x 1,000 protocol with this checkout's `metainfer` (A) and --tree-ab-dir's (B,
    prepared by `python -m tools.tree_ab prepare COMMIT`), each run a fresh process, in --tree-ab-order."""
    import json
    import os

    from tools.gpu_suite.common import model_dir, out_dir
    from tools.tree_ab import ab as tree_ab_runs

    if not args.tree_ab_dir:
        raise ValueError("tree_ab needs --tree-ab-dir (python -m tools.tree_ab prepare COMMIT)")
    user_kw = json.loads(args.tree_ab_engine_kw)
    engine_kw = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096, **user_kw}
    res = tree_ab_runs(args.tree_ab_dir, model_dir(args), args.tree_ab_protocol, engine_kw, args.tree_ab_order,
                       record_path=os.path.join(out_dir(), "tree_ab_runs.json"))
    show("tree_ab", {k: res[k] for k in ("a_mean", "b_mean", "b_over_a", "num_kv_blocks")})
    return {**res, "user_engine_kw": user_kw}
