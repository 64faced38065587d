"""Async scheduling (step n+1 launched before step n is read back) on the CPU.

Greedy output must equal HF transformers under every scheduling regime, and every sampling
feature must give what the synchronous engine gives for the same requests (seeded sampling,
stops one step late, penalties, logprobs, aborts). Nothing PENDING may leak into outputs or
prefix-cache hashes, and every block comes back.
"""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from metainfer.engine.sequence import PENDING
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.tiny_models import assert_matches_hf, hf_greedy, hf_reference, make_prompts

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 7, 16, 33, 64]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-async"))
    model, prompts, expected = hf_reference(folder, "qwen3", LENGTHS, NEW_TOKENS)
    return folder, prompts, expected, model


def _engine(folder, async_scheduling=True, **kw):
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw)
    assert llm.llm_engine.lookahead == (1 if async_scheduling else 0)
    return llm


@pytest.mark.parametrize("engine_kw", [{}, {"num_kv_blocks": 16, "kv_reserve_ratio": 0.0},  # greedy admission: preempts
                                       {"max_num_batched_tokens": 24}, {"block_size": 1}],
                         ids=["plain", "preempt", "chunked", "block1"])
def test_greedy_matches_hf(reference, engine_kw):
    folder, prompts, expected, model = reference
    llm = _engine(folder, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    got = token_ids(outs)
    assert_matches_hf(model, prompts, got, expected)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if "num_kv_blocks" in engine_kw:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_drained(llm)


def test_prefix_hits_and_arrivals_during_decode(reference):
    folder, prompts, expected, model = reference
    shared = make_prompts([48], seed=7)[0]
    cached = [shared + t for t in make_prompts([3, 9], seed=8)]
    cached_expected = hf_greedy(model, cached, NEW_TOKENS)
    llm = _engine(folder)
    engine, done, steps = llm.llm_engine, {}, 0
    queue = [(f"c{i}", p) for i, p in enumerate(cached)] + [(f"r{i}", p) for i, p in enumerate(prompts)]
    engine.add_request(*queue.pop(0), GREEDY)
    while engine.has_unfinished_requests() or queue:
        if queue and steps % 3 == 2:
            engine.add_request(*queue.pop(0), GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert engine.block_manager.prefix_hit_tokens >= 48
    assert_matches_hf(model, cached + prompts, [done[f"c{i}"] for i in range(2)] +
                      [done[f"r{i}"] for i in range(len(prompts))], cached_expected + expected)
    assert_drained(llm)


def _mixed_params(prompts_text_stop: str, stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[prompts_text_stop]),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=10, ignore_eos=True),
    ]


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def test_sampling_features_equal_sync(reference):
    folder, prompts, expected, _ = reference
    sync = _engine(folder, async_scheduling=False)
    stop_token = expected[2][5]  # greedy reaches it at the 6th token: a stop in mid-decode
    text = sync.get_tokenizer().decode(expected[3][:8])
    stop_string = text[len(text) // 2:][:2] or text[-1:]
    params = _mixed_params(stop_string, stop_token)
    reqs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(params))]
    want = sync.generate(reqs, params, use_tqdm=False)
    got = _engine(folder).generate(reqs, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert want[2].outputs[0].finish_reason == "stop" and len(want[2].outputs[0].token_ids) < 20
    assert want[3].outputs[0].finish_reason == "stop"


def test_penalties_read_back_before_scheduling(reference):
    folder, prompts, _, _ = reference
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    reqs = [{"prompt_token_ids": p} for p in prompts[:2]]
    want = _engine(folder, async_scheduling=False).generate(reqs, params, use_tqdm=False)
    llm = _engine(folder)
    got = llm.generate(reqs, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert_drained(llm)


def test_abort_and_stream_while_in_flight(reference):
    folder, prompts, expected, model = reference
    llm = _engine(folder)
    engine = llm.llm_engine
    engine.add_request("keep", {"prompt_token_ids": prompts[1]}, GREEDY, stream=True)
    engine.add_request("drop", {"prompt_token_ids": prompts[2]}, GREEDY, stream=True)
    seen, steps, final = [], 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PENDING not in out.outputs[0].token_ids
            if out.request_id == "keep":
                seen.append(list(out.outputs[0].token_ids))
                final = out
        steps += 1
        if steps == 4:
            engine.abort_request("drop")
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:])), "streamed token lists must only grow"
    assert final.finished
    assert_matches_hf(model, [prompts[1]], [final.outputs[0].token_ids], [expected[1]])
    assert_drained(llm)


def test_async_with_tensor_parallel_is_rejected(reference):
    folder = reference[0]
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=2, async_scheduling=True)
