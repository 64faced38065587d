"""The GPU suite's pure-Python parts on the CPU, so a typo there cannot cost a device run: the summary
table renders from a synthetic result of every section (each key the table reads), from missing,
errored and malformed sections, and the default run names sections that exist."""

from __future__ import annotations

import json

import pytest

from tools.gpu_suite.__main__ import main, parse_args
from tools.gpu_suite.sections import DEFAULT_SECTIONS, SECTIONS
from tools.gpu_suite.table import render


def _lat(tok_s: float, **extra) -> dict:
    return {"decode_tok_s": tok_s, **extra}


def full_results() -> dict:
    bs1 = _lat(246.0, tpot_ms=4.06, roofline_tok_s=270.0, copy_bw_GBs=4300.0, bw_ratio=0.91, tpot_e2e_ms=4.1)
    timeline = {"prefill": {"seconds": 3.1}, "decode_seconds": 20.5,
                "decode": {"256": {"ms_per_step": 30.1, "steps": 400}}}
    agree = {"top1": 0.98, "cos_mean": 0.9995}
    return {
        "env": {"gpu": "NVIDIA H200"},
        "latency": {"startup_s": 21.0, "bs1": bs1, "ttft_1024": {"ttft_ms": 25.2}, "bs8": _lat(1800.0)},
        "baseline": {"eager": _lat(30.0), "compile": _lat(120.0), "eager_bs8": _lat(220.0),
                     "eager_ttft_1024": {"ttft_ms": 60.0}},
        "throughput": {"output_tok_s": 9400.0, "elapsed_s": 25.0, "timeline": timeline,
                       "kv_fp8": {"output_tok_s": 9900.0}},
        "kv_fp8": {"bs1": _lat(240.0), "bs8": _lat(1750.0), "ttft_1024": {"ttft_ms": 26.0},
                   "bs64_ctx1024": _lat(5000.0), "bs64_ctx1024_bf16_cache": _lat(4500.0)},
        "kernels": {"rms_norm": {"ok": True}, "all_ok": True},
        "graphs": {"graph": {"equal_to_eager": True}, "graph_kv_fp8": {"equal_to_eager": True},
                   "exercised": {"prefix_hits": True, "preemptions": True, "fp8_changes_tokens": True},
                   "family": "qwen3"},  # a string beside the variants (run 67's table error)
        "agreement": {"top1_agreement": 0.98, "cosine_mean": 0.9995,
                      "decode_kv_fp8": {"ours_vs_hf_bf16": agree, "ours_vs_hf_bf16_fp8_kv": agree,
                                        "hf_bf16_fp8_kv_vs_hf_bf16": agree}},
        "gpu_tests": {"returncode": 0, "summary": ["120 tests, 0 failed, 0 errors, 3 skipped"]},
        "allreduce": {"returncode": 1, "summary": ["4 tests, 1 failed", "test_x"]},
        "profile": {v: {"wall_ms_per_token": 4.0, "device_ms_per_token": 3.8, "gaps_ms_per_token": 0.2,
                        "device_ms_per_token_by_kind": {"gemm": 3.0, "attention": 0.5}}
                    for v in ("graph", "graph_no_pdl")},
        "profile_batch": {"wall_ms_per_step": 30.0, "device_ms_per_step": 29.0},
        "gemv": {"decode_set": {"cublas_ms": 4.0, "triton_ms": 3.6, "bytes": 1}},
        "attn_sweep": {f"ctx{c}": {"shipped": {"us": 3.0}, "best": {"us": 2.9, "block_n": 32, "min_split": 64}}
                       for c in (32, 96, 160, 1024)},
        "attn_kv_dtype": {"b256_ctx600": {"mean_ctx": 600.0, "bf16_default": {"us": 50.0},
                                          "fp8_default": {"us": 30.0}, "fp8_tail32": {"error": "x"}}},
        "sampler": {"b1_t0.0": {"torch_ms": 0.1, "fused_ms": 0.02, "greedy_equal": True}},
        "gemm_rows": {"m8": {"ms": 4.5, "skinny_ms": 4.1, "skinny_max_rel_err": 1e-3}, "m128": {"ms": 6.0}},
        "skinny_sweep": {"decode_set": {"m16": {"cublas_ms": 4.8, "skinny_tuned_ms": 4.4,
                                                "ratio_cublas_over_skinny": 1.09}}},
        "ab": {"bs1": {"default": _lat(245.0)}, "rows": {"default": {f"bs{b}": _lat(900.0) for b in (4, 8, 16, 32)}},
               "switches": {"default": {"bs1": _lat(245.0), "bs8": _lat(1800.0)}, "no_pdl": {"bs1": _lat(230.0)},
                            "sync": {"error": "RuntimeError: boom"}}},
        "tree_ab": {"protocol": "nano_vllm", "order": "AB", "user_engine_kw": {"num_kv_blocks": 6192},
                    "engine_kw": {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096,
                                  "num_kv_blocks": 6192},
                    "runs": [{"label": "A", "commit": "checkout", "output_tok_s": 7478.0, "num_kv_blocks": 6192},
                             {"label": "B", "commit": "ebb647d0123456789", "output_tok_s": 6913.0,
                              "num_kv_blocks": 6192}],
                    "a_mean": 7478.0, "b_mean": 6913.0, "b_over_a": 6913.0 / 7478.0, "pools_differ": False,
                    "num_kv_blocks": {"A": 6192, "B": 6192}},
        "section_seconds": {"latency": 60.0, "throughput": 70.0},
    }


