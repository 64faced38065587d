"""The server's pieces without a server: request bodies and their checks (protocol), and the
Prometheus text the metrics render from engine outputs."""

from __future__ import annotations

import json

import pytest

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
    assert _param(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1}) == "echo"
    assert _param(CompletionRequest, {"prompt": "x", "logit_bias": {"1": 2.0}}) == "logit_bias"
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
