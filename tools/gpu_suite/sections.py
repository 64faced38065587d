"""Every section by name, and the default run: what the acceptance figures need, in one call under
~9 minutes on the H200 (the device call's limit is 10). Budget from past runs (s): latency ~60,
throughput bf16 + fp8 ~70, kernels ~10, graphs ~50, agreement ~12, baseline ~85, profile ~15;
gpu_tests gets what is left of --budget-s."""

from __future__ import annotations

from tools.gpu_suite import ab, agreement, checks, families, figures, profiles, serving, studies

SECTIONS = {
    "latency": figures.latency,
    "throughput": figures.throughput,
    "kv_fp8": figures.kv_fp8,
    "baseline": figures.baseline,
    "kernels": checks.kernels,
    "graphs": checks.graphs,
    "gpu_tests": checks.gpu_tests,
    "allreduce": checks.allreduce,
    "agreement": agreement.agreement,
    "profile": profiles.profile,
    "profile_batch": profiles.profile_batch,
    "profile_mixed": profiles.profile_mixed,
    "gemv": studies.gemv,
    "gemm_rows": studies.gemm_rows,
    "skinny_sweep": studies.skinny_sweep,
    "attn_sweep": studies.attn_sweep,
    "attn_kv_dtype": studies.attn_kv_dtype,
    "attn_ncu": studies.attn_ncu,
    "sampler": studies.sampler,
    "ab": ab.ab,
    "tree_ab": ab.tree_ab,
    "moe_families": families.moe_families,
    "tune_moe": families.tune_moe,
    "bench_moe": families.bench_moe,
    "bench_mla": families.bench_mla,
    "mla_split_sweep": families.mla_split_sweep,
    "tune_gemv_moe": families.tune_gemv_moe,
    "serving": serving.serving,
}

# latency first: its engine start is then a cold one (Triton compiles included); gpu_tests last, its
# timeout is the budget left
DEFAULT_SECTIONS = ("latency", "throughput", "kernels", "graphs", "agreement", "baseline", "profile", "gpu_tests")