ROW_LABELS = [
    "bs1 decode tok/s | 246.0", "(generate - TTFT)", "vs HF eager | 246.0 | 30.0", "vs HF compile",
    "bs8 decode tok/s vs HF eager", "TTFT 1024 tokens (ms) | 25.2", "TTFT 1024 vs HF eager", "engine start",
    "throughput output tok/s | 9400", "fp8 KV cache | 9900", "prefill s / decode s", "decode ms/step by seqs",
    "fp8 KV cache: bs1 / bs8", "bs64 ctx 1024 decode tok/s: bf16 / fp8 cache | 4500 / 5000",
    "kernels vs reference (bf16, 8B shapes) | all ok", "graph == eager greedy (+prefix, +preempt, +fp8 KV) | yes",
    "teacher-forced top-1 / cosine vs HF bf16 | 0.980 / 0.99950", "agreement, fp8 KV cache vs HF bf16",
    "fp8 KV: ours vs HF over fp8 K/V", "gpu_tests: pytest on the GPU | rc 0", "allreduce: pytest on the GPU | rc 1",
    "bs1 decode step (graph)", "bs1 decode step (graph_no_pdl)", "256-seq decode step", "decode-set GEMVs",
    "bs1 decode attention ctx 1024 (us) | shipped 3.00",
    "decode attention b256_ctx600: bf16 / fp8 cache (us) | 50.0 / 30.0",
    "sampler b1_t0.0", "decode set at 8 rows: cuBLAS / skinny GEMM (ms) | 4.500 / 4.100",
    "decode set at 128 rows: cuBLAS / skinny GEMM (ms) | 6.000 / -", "tuned skinny GEMM (ms) | 4.800 / 4.400",
    "ab bs1 tok/s, default | 245.0", "ab tok/s at bs 4 / 8 / 16 / 32, default | 900 / 900 / 900 / 900",
    "ab switch default: tok/s | bs1 245.0, bs8 1800.0", "ab switch no_pdl", "ab switch sync | ERROR RuntimeError: boom",
    "tree_ab nano_vllm {'num_kv_blocks': 6192}: A 7478 / B 6913 | B 6913 | A (this checkout) 7478; B = ebb647d01234; "
    "KV blocks A 6192 B 6192 | 0.9244",
    "section seconds | latency 60, throughput 70 | total 130",
]


def test_every_row_renders_from_a_full_result():
    table = render(full_results())
    assert "table error" not in table, table
    for label in ROW_LABELS:
        assert label in table, (label, table)
    assert all(line.startswith("|") and line.endswith("|") for line in table.splitlines()[1:]), table


def test_graph_mismatch_and_failing_kernels_show():
    results = full_results()
    results["graphs"]["graph_kv_fp8"]["equal_to_eager"] = False
    results["kernels"]["all_ok"] = False
    table = render(results)
    assert "+fp8 KV) | NO" in table and "8B shapes) | FAIL" in table


def test_missing_errored_and_malformed_sections():
    assert render({}).strip().splitlines() == ["| figure | ours | reference | ratio |", "|---|---|---|---|"]
    results = {"latency": {"error": "RuntimeError: CUDA out of memory"}, "throughput": {"output_tok_s": 9000.0}}
    table = render(results)
    assert "| latency | ERROR RuntimeError: CUDA out of memory |" in table
    assert "throughput output tok/s | 9000" in table
    # a result of unexpected shape costs its own rows only
    results["kv_fp8"] = {"bs1": {}}
    table = render(results)
    assert "| kv_fp8 | table error: KeyError" in table and "throughput output tok/s | 9000" in table


