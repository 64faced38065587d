"""tools/server_jitter: a paced real engine behind the real HTTP process; the client's chunk count is checked
against the tokens asked for (streams x tokens: one chunk a token, even where a token ends inside a character),
and the engine's and the server's histograms are read back."""

import argparse

import pytest

from tools.serve_overhead import build_model
from tools.server_jitter import measure


@pytest.mark.slow  # an engine process, a server and a client process
def test_every_token_reaches_the_client(tmp_path):
    build_model(str(tmp_path))
    args = argparse.Namespace(tick_ms=5.0, streams=2, num_prompts=4, input_len=16, output_len=12,
                              max_mixed_prefill_tokens=256, loop="asyncio", http="h11")
    result = measure(args, str(tmp_path))
    assert (result["loop"], result["http"]) == ("asyncio", "h11") and result["http_process_cpu_us_per_token"] > 0
    assert result["client_itl"]["count"] == 4 * (12 - 1)
    assert result["server_itl"]["count"] >= 4 * (12 - 1)  # + the warm-up request's
    assert result["engine_step_interval"]["count"] > 0 and result["engine_step_interval"]["p50_ms"] >= 4.0
