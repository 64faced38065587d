"""tools/throughput_floor: parameter counts against the model cards' published figures (an independent
reference), the expected-experts model at its ends, and the step model's bs1 decode against bytes / rate."""

import json
import os

import pytest

from tools.throughput_floor import PROTOCOLS, floor, model_costs, simulate, weight_bytes

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")


def _config(name: str) -> dict:
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name, total_b, active_b, active_counts_embedding", [
    # model cards: Qwen3-8B 8.2B; DeepSeek-V2-Lite 15.7B total, 2.4B activated (the input embedding not
    # counted as activated); Qwen3-30B-A3B 30.5B / 3.3B (counted)
    ("qwen3-8b", 8.2, 8.2, True), ("deepseek-v2-lite", 15.7, 2.4, False), ("qwen3-30b-a3b", 30.5, 3.3, True)])
def test_param_counts_match_the_model_cards(name, total_b, active_b, active_counts_embedding):
    c = _config(name)
    costs = model_costs(c)
    embed = c["vocab_size"] * c["hidden_size"]  # the cards count the input embedding; a step reads one row
    total = costs.dense_params + costs.moe_layers * costs.num_experts * costs.expert_params + embed
    assert total / 1e9 == pytest.approx(total_b, rel=0.03)
    assert (costs.active_params + embed * active_counts_embedding) / 1e9 == pytest.approx(active_b, rel=0.05)


def test_kv_bytes_per_token_follow_the_cache_layouts():
    assert model_costs(_config("qwen3-8b")).kv_bytes_per_token == 36 * 2 * 8 * 128 * 2  # 147,456
    assert model_costs(_config("deepseek-v2-lite")).kv_bytes_per_token == 27 * 576 * 2  # 31,104 (issue 21)
    assert model_costs(_config("deepseek-v2-lite"), kv_elem_bytes=1).kv_bytes_per_token == 27 * 576


def test_experts_touched_at_one_row_and_many():
    costs = model_costs(_config("deepseek-v2-lite"))
    one = weight_bytes(costs, 1)
    assert one == pytest.approx(2 * (costs.dense_params + costs.moe_layers * costs.top_k * costs.expert_params))
    every = 2 * (costs.dense_params + costs.moe_layers * costs.num_experts * costs.expert_params)
    assert weight_bytes(costs, 4096) == pytest.approx(every, rel=1e-6)
    assert one < weight_bytes(costs, 8) < weight_bytes(costs, 64) < every


def test_one_bs1_request_decodes_at_bytes_over_the_rate():
    costs = model_costs(_config("qwen3-8b"))
    bw, flops = 4.3e12, 790e12
    t = simulate(costs, [1], [11], max_num_seqs=1, max_batched_tokens=8192, bw=bw, flops=flops)
    assert t["decode_steps"] == 10 and t["prefill_steps"] == 1
    per_step = costs.dense_params * 2 / bw  # 15.14 GB at 4.3 TB/s; the 2-12 token cache is noise
    assert t["decode_serial"] / 10 == pytest.approx(per_step, rel=1e-3)


def test_protocol_walk_counts_every_output_token_once():
    record = floor(_config("deepseek-v2-lite"), "nano-vllm", 2.0, 4.3e12, 790e12, 8192)
    num_seqs = PROTOCOLS["nano-vllm"][0]
    assert record["decode_steps"] == max_out_minus_one(num_seqs)
    assert record["output_tok_s_overlapped"] >= record["output_tok_s_serial"] > 0


def max_out_minus_one(num_seqs: int) -> int:
    from metainfer.bench.throughput import make_requests

    _, params = make_requests(num_seqs, 100, 1024, 100, 1024)
    return max(sp.max_tokens for sp in params) - 1


def test_microbatched_step_reads_the_weights_twice():
    """One decode step of 512 rows at a 1,500-token context, priced by hand: two halves of 256 rows each read the
    15.14 GB of weights beside the 113 GB of cache (bytes-bound), against serial GEMMs (compute) + cache reads."""
    costs = model_costs(_config("qwen3-8b"))
    bw, flops = 4.3e12, 790e12
    rows, context = 512, 1500
    t = simulate(costs, [context - 1] * rows, [2] * rows, max_num_seqs=rows, max_batched_tokens=1 << 30, bw=bw,
                 flops=flops)
    assert t["decode_steps"] == 1
    weights, cache = costs.dense_params * 2, rows * context * 147_456
    gemm_flops = 2 * costs.active_params * rows
    assert t["decode_serial"] == pytest.approx(gemm_flops / flops + cache / bw, rel=1e-9)
    assert t["decode_microbatched"] == pytest.approx((2 * weights + cache) / bw, rel=1e-9)
    assert t["decode_overlapped"] == pytest.approx((weights + cache) / bw, rel=1e-9)
    # one row cannot be split: the micro-batched floor is the serial one
    one = simulate(costs, [10], [2], max_num_seqs=1, max_batched_tokens=8192, bw=bw, flops=flops)
    assert one["decode_microbatched"] == pytest.approx(one["decode_serial"], rel=1e-12)
