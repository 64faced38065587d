"""tools/gpu_suite/serving.histogram_quantiles against the server's own /metrics rendering of known observations."""

from __future__ import annotations

import pytest

from metainfer.entrypoints.openai.metrics import ServerMetrics
from tools.gpu_suite.serving import histogram_quantiles


def test_quantiles_of_rendered_step_intervals():
    m = ServerMetrics()
    stats = [0] * 13
    # 90 steps of 7 ms, 9 of 13 ms, 1 of 50 ms: buckets (0.006, 0.008], (0.012, 0.015], (0.04, 0.06]
    for seconds in [0.007] * 90 + [0.013] * 9 + [0.05]:
        m.publish_stats((*stats[:12], seconds, 0.0, 0.0))
    m.publish_stats((*stats[:12], 0.0, 0.0, 0.0))  # no interval: not observed
    q = histogram_quantiles(m.render("x"), "metainfer:engine_step_interval_seconds")
    assert q["count"] == 100 and q["mean_ms"] == pytest.approx((0.63 + 0.117 + 0.05) * 10, abs=1e-3)
    assert q["p50_ms"] == pytest.approx(6 + 2 * 50 / 90, abs=1e-3)  # inside (6, 8] ms, linearly
    assert q["p90_ms"] == pytest.approx(8.0, abs=1e-3)  # the 90th observation closes the 8 ms bucket
    assert q["p99_ms"] == pytest.approx(15.0, abs=1e-3)  # the 99th closes (12, 15]


def test_an_empty_histogram_has_no_quantiles():
    q = histogram_quantiles(ServerMetrics().render("x"), "metainfer:engine_step_interval_seconds")
    assert q == {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}
