"""tools/schedule_sim: the engine's scheduler on a protocol with no model. At a pool that greedy admission
oversubscribes, the KV reserve finishes every request without a preemption or a recomputed token while ratio 0
preempts and recomputes; with the engine's threshold (below 192 running sequences the reserve only while the
running requests' remaining lengths are spread) it never runs slower than greedy admission where the reserve from
the first sequence did (pools far below the demand, requests that end together), and keeps the reserve's win where
lengths are spread (the nano-vllm protocol) for a dense model, while an MoE model admits greedily; at an unbounded
pool the priced schedule agrees with tools/throughput_floor's own idealised scheduler (an independent
walk of the same requests)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tools.schedule_sim import simulate
from tools.throughput_floor import floor

CONFIG = json.loads((pathlib.Path(__file__).parents[2] / "benchmarks/configs/qwen3-8b.json").read_text())


@pytest.fixture(scope="module")
def tight():
    # the reserve from the first running sequence (the engine's threshold is below the protocol's rows here)
    return {ratio: simulate(CONFIG, "nano-vllm", 6000, ratio, kv_reserve_min_running=1) for ratio in (None, 0.0)}


def test_the_reserve_finishes_everything_without_preemption(tight):
    auto, greedy = tight[None], tight[0.0]
    assert auto["preemptions"] == 0 and auto["recomputed_tokens"] == 0
    assert greedy["preemptions"] > 0 and greedy["recomputed_tokens"] > 0
    assert auto["output_tokens"] == greedy["output_tokens"]  # every request ran to its max_tokens either way
    assert auto["final_ratio"] == 1.0  # ignore_eos: every finished request used all it was allowed


def test_an_unbounded_pool_prices_like_the_floor():
    sim = simulate(CONFIG, "nano-vllm", 10**6, None, max_num_seqs=256)
    ideal = floor(CONFIG, "nano-vllm", 2.0, 4.3e12, 790e12, 8192)
    assert sim["preemptions"] == 0
    assert sim["output_tokens"] == ideal["output_tokens"]
    assert sim["seconds"] == pytest.approx(ideal["prefill"] + ideal["decode_serial"], rel=0.05)


def test_decode_bins_cover_every_decode_step(tight):
    for rule in tight.values():
        bins = rule["decode_bins"]
        assert sum(b["steps"] for b in bins.values()) == rule["decode_steps"]
        assert sum(b["seqs"] for b in bins.values()) <= rule["decode_rows"]  # the rest: mixed steps' decode rows
        assert sum(b["seconds"] for b in bins.values()) == pytest.approx(rule["decode_s"], abs=1e-2)


@pytest.mark.parametrize("protocol, blocks, kw", [
    ("1000x1000", 4096, {}),  # Qwen3-8B at a pool of 4,096 blocks: 32 sequences at their full 2,000 tokens
    ("1000x1000", 6192, {"max_num_seqs": 128, "num_prompts": 250}),
])
def test_below_the_threshold_admission_is_greedy_and_no_slower(protocol, blocks, kw):
    first = simulate(CONFIG, protocol, blocks, None, kv_reserve_min_running=1, **kw)
    default = simulate(CONFIG, protocol, blocks, None, **kw)
    greedy = simulate(CONFIG, protocol, blocks, 0.0, **kw)
    assert first["output_tok_s"] < 0.95 * greedy["output_tok_s"]  # what the threshold is for
    assert default["output_tok_s"] >= 0.999 * greedy["output_tok_s"]


def test_spread_lengths_keep_the_reserve_below_the_threshold_for_a_dense_model():
    # nano-vllm at 6,192 blocks: at most ~75 rows, below the threshold, with outputs spread over 100-1,024 tokens;
    # greedy admission preempts 139 times there, the reserve from the first sequence none
    default = simulate(CONFIG, "nano-vllm", 6192, None)
    greedy = simulate(CONFIG, "nano-vllm", 6192, 0.0)
    assert greedy["preemptions"] > 100 and default["preemptions"] == 0
    assert default["output_tok_s"] > 1.05 * greedy["output_tok_s"]
    # Qwen3-30B-A3B's step reads every expert, so greedy admission (its recompute cheap) is kept below 192 rows:
    # the same pool's schedule as greedy admission's
    moe = json.loads((pathlib.Path(__file__).parents[2] / "benchmarks/configs/qwen3-30b-a3b.json").read_text())
    moe_default, moe_greedy = simulate(moe, "nano-vllm", 6192, None), simulate(moe, "nano-vllm", 6192, 0.0)
    assert moe_default["preemptions"] == moe_greedy["preemptions"] > 100
    assert moe_default["output_tok_s"] == moe_greedy["output_tok_s"]


def test_above_the_threshold_the_reserve_removes_the_preemptions_and_wins():
    # the 1,000 x 1,000 protocol at the H100's bf16 pool: 512 sequences, 24,770 blocks (~198 at their full length)
    default = simulate(CONFIG, "1000x1000", 24770, None)
    greedy = simulate(CONFIG, "1000x1000", 24770, 0.0)
    assert default["preemptions"] < greedy["preemptions"] // 10
    assert default["output_tok_s"] > 1.03 * greedy["output_tok_s"]
