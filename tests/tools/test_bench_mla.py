"""tools/bench_mla.py on the CPU: importable with no CUDA call, its pure helpers, and a clean refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_makes_no_cuda_call():
    code = (
        "import torch\n"
        "def boom(*a, **k):\n"
        "    raise AssertionError('CUDA touched at import')\n"
        "for name in ('is_available', 'init', 'device_count', 'get_device_name', 'synchronize', 'current_device'):\n"
        "    setattr(torch.cuda, name, boom)\n"
        "import tools.bench_mla\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_floor_and_flop_counts():
    from tools import bench_mla

    # one sequence of 512 tokens: 512 * 576 bf16 values = 589,824 bytes at 4.8 TB/s
    assert bench_mla.decode_floor_us(1, 512) == pytest.approx(589824 / 4.8e12 * 1e6)
    assert bench_mla.decode_floor_us(256, 8192) == pytest.approx(256 * 8192 * bench_mla.decode_floor_us(1, 1))
    assert bench_mla.decode_floor_us(1, 512, 1) == pytest.approx(bench_mla.decode_floor_us(1, 512) / 2)  # fp8
    # causal: T (T + 1) / 2 visible pairs; absorbed 512 + 64 + 512 per pair and head, expanded 192 + 128
    assert bench_mla.absorbed_prefill_flops(2) == 2.0 * 16 * 3 * 1088
    assert bench_mla.expanded_prefill_flops(2) == 2.0 * 16 * 3 * 320
    # a chunk of 2 new tokens over 3 cached ones: 2 * 3 prefix pairs + 3 causal ones
    assert bench_mla.causal_pairs(2, 5) == 9 and bench_mla.causal_pairs(2) == 3
    assert bench_mla.expanded_prefill_flops(2, context=5) == 2.0 * 16 * 9 * 320
    assert bench_mla.faster_form(1.0, 2.0) == "absorbed"
    assert bench_mla.faster_form(3.0, 2.0) == "expanded"
    assert bench_mla.faster_form(None, 2.0) is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_main_refuses_without_gpu(capsys):
    from tools import bench_mla

    assert bench_mla.main(["--budget-s", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_live_splits_follow_the_kernel_rule():
    """The sweep's live-split count is _split_range's: chunks of a block_n multiple of at least the minimum."""
    from tools import bench_mla

    # the engine at batch 1 over a 4,096-token table: 64 splits of >= 64 tokens, >= 32 for 65-256 tokens
    assert [bench_mla.live_splits(c, 64, 64, 32, 32) for c in (40, 64, 65, 100, 160, 256, 257, 512)] == \
        [1, 1, 3, 4, 5, 8, 5, 8]
    assert [bench_mla.live_splits(c, 64, 64, 32, 1024) for c in (40, 64, 65, 100, 160, 512)] == [1, 1, 2, 2, 3, 8]
    assert bench_mla.live_splits(160, 64, 256, 32, 1024) == 1
    assert bench_mla.live_splits(512, 64, 128, 64, 1024) == 4
    assert bench_mla.live_splits(8192, 8, 64, 32, 32) == 8  # long contexts: the split count bounds it


def test_decode_sweep_runs_every_knob_combination(monkeypatch):
    """The sweep on the CPU (the Triton interpreter; timing stubbed): one record per knob combination, each with
    the split counts the launch used, and a refused launch recorded as an error, not raised."""
    import os

    import torch

    from tools import bench_mla

    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("the interpreter run of the sweep (CPU tier)")
    monkeypatch.setattr(bench_mla, "_graph_us", lambda fn, inner, repeats: (fn(), 1.0)[1])
    results = []
    grid = dict(min_split_tokens=(16, 64), block_n=(16, 24))  # 24: not a power of two, refused by the launcher
    bench_mla.bench_decode_sweep([1], [40], 128, grid, float("inf"), results, 1, 1, "split_sweep", device="cpu")
    assert [(r["min_split_tokens"], r["block_n"]) for r in results] == [(16, 16), (16, 24), (64, 16), (64, 24)]
    ok = [r for r in results if r["block_n"] == 16]
    # the launcher's split count comes from the 128-token table width (2 splits of >= 64 tokens), the knob then
    # sets how short a split may be: 40 tokens in two 32-token chunks, or one split of >= 64
    assert all(r["us"] == 1.0 and r["timing"] == "cuda_graph" and r["splits"] == 2 for r in ok)
    assert [r["live_splits"] for r in ok] == [2, 1]
    assert all("block_n must be a power of two" in r["error"] for r in results if r["block_n"] == 24)


def test_absorb_case_times_every_form_over_every_layer(monkeypatch):
    """`--absorb-rows`' bookkeeping on the CPU (Triton interpreted; the graph timer replaced by one call that
    counts the K-up / V-up launches): the three forms, each over every layer's weights, each against the bmm."""
    pytest.importorskip("triton")
    import torch

    from metainfer.kernels import mla_absorb
    from tools import bench_mla

    calls = []
    for name in ("mla_absorb_ref", "mla_value_up_ref", "mla_absorb_triton", "mla_value_up_triton"):
        real = getattr(mla_absorb, name)
        monkeypatch.setattr(mla_absorb, name, lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    monkeypatch.setattr(bench_mla, "_graph_us", lambda fn, inner, repeats: fn() or 270.0)
    monkeypatch.setattr(bench_mla, "ABSORB_LAYERS", 2)
    g = torch.Generator().manual_seed(0)
    kv_b = [torch.randn(bench_mla.HEADS, 256, 512, generator=g) / 512 ** 0.5 for _ in range(2)]
    case = bench_mla._absorb_case(17, kv_b, False, g, repeats=1)
    assert set(case) == {f"{form}_{what}" for form in ("bmm", "mma", "rows") for what in
                         ("us_per_layer", "absorb_rel_err", "value_up_rel_err")}
    assert all(case[f"{form}_us_per_layer"] == 135.0 for form in ("bmm", "mma", "rows"))
    assert all(case[f"{form}_{p}_rel_err"] < 1e-5 for form in ("bmm", "mma", "rows") for p in ("absorb", "value_up"))
    # each form: one K-up and one V-up for its errors, then three timed rounds of K-up + V-up a layer (the refs
    # once more for the errors' yardsticks; the Triton forms never call the refs)
    assert calls.count("mla_absorb_ref") == 1 + 1 + 3 * 2 and calls.count("mla_value_up_ref") == 1 + 1 + 3 * 2
    assert calls.count("mla_absorb_triton") == 2 * (1 + 3 * 2) and calls.count("mla_value_up_triton") == 2 * (1 + 3 * 2)
