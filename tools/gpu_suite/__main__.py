"""Every GPU check and benchmark in one call, for the device machine:

    python -m tools.gpu_suite [--sections a,b,...] [--budget-s 540]

Writes $OUT/gpu_results.json after every section (a run cut short keeps what it measured), the GPU
tests' output, and prints a short table last ($OUT/table.md). Sections (tools/gpu_suite/sections.py):
  default    latency, throughput, kernels, graphs, agreement, baseline, profile, gpu_tests
  by name    kv_fp8, allreduce, profile_batch, the sweeps gemv / gemm_rows / skinny_sweep / attn_sweep /
             attn_kv_dtype, attn_ncu (Nsight Compute on the decode attention), sampler, ab (in-engine kernel A/B and
             the kill switches), tree_ab (a protocol with another commit's metainfer, tools/tree_ab.py); the MoE
             families:
             moe_families (DeepSeek-V2-Lite and Qwen3-30B-A3B figures, HF beside, agreement), tune_moe,
             tune_gemv_moe, bench_moe, bench_mla, mla_split_sweep; serving (prefix hits after start, bench serve
             against the offline engine, 1,000 x 1,000 throughput: needs .gpu_assets/wheels for the server)
--print-table renders $OUT/gpu_results.json again (CPU). The tokenizer comes from --tokenizer-dir
(.gpu_assets/tokenizer, git-ignored: carry it to the device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

from tools.gpu_suite.common import ROOT, error_of, out_dir, save
from tools.gpu_suite.sections import DEFAULT_SECTIONS, SECTIONS
from tools.gpu_suite.table import render
from tools.tree_ab import PROTOCOLS as TREE_AB_PROTOCOLS


def row_counts(text: str) -> tuple[int, ...]:
    """'1,2,4' or 'START-END:STEP' (END included) -> the row counts, each >= 1."""
    try:
        if "-" in text:
            span, _, step = text.partition(":")
            start, end = (int(v) for v in span.split("-"))
            rows = tuple(range(start, end + 1, int(step or 1)))
        else:
            rows = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints or START-END:STEP, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be >= 1 and not empty, got {text!r}")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    first, *rest = __doc__.splitlines()
    p = argparse.ArgumentParser(prog="python -m tools.gpu_suite", description=first, epilog="\n".join(rest),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--config", default=os.path.join(ROOT, "benchmarks", "configs", "qwen3-8b.json"))
    p.add_argument("--tokenizer-dir", default=os.path.join(ROOT, ".gpu_assets", "tokenizer"))
    p.add_argument("--baseline-modes", default="eager,compile")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds the whole call may take; gpu_tests' timeout is what is left of it")
    p.add_argument("--quick-below-s", type=float, default=200.0,
                   help="with less than this left for gpu_tests, only the tests not marked slow run")
    p.add_argument("--gpu-test-files", default="tests/kernels", help="comma list of test paths for gpu_tests")
    p.add_argument("--ab-tables-of", default="NVIDIA H200",
                   help="ab: also run this GPU's GEMV / skinny tables on the current one ('' for none)")
    p.add_argument("--gpu-test-workers", type=int, default=4,
                   help="gpu_tests: pytest-xdist processes sharing the GPU (1: one process, no xdist)")
    p.add_argument("--gpu-test-marker", default="", help="pytest -m expression for gpu_tests (overrides the above)")
    p.add_argument("--gpu-test-filter", default="", help="pytest -k expression for gpu_tests")
    p.add_argument("--moe-models", default="deepseek-v2-lite,qwen3-30b-a3b",
                   help="moe_families: comma list of benchmarks/configs names")
    p.add_argument("--moe-parts", default="engine,hf,agreement",
                   help="moe_families: comma list of engine, hf, agreement, bs1_ab (in-engine bs1 A/B), "
                        "prefill_ab (MLA prefill rule A/B)")
    p.add_argument("--moe-bench-tokens", default="",
                   help="bench_moe: comma list of token counts (default: the tool's)")
    p.add_argument("--moe-tune-shapes", default="",
                   help="tune_moe: comma list of tools/tune_moe.py shape names (default: all)")
    p.add_argument("--bench-mla-args", default="",
                   help="bench_mla: extra tools/bench_mla.py arguments, e.g. '--skip-decode'")
    p.add_argument("--graph-family", default="qwen3", choices=("qwen3", "deepseek_v2", "qwen3_moe"),
                   help="graphs: the small model's family")
    p.add_argument("--serving-parts", default="prefix_hits,serve_vs_offline,throughput_1k",
                   help="serving: comma list of prefix_hits, serve_vs_offline, throughput_1k")
    p.add_argument("--serve-variants", default="",
                   help="serving serve_vs_offline: ';'-separated extra `metainfer serve` args, one server each "
                        "against the one offline run (the first is the reported figure; '' = defaults)")
    p.add_argument("--throughput-1k-variants", default="bf16,fp8",
                   help="serving throughput_1k: comma list of bf16, fp8, bf16_greedy (kv_reserve_ratio 0: the KV "
                        "reserve's A/B); a name repeated is kept as name#2 (A/B/A)")
    p.add_argument("--gemm-rows", type=row_counts, default=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                   help="gemm_rows: the row counts, a comma list or START-END:STEP (e.g. 32-512:16, every decode graph "
                        "bucket from 32: cuBLAS's time is not monotone in rows, run 127)")
    p.add_argument("--agreement-positions", type=int, default=128,
                   help="moe_families agreement: teacher-forced positions after the 32-token prompt")
    p.add_argument("--tree-ab-dir", default="",
                   help="tree_ab: the B side's tree (python -m tools.tree_ab prepare COMMIT; carry .tree_ab)")
    p.add_argument("--tree-ab-protocol", default="nano_vllm", choices=sorted(TREE_AB_PROTOCOLS),
                   help="tree_ab: the protocol both trees run")
    p.add_argument("--tree-ab-engine-kw", default="{}",
                   help="tree_ab: LLM keywords for both sides as a JSON object, e.g. '{\"num_kv_blocks\": 6192}'")
    p.add_argument("--tree-ab-order", default="ABBA", help="tree_ab: the run order, a string of A and B")
    p.add_argument("--print-table", action="store_true", help="only print the table of $OUT/gpu_results.json")
    args = p.parse_args(argv)
    from tools.gpu_suite.serving import THROUGHPUT_1K_VARIANTS

    bad = [name for name in args.throughput_1k_variants.split(",") if name not in THROUGHPUT_1K_VARIANTS]
    if bad:
        p.error(f"unknown --throughput-1k-variants {bad}; known: {', '.join(THROUGHPUT_1K_VARIANTS)}")
    unknown = [name for name in args.sections.split(",") if name not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    return args


def run_section(name: str, args, results: dict) -> None:
    """One section, timed; an exception is recorded and the run goes on (one broken section must not
    hide the rest)."""
    start = time.perf_counter()
    print(f"\n=== {name} ===", flush=True)
    try:
        results[name] = SECTIONS[name](args, results)
    except Exception as exc:
        traceback.print_exc()
        results[name] = error_of(exc)
    results.setdefault("section_seconds", {})[name] = time.perf_counter() - start
    save(results)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.print_table:
        with open(os.path.join(out_dir(), "gpu_results.json")) as f:
            print(render(json.load(f)))
        return
    import torch

    from metainfer.bench.common import copy_bandwidth, environment, gemm_flops

    args.started = time.perf_counter()
    results = {"env": environment()}
    results["env"]["copy_bw_GBs"] = copy_bandwidth(torch.device("cuda")) / 1e9
    results["env"]["gemm_bf16_TFLOPs"] = gemm_flops(torch.device("cuda")) / 1e12  # the floors' compute rate
    for name in args.sections.split(","):
        run_section(name, args, results)
    table = render(results)
    print(table)
    with open(os.path.join(out_dir(), "table.md"), "w") as f:
        f.write(table)


if __name__ == "__main__":
    main()