def test_the_default_run_names_existing_sections():
    assert DEFAULT_SECTIONS and set(DEFAULT_SECTIONS) <= set(SECTIONS)
    assert all(callable(fn) and fn.__doc__ for fn in SECTIONS.values())
    # the acceptance figures are in the default run; the tuning sweeps and studies are not
    assert {"gpu_tests", "kernels", "graphs", "agreement", "latency", "throughput", "baseline", "profile"} <= \
        set(DEFAULT_SECTIONS)
    assert not {"gemv", "gemm_rows", "skinny_sweep", "attn_sweep", "attn_kv_dtype", "ab", "sampler",
                "profile_batch"} & set(DEFAULT_SECTIONS)
    assert parse_args([]).sections.split(",") == list(DEFAULT_SECTIONS)
    with pytest.raises(SystemExit):
        parse_args(["--sections", "latency,fused_decode_prep"])


def test_gemm_rows_takes_a_list_or_a_range():
    assert parse_args([]).gemm_rows == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert parse_args(["--gemm-rows", "3,5"]).gemm_rows == (3, 5)
    assert parse_args(["--gemm-rows", "32-80:16"]).gemm_rows == (32, 48, 64, 80)
    for bad in ("0,4", "a-b", "", "64-32:16"):
        with pytest.raises(SystemExit):
            parse_args(["--gemm-rows", bad])


def test_print_table_reads_the_results_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "gpu_results.json").write_text(json.dumps(full_results()))
    monkeypatch.setenv("OUT", str(tmp_path))
    main(["--print-table"])
    assert "bs1 decode tok/s | 246.0" in capsys.readouterr().out


def test_mixed_steps_and_moe_families_render():
    """profile_mixed (the planned-launch A/B's rows without a device time) and moe_families (figures, start-up
    phases, the bs1 profile at two contexts, the bs1 A/B) each get their rows."""
    ab = {v: _lat(t) for v, t in (("default", 452.0), ("long_splits", 449.0), ("default_again", 451.5))}
    engine = {"bs1": _lat(452.0), "throughput": {"output_tok_s": 9500.0}, "ttft_1024": {"ttft_ms": 21.0},
              "startup_s": 48.0, "startup_phases_s": {"warm_up": 20.0},
              "profile_bs1": {"wall_ms_per_token": 2.16, "wall_ms_per_token_ctx150": 2.21}}
    table = render({"profile_mixed": {"mixed_128": {"wall_ms_per_step": 8.3, "host_enqueue_ms_median": 6.1,
                                                    "device_ms_per_step": 8.0},
                                      "mixed_128_unplanned": {"wall_ms_per_step": 8.4, "host_enqueue_ms_median": 6.5}},
                    "moe_families": {"deepseek-v2-lite": {"engine": engine, "bs1_ab": ab}}})
    assert "| mixed step mixed_128: wall / enqueue / device ms | 8.30 / 6.10 / 8.00 |" in table
    assert "| mixed step mixed_128_unplanned: wall / enqueue / device ms | 8.40 / 6.50 / - |" in table
    assert "deepseek-v2-lite: bs1 tok/s / throughput / TTFT 1024 ms / start s | 452.0 / 9500 / 21.0 / 48.0" in table
    assert "deepseek-v2-lite: bs1 wall ms at ctx ~40 / ~150 / after the profiler (~180) | 2.160 / 2.210 / -" in table
    assert "bs1 A/B tok/s (default / long_splits / default_again) | 452.0 / 449.0 / 451.5" in table
    assert "table error" not in table


def test_serving_variants_render_with_the_servers_histograms():
    hist = {"engine_step_interval": {"p50_ms": 7.1, "p99_ms": 12.0}, "server_itl": {"p50_ms": 7.3, "p99_ms": 20.5}}
    serving = {"serve_vs_offline": {"variants": {
        "default": {"serve_over_offline": 0.941, "median_itl_ms": 8.64, "p99_itl_ms": 40.96, "server_histograms": hist},
        "--max-mixed-prefill-tokens 256": {"serve_over_offline": 0.951, "median_itl_ms": 9.1, "p99_itl_ms": 25.84}}}}
    table = render({"serving": serving})
    assert ("| serve default: of offline / ITL median / p99 ms | 94.1% / 8.64 / 40.96 | engine step p50 / p99 "
            "7.1 / 12.0; server ITL 7.3 / 20.5 |") in table
    assert "| serve --max-mixed-prefill-tokens 256: of offline / ITL median / p99 ms | 95.1% / 9.10 / 25.84 |" in table
    assert "table error" not in table
