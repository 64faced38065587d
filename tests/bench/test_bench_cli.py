"""The benchmark commands run end to end on a tiny model (CPU) and write their JSON."""

from __future__ import annotations

import json

import pytest
import torch

from metainfer.entrypoints import cli
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bench"))
    build_tiny_model(folder, "qwen3")
    return folder


def _bench_json(bench, model_dir, tmp_path, *argv) -> dict:
    """Run `metainfer bench <bench>` on the tiny model (CPU); the JSON record it wrote."""
    out = tmp_path / f"{bench}.json"
    assert cli.main(["bench", bench, "--model", model_dir, "--device", "cpu", *argv, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_latency_json(model_dir, tmp_path):
    record = _bench_json("latency", model_dir, tmp_path, "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                         "--iters", "3", "--warmup", "0")
    assert record["bench"] == "latency" and record["batch_size"] == 2 and record["tpot_ms"] > 0
    # every timed iteration is kept; the reported figures are their medians
    assert record["warmup"] == 0 and len(record["totals_s"]) == len(record["ttfts_ms"]) == 3
    assert record["total_s"] == sorted(record["totals_s"])[1]
    assert record["ttft_ms"] == pytest.approx(sorted(record["ttfts_ms"])[1], rel=1e-12)
    assert record["env"]["torch"] and record["startup_s"] > 0
    # TPOT: the median of the iterations' in-request figures; the e2e figure from the two medians
    assert record["tpot_ms"] == pytest.approx(sorted(record["tpots_ms"])[1], rel=1e-12)
    assert record["tpot_e2e_ms"] == pytest.approx((record["total_s"] * 1e3 - record["ttft_ms"]) / (4 - 1), rel=1e-9)
    # the decode steps of a generate are a part of its wall time
    assert 0 < record["tpot_ms"] * (4 - 1) < max(record["totals_s"]) * 1e3
    tpot_s = record["tpot_ms"] / 1e3
    assert record["decode_tok_s"] == pytest.approx(2 / tpot_s, rel=1e-6)
    assert record["achieved_weight_bw_GBs"] == pytest.approx(record["weight_bytes"] / tpot_s / 1e9, rel=1e-6)


def test_bench_latency_rejects_a_single_output_token(model_dir):
    from metainfer import LLM
    from metainfer.bench.latency import run_latency

    with pytest.raises(ValueError, match="output_len"):
        run_latency(LLM(model_dir, device="cpu", dtype="float32"), 1, 8, 1)


def test_bench_throughput_json(model_dir, tmp_path):
    # outputs long enough that the steps dominate the run: the time before the first step (adding the requests,
    # ~5 ms on a loaded CPU) is outside the timeline, and a 9-token run left it over 20% of elapsed
    record = _bench_json("throughput", model_dir, tmp_path, "--num-seqs", "6", "--min-input-len", "5",
                         "--max-input-len", "40", "--min-output-len", "30", "--max-output-len", "60")
    assert record["num_seqs"] == 6 and 6 * 30 <= record["output_tokens"] <= 6 * 60
    assert record["output_tok_s"] == pytest.approx(record["output_tokens"] / record["elapsed_s"], rel=1e-6)
    assert record["total_tok_s"] == pytest.approx((record["input_tokens"] + record["output_tokens"])
                                                  / record["elapsed_s"], rel=1e-6)
    # the timeline accounts for every token: each prompt prefilled once (random prompts: no prefix
    # hits, no preemption here), each sequence's first token from its prefill, the rest one a decode step
    timeline = record["timeline"]
    assert record["preemptions"] == 0
    assert timeline["prefill"]["tokens"] == record["input_tokens"]
    assert sum(v["seqs"] for v in timeline["decode"].values()) == record["output_tokens"] - 6
    spent = timeline["prefill"]["seconds"] + timeline["decode_seconds"]
    assert 0 < spent <= record["elapsed_s"] and spent == pytest.approx(record["elapsed_s"], rel=0.2)


def test_timeline_summary_bins_and_intervals():
    from metainfer.bench.throughput import summarize_timeline

    trace = [(0.0, True, 3, 300), (0.5, True, 1, 50), (0.6, False, 4, 4), (0.7, False, 4, 4), (0.9, False, 1, 1)]
    out = summarize_timeline(trace, end=1.0)
    assert out["prefill"]["steps"] == 2 and out["prefill"]["tokens"] == 350
    assert out["prefill"]["seconds"] == pytest.approx(0.6)
    assert out["decode"]["<=16"] == {"steps": 2, "seqs": 8, "seconds": pytest.approx(0.3),
                                     "ms_per_step": pytest.approx(150.0)}
    assert out["decode"]["<=2"]["seconds"] == pytest.approx(0.1) and out["decode_seconds"] == pytest.approx(0.4)
    assert out["first_steps_ms"][0] == ["prefill", 3, 300, 500.0] and out["first_steps_ms"][-1][-1] == 100.0
    assert summarize_timeline([(0.0, False, 300, 300)], end=0.01)["decode"]["<=300"]["steps"] == 1


def test_bench_baseline_eager_json(model_dir, tmp_path):
    record = _bench_json("baseline", model_dir, tmp_path, "--modes", "eager", "--batch-size", "1", "--input-len", "8",
                         "--output-len", "4", "--iters", "1")
    result = record["results"][0]
    assert result["mode"] == "eager" and result["tpot_ms"] > 0 and "tpot_e2e_ms" in result
    # TPOT from the tokens' own times inside a full generate (time_hf checks it saw all 4): 3 steps of it
    # fit in that generate's wall time, and the rate follows from it
    assert result["tpot_ms"] * (4 - 1) < 4 / result["e2e_output_tok_s"] * 1e3
    assert result["decode_tok_s"] == pytest.approx(1e3 / result["tpot_ms"], rel=1e-9)


def test_bench_baseline_records_whether_transformers_compiled(model_dir, tmp_path, capsys):
    """transformers compiles a static-cache generate only on GPUs: on the CPU the "compile" mode is a static cache
    alone, and the record and the printed line say so. The graph counter it reads does move when torch.compile
    builds a graph, so its False is measured, not assumed."""
    from metainfer.bench.baselines import _dynamo_graphs

    before = _dynamo_graphs()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert _dynamo_graphs() > before
    record = _bench_json("baseline", model_dir, tmp_path, "--modes", "eager,compile", "--batch-size", "1",
                         "--input-len", "8", "--output-len", "4", "--iters", "1")
    assert [(r["mode"], r["compiled"]) for r in record["results"]] == [("eager", False), ("compile", False)]
    assert "HF static cache, not compiled" in capsys.readouterr().out


def test_bench_baseline_says_compiled_when_a_graph_was_built_during_the_warm_up(model_dir, monkeypatch):
    """The other side: a graph built while the warm-up runs (as on a GPU) makes the record say compiled."""
    from metainfer.bench import baselines
    from metainfer.bench.baselines import load_hf_model, time_hf

    graphs = iter(range(100))  # every read one more than the last: a graph built between the two reads
    monkeypatch.setattr(baselines, "_dynamo_graphs", lambda: next(graphs))
    hf = load_hf_model(model_dir, torch.float32, torch.device("cpu"), dummy=False)
    assert time_hf(hf, 1, 8, 4, iters=1, mode="compile")["compiled"] is True


def test_bench_baseline_rejects_an_fp8_kv_cache(model_dir, capsys):
    """HF keeps its own cache in the model dtype: the flag must not be silently ignored."""
    assert cli.main(["bench", "baseline", "--model", model_dir, "--device", "cpu", "--modes", "eager",
                     "--kv-cache-dtype", "fp8"]) == 2
    assert "kv_cache_dtype" in capsys.readouterr().err


def test_cli_bad_engine_option_is_one_line_naming_the_field(model_dir, capsys):
    assert cli.main(["generate", "hi", "--model", model_dir, "--device", "cpu", "--kv-cache-dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype" in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("bench", ["latency", "baseline"])
def test_bench_rejects_a_single_output_token_before_loading(model_dir, capsys, bench):
    """--output-len 1 leaves no token to time TPOT over: one error line, before any model is loaded."""
    assert cli.main(["bench", bench, "--model", model_dir, "--device", "cpu", "--output-len", "1"]) == 2
    assert "--output-len must be >= 2" in capsys.readouterr().err


def test_bench_baseline_refuses_device_mlx_in_one_line(model_dir, capsys):
    """The HF baseline is HF transformers in torch: --device mlx would silently time torch on the CPU, so it is
    refused with one line naming the option, before any model is loaded."""
    assert cli.main(["bench", "baseline", "--model", model_dir, "--device", "mlx", "--output-len", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("metainfer: error: --device mlx: the HF baseline runs HF transformers in torch, not MLX; "
                           "pass --device cpu or cuda"), err


def test_bench_baseline_refuses_a_step_trace(model_dir, capsys, tmp_path):
    """--step-trace traces MetaInfer's engine steps; the HF baseline runs none, so the option would silently write
    nothing: refused in one line, before any model is loaded."""
    assert cli.main(["bench", "baseline", "--model", model_dir, "--device", "cpu", "--output-len", "4",
                     "--step-trace", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.startswith("metainfer: error: --step-trace: the HF baseline runs no MetaInfer")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--num-seqs", "0"], "--num-seqs must be >= 1, got 0"),
    (["--min-input-len", "50", "--max-input-len", "10"], "--min-input-len and --max-input-len need 1 <= min <= max"),
    (["--min-output-len", "0"], "--min-output-len and --max-output-len need 1 <= min <= max")])
def test_bench_throughput_refuses_bad_sizes_before_loading(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "throughput", "--model", "/nonexistent/model-folder", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
