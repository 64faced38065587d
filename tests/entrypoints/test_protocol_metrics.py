"""The server's pieces without a server: request bodies and their checks (protocol), the
Prometheus text the metrics render from engine outputs, and the engine's stats they are rendered from."""

from __future__ import annotations

import json

import pytest

from metainfer import LLM
from metainfer.engine.kv_reserve import INITIAL_RATIO
from metainfer.entrypoints.openai.engine_core import STATS_FIELDS, EngineCore
from metainfer.entrypoints.openai.engine_loop import RequestState
from metainfer.entrypoints.openai.errors import OpenAIError
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request, usage
from metainfer.outputs import CompletionOutput, RequestOutput
from metainfer.sampling_params import SamplingParams


def _parse(model, body: dict):
    return parse_request(json.dumps(body).encode(), model)


def _param(model, body: dict) -> str | None:
    with pytest.raises(OpenAIError) as e:
        req = _parse(model, body)
        req.check_supported()
        req.sampling_params(16, None)
    assert e.value.status == 400
    return e.value.param


def test_prompt_forms():
    assert _parse(CompletionRequest, {"prompt": "hi"}).prompts() == ["hi"]
    assert _parse(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert _parse(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert _parse(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]


def test_checks_name_the_field():
    assert _param(CompletionRequest, {"prompt": "x", "max_tokens": "ten"}) == "max_tokens"  # strict types
    assert _param(CompletionRequest, {"prompt": []}) == "prompt"
    assert _param(CompletionRequest, {"prompt": "x", "suffix": "y"}) == "suffix"
    assert _param(CompletionRequest, {"prompt": "x", "best_of": 3}) == "best_of"
    assert _param(CompletionRequest, {"prompt": "x", "logprobs": 21}) == "logprobs"
    for bias in ({"one": 2.0}, {"-1": 2.0}, {"1": float("nan")}):  # token ids as strings, values numbers
        assert _param(CompletionRequest, {"prompt": "x", "logit_bias": bias}) == "logit_bias"
    # values beyond OpenAI's [-100, 100] are clamped, as vLLM's server does (the Python API refuses them)
    assert _parse(CompletionRequest, {"prompt": "x", "logit_bias": {"1": 101.0, "2": -1e9, "3": float("inf")}}
                  ).sampling_params(16, None).logit_bias == {1: 100.0, 2: -100.0, 3: 100.0}
    assert _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"4": 250.0}}
                  ).sampling_params(16, None).logit_bias == {4: 100.0}
    assert _param(CompletionRequest, {"prompt": "x", "allowed_token_ids": []}) == "allowed_token_ids"
    assert _parse(CompletionRequest, {"prompt": "x", "logit_bias": {"7": -100, "3": 2.5}}).sampling_params(
        16, None).logit_bias == {7: -100, 3: 2.5}
    assert _param(CompletionRequest, {"prompt": "x", "temperature": -1}) == "temperature"  # SamplingParams
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert _param(ChatCompletionRequest, {**chat, "tools": [{"type": "function"}]}) == "tools"
    assert _param(ChatCompletionRequest, {**chat, "response_format": {"type": "json_object"}}) == "response_format"
    assert _param(ChatCompletionRequest, {**chat, "top_logprobs": 2}) == "top_logprobs"
    assert _param(ChatCompletionRequest, {**chat, "chat_template_kwargs": {"tokenize": 1}}) == "chat_template_kwargs"
    req = _parse(ChatCompletionRequest, {**chat, "max_tokens": 3, "max_completion_tokens": 5,
                                         "stream": True, "stream_options": {"include_usage": True}})
    assert req.max_new_tokens == 5 and req.include_usage


def test_metrics_render_from_outputs():
    def out(rid, n, finish=None):
        return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "", list(range(n)), finish_reason=finish)],
                             finish is not None)

    m = ServerMetrics()
    state = RequestState("a", None, [1, 2, 3], SamplingParams(max_tokens=3), None, arrival=0.0)
    m.observe(state, 1, False, None, False, now=0.02)  # first token: TTFT 0.02 (as EngineLoop._on_step calls it)
    m.observe(state, 3, True, "length", False, now=0.06)  # two more: ITL 0.02 each, then the end
    text = m.render('my "model"')
    label = 'model_name="my \\"model\\""'
    assert f'metainfer:time_to_first_token_seconds_bucket{{{label},le="0.025"}} 1' in text
    assert f'metainfer:inter_token_latency_seconds_count{{{label}}} 2' in text
    assert f'metainfer:e2e_request_latency_seconds_bucket{{{label},le="+Inf"}} 1' in text
    assert f'metainfer:request_success_total{{{label},finished_reason="length"}} 1' in text
    assert f'metainfer:request_success_total{{{label},finished_reason="stop"}} 0' in text
    assert usage({"a": out("a", 3, "length")}) == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_metrics_render_the_kv_reserve_ratios():
    m = ServerMetrics()
    m.publish_stats((0,) * len(STATS_FIELDS[:-2]) + (0.375, 0.7))
    text = m.render("m")
    assert 'metainfer:kv_reserve_ratio{model_name="m",requests="bounded"} 0.375' in text
    assert 'metainfer:kv_reserve_ratio{model_name="m",requests="open"} 0.7' in text


def test_engine_stats_carry_the_ratios_learned_from_finished_requests(model_dir):
    """Two requests of 8 allowed tokens: one runs to its length, the other stops on its third token. The bounded
    ratio is what they generated over what they were allowed (11 / 16, counted from their outputs); no request
    without max_tokens finished, so the open one is its initial 0.7; `LLM.get_metrics` reports the same; greedy
    admission reports 0 for both."""
    prompt = list(range(5, 25))
    llm = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
        stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[full.token_ids[2]])
        cut = llm.generate([prompt], stop)[0].outputs[0]
        generated = len(full.token_ids) + len(cut.token_ids)
        assert len(cut.token_ids) < 8
        stats = dict(zip(STATS_FIELDS, EngineCore(llm.llm_engine, None, None).stats(0)))
        assert stats["kv_reserve_ratio_bounded"] == pytest.approx(generated / 16)
        assert stats["kv_reserve_ratio_open"] == pytest.approx(INITIAL_RATIO[False])
        offline = {m.labels["requests"]: m.value for m in llm.get_metrics() if m.name == "metainfer:kv_reserve_ratio"}
        assert offline == {"bounded": stats["kv_reserve_ratio_bounded"], "open": stats["kv_reserve_ratio_open"]}
    finally:
        llm.close()
    greedy = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=64, kv_reserve_ratio=0.0)
    try:
        stats = dict(zip(STATS_FIELDS, EngineCore(greedy.llm_engine, None, None).stats(0)))
        assert (stats["kv_reserve_ratio_bounded"], stats["kv_reserve_ratio_open"]) == (0.0, 0.0)
    finally:
        greedy.close()
