"""End-to-end greedy parity with HF transformers (fp32, CPU) under every scheduling regime.

Every architecture variant runs the plain batch in the fast tier; the scheduling regimes (block sizes,
preemption, chunked prefill, prefix hits, arrivals during decode) run on the first variant there and on
all of them in the full suite (the others are marked slow)."""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.tiny_models import (
    LLAMA3_ROPE,
    assert_engine_matches_hf,
    assert_matches_hf,
    hf_greedy,
    hf_reference,
    make_prompts,
)

LENGTHS = [1, 7, 16, 33, 64, 100]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


VARIANTS = ["qwen3-untied", "qwen3-tied", "qwen2-bias", "llama", "llama-llama3rope"]
EVERY_VARIANT = pytest.mark.parametrize("reference", VARIANTS, indirect=True)
FIRST_VARIANT_FAST = pytest.mark.parametrize(
    "reference", VARIANTS[:1] + [pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS[1:]], indirect=True)


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    arch, _, variant = request.param.partition("-")
    folder = str(tmp_path_factory.mktemp(request.param))
    extra = {"rope_parameters": dict(LLAMA3_ROPE)} if variant == "llama3rope" else {}
    model, prompts, expected = hf_reference(folder, arch, LENGTHS, NEW_TOKENS, tie_word_embeddings=(variant == "tied"),
                                            **extra)
    return folder, prompts, expected, model


@EVERY_VARIANT
def test_batch_matches_hf(reference):
    assert_engine_matches_hf(reference, GREEDY)


@FIRST_VARIANT_FAST
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(reference, block_size):
    assert_engine_matches_hf(reference, GREEDY, block_size=block_size)


@FIRST_VARIANT_FAST
def test_preemption_keeps_outputs(reference):
    # 20 blocks of 16 = 320 tokens for 6 sequences needing 221 + 192 tokens: must preempt.
    llm = assert_engine_matches_hf(reference, GREEDY, num_kv_blocks=20, block_size=16, kv_reserve_ratio=0.0)
    assert llm.llm_engine.scheduler.num_preemptions > 0


@FIRST_VARIANT_FAST
def test_kv_reserve_admits_what_can_finish(reference):
    # the same pool with the default admission (the KV reserve, 1.0 until a request finishes): the prompts
    # wait until the running ones can finish beside them (29 blocks at the end against 20), none is preempted
    llm = assert_engine_matches_hf(reference, GREEDY, num_kv_blocks=20, block_size=16, kv_reserve_min_running=1)
    assert llm.llm_engine.scheduler.num_preemptions == 0


@FIRST_VARIANT_FAST
def test_chunked_prefill_keeps_outputs(reference):
    assert_engine_matches_hf(reference, GREEDY, max_num_batched_tokens=24)


@FIRST_VARIANT_FAST
def test_prefix_cache_hits(reference, tmp_path):
    folder, prompts, _, model = reference
    shared = make_prompts([80], seed=7)[0]
    tails = make_prompts([3, 9, 20], seed=8)
    cached_prompts = [shared + t for t in tails]
    expected = hf_greedy(model, cached_prompts, NEW_TOKENS)
    llm = LLM(folder, device="cpu", dtype="float32")
    first = llm.generate({"prompt_token_ids": cached_prompts[0]}, GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in cached_prompts[1:]], GREEDY, use_tqdm=False)
    assert llm.llm_engine.block_manager.prefix_hit_tokens >= 2 * 80 // 16 * 16
    assert all(o.metrics["num_cached_tokens"] >= 64 for o in rest)
    assert_matches_hf(model, cached_prompts, token_ids(first + rest), expected)
    # a prompt fully cached still recomputes one token and gives the same answer
    again = llm.generate({"prompt_token_ids": cached_prompts[0]}, GREEDY, use_tqdm=False)
    assert_matches_hf(model, cached_prompts[:1], [again[0].outputs[0].token_ids], expected[:1])


@FIRST_VARIANT_FAST
def test_requests_arriving_during_decode(reference):
    folder, prompts, expected, model = reference
    llm = LLM(folder, device="cpu", dtype="float32")
    engine = llm.llm_engine
    done = {}
    engine.add_request("r0", {"prompt_token_ids": prompts[0]}, GREEDY)
    engine.add_request("r1", {"prompt_token_ids": prompts[1]}, GREEDY)
    pending = list(enumerate(prompts))[2:]
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 5 == 4:  # add a request every few decode steps
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert_matches_hf(model, prompts, [done[f"r{i}"] for i in range(len(prompts))], expected)
    assert_drained(llm)
