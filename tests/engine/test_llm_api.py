"""The offline LLM facade: the prompt forms generate accepts, one SamplingParams or one per prompt, outputs
in input order, a params list of the wrong length, and an interrupted generate that leaves nothing queued.
(chat: tests/engine/test_tokenizer.py, whose model has the tokenizer's whole vocabulary.)"""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.tiny_models import build_tiny_model

VOCAB = 509  # "a1b2c3": Qwen's tokenizer gives one id per character here, all below 509


@pytest.fixture(scope="module")
def shared_llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llm-api"))
    build_tiny_model(folder, "qwen3", vocab_size=VOCAB)
    return LLM(folder, device="cpu", dtype="float32", max_model_len=128)


@pytest.fixture
def llm(shared_llm):
    yield shared_llm
    assert_drained(shared_llm)


def _params(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_prompt_forms_and_input_order(llm):
    text_ids = llm.get_tokenizer().encode("a1b2c3")
    assert text_ids and max(text_ids) < VOCAB
    one_text = llm.generate("a1b2c3", _params(3), use_tqdm=False)
    one_ids = llm.generate(text_ids, _params(3), use_tqdm=False)  # a bare id list is one prompt
    one_dict = llm.generate({"prompt_token_ids": text_ids}, _params(3), use_tqdm=False)
    assert len(one_text) == len(one_ids) == len(one_dict) == 1
    assert one_text[0].prompt_token_ids == one_ids[0].prompt_token_ids == text_ids
    assert token_ids(one_text) == token_ids(one_ids) == token_ids(one_dict)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, "a1b2c3", {"prompt_token_ids": [9]}]
    outs = llm.generate(prompts, [_params(8), _params(2), _params(5)], use_tqdm=False)
    # the 2-token request finishes first; the list still follows the input
    assert [len(t) for t in token_ids(outs)] == [8, 2, 5]
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], text_ids, [9]]
    assert len({o.request_id for o in outs}) == 3


def test_one_params_object_serves_every_prompt(llm):
    outs = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], _params(4), use_tqdm=False)
    assert [len(t) for t in token_ids(outs)] == [4, 4]


def test_params_list_of_the_wrong_length_queues_nothing(llm):
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate([[1], [2], [3]], [_params(2), _params(2)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, _params(10), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()  # and the fixture checks every block came back
    again = llm.generate({"prompt_token_ids": [1, 2, 3]}, _params(3), use_tqdm=False)
    assert len(token_ids(again)[0]) == 3


def test_get_metrics_counts_prefix_queries_and_hits_as_the_requests_report_them(llm):
    """LLM.get_metrics (vLLM's offline metrics reader): the prefix-cache counters move by the prompt tokens looked
    up and by the requests' own num_cached_tokens; the token counters by what was computed and generated."""
    def counters():
        return {m.name: m.value for m in llm.get_metrics() if m.kind == "counter"}

    before = counters()
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 and 8 more
    first, second = (llm.generate({"prompt_token_ids": prompt}, _params(3), use_tqdm=False)[0] for _ in range(2))
    after = counters()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    delta = {name: after[name] - before[name] for name in after}
    assert delta["metainfer:prefix_cache_queries_total"] == 80  # both prompts looked up in full
    assert delta["metainfer:prefix_cache_hits_total"] == 32
    assert delta["metainfer:prompt_tokens_total"] == 40 + 8  # the repeat computes its last 8 tokens only
    assert delta["metainfer:generation_tokens_total"] == 6
    gauges = {m.name: m.value for m in llm.get_metrics() if m.kind == "gauge"}
    assert gauges["metainfer:num_requests_running"] == 0 and gauges["metainfer:num_requests_waiting"] == 0
