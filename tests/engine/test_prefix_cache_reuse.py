"""Prefix caching keeps every full block a request computed, its last step's too (issue 23, item 1).

A request with max_tokens=1 registers its prompt blocks, so the same prompt again hits every full block; a
chat's second turn (turn 1's prompt + reply + a new message) recomputes at most one block of history. Hits are
reported as `RequestOutput.num_cached_tokens`; greedy output equals HF's and the uncached engine's.
"""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained
from tests.helpers.tiny_models import assert_matches_hf, hf_greedy, hf_reference, make_prompts

BLOCK = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-prefix"))
    model, _, _ = hf_reference(folder, "qwen3", [], 1)
    return folder, model


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(llm, prompt, n):
    return llm.generate({"prompt_token_ids": prompt}, _greedy(n), use_tqdm=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_max_tokens_1_registers_the_prompt_so_the_same_prompt_hits_every_full_block(reference, async_scheduling):
    folder, model = reference
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=async_scheduling)
    # 2 full blocks + 8 tokens; exactly 3 blocks (the block holding the last token, whose logits start the
    # output, is computed afresh: 2 blocks hit)
    for length in (40, 48):
        prompt = make_prompts([length], seed=length)[0]
        first = _run(llm, prompt, 1)
        assert first.num_cached_tokens == 0
        again = _run(llm, prompt, 6)
        assert again.num_cached_tokens == (length - 1) // BLOCK * BLOCK
        assert again.metrics["num_cached_tokens"] == again.num_cached_tokens
        assert_matches_hf(model, [prompt], [again.outputs[0].token_ids], hf_greedy(model, [prompt], 6))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids[:1]
    assert_drained(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_second_chat_turn_recomputes_at_most_one_block_of_history(reference, async_scheduling):
    folder, model = reference
    cached = LLM(folder, device="cpu", dtype="float32", async_scheduling=async_scheduling)
    plain = LLM(folder, device="cpu", dtype="float32", enable_prefix_caching=False)
    history = make_prompts([37], seed=3)[0]
    # turns 1 and 2 end with a step that fills a block (37 + 12 - 1 = 48, 49 + 11 + 5 - 1 = 64): the blocks a
    # reply's final step fills must survive its finish
    for turn, (user_len, reply_len) in enumerate([(0, 12), (11, 5), (5, 30)]):
        prompt = history + make_prompts([user_len], seed=10 + turn)[0] if user_len else history
        out = _run(cached, prompt, reply_len)
        reference_ids = _run(plain, prompt, reply_len).outputs[0].token_ids
        assert out.outputs[0].token_ids == reference_ids, "prefix caching changed greedy output"
        if turn:
            # every full block of the previous turn's prompt + reply but the reply's last token (sampled, never
            # fed) is cached: at most one block of history is recomputed
            assert len(history) - out.num_cached_tokens <= BLOCK, (len(history), out.num_cached_tokens)
            assert out.num_cached_tokens == (len(history) - 1) // BLOCK * BLOCK
        history = prompt + out.outputs[0].token_ids
    assert_drained(cached)


def test_an_aborted_request_registers_what_it_computed(reference):
    folder, _ = reference
    llm = LLM(folder, device="cpu", dtype="float32")
    engine = llm.llm_engine
    prompt = make_prompts([50], seed=5)[0]
    engine.add_request("a", {"prompt_token_ids": prompt}, _greedy(20))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    out = _run(llm, prompt, 2)
    assert out.num_cached_tokens == 48



@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_samples_of_one_request_prefill_their_prompt_once(reference, async_scheduling):
    """n=4 on a 70-token prompt: the first sample computes it, the other three wait for its 4 full blocks to
    be registered and hit them (70 + 3 x 6 prompt tokens computed instead of 4 x 70); greedy, every sample is
    HF's tokens. With prefix caching off each sample computes the whole prompt and nothing waits."""
    folder, model = reference
    prompt = make_prompts([70], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=4)
    expected = hf_greedy(model, [prompt], 5)
    for caching in (True, False):
        llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=async_scheduling,
                  enable_prefix_caching=caching)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == expected * 4
        bm = llm.llm_engine.block_manager
        assert bm.prefix_hit_tokens == (3 * (70 - 1) // BLOCK * BLOCK if caching else 0)
        assert_drained(llm)
