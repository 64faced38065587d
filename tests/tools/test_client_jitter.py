"""tools/client_jitter: the paced emitter speaks the completion stream `bench serve` reads, and the tool counts
every chunk (an independent count: streams x tokens) and the emitter's ticks."""

import argparse

import pytest

from tools.client_jitter import ROOT, measure


@pytest.mark.slow  # three interpreters import the package
def test_the_client_reads_every_paced_chunk():
    args = argparse.Namespace(tick_ms=5.0, streams=2, num_prompts=4, output_len=6, repo=ROOT)
    result = measure(args)
    assert result["chunks"] == 4 * 6
    # two waves of 2 streams, 6 ticks each: at least 2 x 6 - 1 tick intervals went by while the client read
    assert result["emitter_tick_p50_ms"] >= 4.0
    assert result["client_itl_p50_ms"] > 0  # (the CPU a chunk is noise at 24 chunks: not checked here)
