"""Tensor parallelism end to end on the CPU (gloo): TP=2 and TP=4 greedy outputs equal TP=1 (and HF)
token for token in fp32, for Qwen3 and Qwen2 (qkv bias), with num_kv_heads < tp (KV heads
replicated) and a vocabulary that no tp divides."""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained, generate_ids
from tests.helpers.processes import alive
from tests.helpers.tiny_models import YARN_ROPE, build_tiny_model, hf_greedy, make_prompts

pytestmark = pytest.mark.tp

VOCAB = 509  # prime: padded on every tp > 1
LENGTHS = [1, 7, 16, 33, 50]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate(folder, prompts, tp=1, **kw):
    """Greedy token ids; for tp > 1 also checks that closing leaves no worker behind."""
    llm = LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=tp, **kw)
    try:
        pids = llm.llm_engine.tp_driver.worker_pids if tp > 1 else []
        assert len(pids) == tp - 1 and all(alive(p) for p in pids)
        got = generate_ids(llm, prompts, GREEDY)
        assert_drained(llm)
    finally:
        llm.close()
    assert not [p for p in pids if alive(p)], "a worker outlived close()"
    return got, llm


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def reference(request, tmp_path_factory):
    """num_attention_heads 4, num_key_value_heads 2: TP=4 replicates each KV head on two ranks."""
    folder = str(tmp_path_factory.mktemp(f"tp-{request.param}"))
    model = build_tiny_model(folder, request.param, vocab_size=VOCAB)
    prompts = make_prompts(LENGTHS, vocab=VOCAB)
    expected, _ = generate(folder, prompts)
    assert expected == hf_greedy(model, prompts, NEW_TOKENS)
    return folder, prompts, expected


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_tp1(reference, tp):
    folder, prompts, expected = reference
    got, llm = generate(folder, prompts, tp=tp)
    assert got == expected


def test_tp_under_preemption_chunking_and_prefix_cache(tmp_path):
    """Tied embeddings, one KV head for two ranks, chunked prefill (steps with no sampled rows),
    preemption, and a prefix-cache hit: all of it must still equal TP=1."""
    folder = str(tmp_path)
    build_tiny_model(folder, "qwen3", vocab_size=VOCAB, num_key_value_heads=1, tie_word_embeddings=True)
    prompts = make_prompts([40, 9, 30, 3], vocab=VOCAB, seed=5)
    prompts.append(prompts[0][:32] + [7, 8])  # shares two full blocks with the first prompt
    kw = dict(block_size=16, num_kv_blocks=10, max_num_batched_tokens=24, kv_reserve_ratio=0.0)
    expected, _ = generate(folder, prompts, **kw)
    threads = torch.get_num_threads()
    got, llm = generate(folder, prompts, tp=2, **kw)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.block_manager.prefix_hit_tokens >= 32
    assert got == expected
    assert torch.get_num_threads() == threads, "rank 0's thread count is restored on close"



@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe"])
def test_moe_families_tp2_equal_tp1(arch, tmp_path):
    """MLA heads split with the latent replicated (DeepSeek-V2), experts split by their intermediate size
    (both), under preemption and chunked prefill: TP=2 equals TP=1 and HF."""
    folder = str(tmp_path)
    model = build_tiny_model(folder, arch, vocab_size=VOCAB)
    prompts = make_prompts(LENGTHS, vocab=VOCAB, seed=3)
    # 7 blocks: with mixed steps the prompts are admitted as the budget allows, and 8 blocks already hold
    # the peak of the four that run together (preemption needs fewer)
    kw = dict(block_size=16, num_kv_blocks=7, max_num_batched_tokens=32, kv_reserve_ratio=0.0)
    expected, _ = generate(folder, prompts, **kw)
    assert expected == hf_greedy(model, prompts, NEW_TOKENS)
    got, llm = generate(folder, prompts, tp=2, **kw)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_deepseek_v2_options_shard_like_tp1(tp, tmp_path):
    """DeepSeek-V2 with every option the plain case leaves out, split over 2 and 4 ranks: q-LoRA (q_a and its norm
    replicated, q_b column-parallel), attention biases, YaRN (the softmax scale's mscale), group-limited routing
    with routed_scaling_factor over 8 experts in 4 groups, 2 shared experts split with the routed ones: TP equals
    TP=1 and HF."""
    folder = str(tmp_path)
    model = build_tiny_model(folder, "deepseek_v2", vocab_size=VOCAB, q_lora_rank=24, attention_bias=True,
                             rope_parameters=dict(YARN_ROPE), topk_method="group_limited_greedy", n_group=4,
                             topk_group=2, routed_scaling_factor=2.5, num_experts_per_tok=3, n_shared_experts=2)
    prompts = make_prompts(LENGTHS, vocab=VOCAB, seed=4)
    expected, _ = generate(folder, prompts)
    assert expected == hf_greedy(model, prompts, NEW_TOKENS)
    got, _ = generate(folder, prompts, tp=tp)
    assert got == expected
