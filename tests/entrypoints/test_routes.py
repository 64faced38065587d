"""GET /health, /v1/models and /metrics of the OpenAI server."""

from __future__ import annotations

import httpx

from tests.helpers.server import MODEL


def test_health_models_metrics(server, client):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_count",
                 "num_requests_running_max", "kv_reserve_ratio"):
        assert f"metainfer:{name}" in r.text, name
