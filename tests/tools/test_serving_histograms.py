"""tools/gpu_suite/serving.histogram_quantiles against the server's own /metrics rendering of known observations."""

from __future__ import annotations

import pytest

from metainfer.entrypoints.openai.engine_core import STATS_FIELDS
from metainfer.entrypoints.openai.metrics import ServerMetrics
from tools.gpu_suite.serving import histogram_quantiles


def test_quantiles_of_rendered_step_intervals():
    m = ServerMetrics()
    stats = [0] * (len(STATS_FIELDS) - 3)  # the fields before step_interval and the two reserve ratios
    # 90 steps of 7 ms, 9 of 13 ms, 1 of 50 ms: buckets (0.006, 0.008], (0.012, 0.015], (0.04, 0.06]
    for seconds in [0.007] * 90 + [0.013] * 9 + [0.05]:
        m.publish_stats((*stats, seconds, 0.0, 0.0))
    m.publish_stats((*stats, 0.0, 0.0, 0.0))  # no interval: not observed
    q = histogram_quantiles(m.render("x"), "metainfer:engine_step_interval_seconds")
    assert q["count"] == 100 and q["mean_ms"] == pytest.approx((0.63 + 0.117 + 0.05) * 10, abs=1e-3)
    assert q["p50_ms"] == pytest.approx(6 + 2 * 50 / 90, abs=1e-3)  # inside (6, 8] ms, linearly
    assert q["p90_ms"] == pytest.approx(8.0, abs=1e-3)  # the 90th observation closes the 8 ms bucket
    assert q["p99_ms"] == pytest.approx(15.0, abs=1e-3)  # the 99th closes (12, 15]


def test_an_empty_histogram_has_no_quantiles():
    q = histogram_quantiles(ServerMetrics().render("x"), "metainfer:engine_step_interval_seconds")
    assert q == {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}


def test_step_costs_bins_a_trace_by_kind():
    """A hand-made trace: [launch, is_prefill, seqs, tokens, decode rows, read back]. A step costs the time from the
    later of its launch and the previous read-back to its own read-back (async scheduling launches n + 1 before
    reading n back). Expected bins worked out by hand."""
    from tools.gpu_suite.serving import compare_steps, step_costs

    trace = [
        [9.0, False, 1, 1, 1, 9.01],        # before the window: left out
        [10.000, True, 4, 2048, 0, 10.100],  # prefill of 2,048 prompt tokens: 100 ms
        [10.001, False, 64, 64, 64, 10.106],  # decode, 64 rows: launched before the prefill was read back: 6 ms
        [10.101, False, 64, 64, 64, 10.114],  # 8 ms
        [10.107, True, 65, 320, 64, 10.125],  # mixed: 256 prompt tokens beside 64 rows: 11 ms
        [10.115, True, 1, 300, 0, None],      # a middle chunk, nothing sampled: its time goes to the next step
        [10.125, False, 57, 57, 57, 11.025],  # decode, 57 rows (bin <=64): 0.9 s, over idle_s: idle
        [11.024, False, 3, 3, 3, 11.030],     # decode, 3 rows (bin <=8): 5 ms
    ]
    out = step_costs(trace, start=10.0, end=11.030)
    assert out["steps"] == 5 and abs(out["idle_s"] - 0.9) < 1e-9
    bins = out["bins"]
    assert set(bins) == {"prefill <=2048", "decode <=64", "mixed <=256", "decode <=8"}
    assert bins["decode <=64"]["steps"] == 2 and abs(bins["decode <=64"]["ms"] - 7.0) < 1e-6
    assert abs(bins["prefill <=2048"]["ms"] - 100.0) < 1e-6 and abs(bins["mixed <=256"]["ms"] - 11.0) < 1e-6
    assert abs(bins["decode <=8"]["ms"] - 5.0) < 1e-6
    assert abs(out["busy_s"] - 0.130) < 1e-9
    offline = {"steps": 2, "busy_s": 0.2, "bins": {"decode <=64": {"steps": 2, "ms": 6.5, "seconds": 0.013}}}
    cmp = compare_steps(out, offline)
    assert abs(cmp["serve_extra_s_at_offline_prices"] - 0.001) < 1e-9  # 2 steps x (7.0 - 6.5) ms
    assert cmp["bins [serve steps, serve ms, offline ms]"]["mixed <=256"] == [1, 11.0, None]
