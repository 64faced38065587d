"""The OpenAI server's request handling without a server: a body's fields reach SamplingParams as OpenAI and
vLLM define them, chat messages become the template's dicts, the model name is checked, and every error has
OpenAI's body and status. The references are written by hand from the OpenAI API reference."""

from __future__ import annotations

import json

import pytest

from metainfer.engine.request_validation import InvalidRequestError
from metainfer.entrypoints.openai.api_server import default_served_name
from metainfer.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    engine_dead,
    engine_failed,
    from_engine_error,
)
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from metainfer.entrypoints.openai.serving_base import check_model
from metainfer.sampling_params import SamplingParams


def _parse(model, body: dict):
    return parse_request(json.dumps(body).encode(), model)


def test_body_fields_become_sampling_params():
    body = {"prompt": "x", "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3,
            "stop": ["a", "b"], "stop_token_ids": [5], "presence_penalty": 0.25, "frequency_penalty": 0.5,
            "repetition_penalty": 1.25, "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
            "include_stop_str_in_output": True}
    got = _parse(CompletionRequest, body).sampling_params(12, 2)
    assert got == SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3, max_tokens=12,
                                 min_tokens=1, stop=["a", "b"], stop_token_ids=[5], ignore_eos=True, logprobs=2,
                                 presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=1.25,
                                 skip_special_tokens=False, include_stop_str_in_output=True)
    assert _parse(CompletionRequest, {"prompt": "x"}).sampling_params(16, None) == SamplingParams(max_tokens=16)


def test_chat_messages_become_template_dicts():
    req = _parse(ChatCompletionRequest, {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
        {"role": "assistant", "content": None}]})
    assert req.conversation() == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "a\nb", "name": "u"},
                                  {"role": "assistant", "content": ""}]
    assert _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 9}).max_new_tokens == 9


def test_null_is_the_default_where_the_field_has_no_null():
    """vLLM's Optional fields: a null n / stream / echo / include_usage is the default; a null max_tokens stays null
    (no limit), and a required field's null stays an error."""
    req = _parse(CompletionRequest, {"prompt": "x", "n": None, "stream": None, "echo": None, "min_tokens": None,
                                     "max_tokens": None, "stream_options": None})
    assert (req.n, req.stream, req.echo, req.min_tokens, req.max_tokens) == (1, False, False, 0, None)
    req = _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                         "stream_options": {"include_usage": None}, "logprobs": None})
    assert req.stream and not req.include_usage and req.logprobs is False
    with pytest.raises(OpenAIError) as e:
        _parse(CompletionRequest, {"prompt": None})
    assert e.value.param == "prompt"


@pytest.mark.parametrize("field,value", [("guided_choice", ["a", "b"]), ("guided_json", {"type": "object"}),
                                         ("structured_outputs", {"regex": "a+"}), ("bad_words", ["x"]),
                                         ("use_beam_search", True), ("truncate_prompt_tokens", 8),
                                         ("return_tokens_as_token_ids", True), ("functions", [{"name": "f"}])])
def test_vllm_options_this_server_lacks_are_refused_not_ignored(field, value):
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest,
                                                             {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(OpenAIError) as e:
            _parse(model, {**base, field: value})
        assert (e.value.status, e.value.param) == (400, field)
        _parse(model, {**base, field: None})  # unset, as a client that sends nulls means it
    assert not _parse(CompletionRequest, {"prompt": "x", "use_beam_search": False}).stream


@pytest.mark.parametrize("field,value", [("guided_json", {}), ("guided_regex", ""), ("guided_choice", []),
                                         ("guided_grammar", ""), ("structured_outputs", {})])
def test_an_empty_output_constraint_is_refused_too(field, value):
    """An empty constraint still asks for one (vLLM: `{}` is any JSON, `""` a regex only the empty text matches,
    an empty structured_outputs an error): answering without it would silently lack it (README verifier)."""
    with pytest.raises(OpenAIError) as e:
        _parse(CompletionRequest, {"prompt": "x", field: value})
    assert (e.value.status, e.value.param) == (400, field)
    for harmless in ({"bad_words": []}, {"functions": []}, {"logits_processors": []}):  # ask for nothing
        _parse(CompletionRequest, {"prompt": "x", **harmless})


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (CompletionRequest, {"prompt": "x", "best_of": 0}, "best_of"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stream": False,
                             "stream_options": {"include_usage": True}}, "stream_options")])
def test_options_checked_before_the_engine(model, body, param):
    with pytest.raises(OpenAIError) as e:
        _parse(model, body).check_supported()
    assert (e.value.status, e.value.param) == (400, param)
    assert "best_of must be >= 1" in e.value.message if param == "best_of" else True


@pytest.mark.parametrize("model,body", [
    (CompletionRequest, {"prompt": "x", "response_format": {"type": "text"}}),
    (CompletionRequest, {"prompt": "x", "stream_options": {}}),  # vLLM: an empty object passes without stream
    (CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "echo": False, "tool_choice": "none"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
                             "function_call": "auto"})])
def test_the_same_options_at_values_this_server_serves_pass(model, body):
    _parse(model, body).check_supported()


def test_a_non_text_content_part_is_refused_by_its_type():
    with pytest.raises(OpenAIError) as e:
        _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert (e.value.status, e.value.param) == (400, "messages") and "image_url" in e.value.message


UNION = "expected str | list[str] | list[int] | list[list[int]]"


@pytest.mark.parametrize("model, body, param, message", [
    (CompletionRequest, {"prompt": None}, "prompt", f"field 'prompt': {UNION}, got null"),
    (CompletionRequest, {"prompt": {"text": "x"}}, "prompt", f"field 'prompt': {UNION}, got an object"),
    (CompletionRequest, {"prompt": [1, "a"]}, "prompt",
     f"field 'prompt': {UNION}, got an array (prompt[1] as list[int]: Input should be a valid integer)"),
    (CompletionRequest, {"prompt": "x", "stop": 5}, "stop", "field 'stop': expected str | list[str], got a number"),
    (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop",
     "field 'stop': expected str | list[str], got an array (stop[0] as list[str]: Input should be a valid string)"),
    # not unions: a mapping with two bad values, a plain field; each keeps pydantic's own message at its path
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": "x", "2": "x"}}, "logit_bias",
     "field 'logit_bias.1': Input should be a valid number"),
    (CompletionRequest, {"prompt": "x", "n": "a"}, "n", "field 'n': Input should be a valid integer"),
])
def test_a_value_of_no_type_a_union_field_takes_names_the_field_and_its_types(model, body, param, message):
    """Not the first union member's complaint ("field 'prompt.str': Input should be a valid string")."""
    with pytest.raises(OpenAIError) as e:
        _parse(model, body)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


def test_a_validation_error_without_errors_is_a_plain_400():
    from pydantic import ValidationError

    from metainfer.entrypoints.openai.errors import from_validation_error

    err = from_validation_error(ValidationError.from_exception_data("X", []), CompletionRequest)
    assert err.status == 400 and err.param is None


def test_model_names():
    assert check_model(["m1", "m2"], None) == "m1" and check_model(["m1", "m2"], "m2") == "m2"
    with pytest.raises(OpenAIError) as e:
        check_model(["m1"], "other")
    assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")
    assert default_served_name("/models/Qwen3-8B/") == "Qwen3-8B"
    assert default_served_name("/gguf/SmolLM2-135M.Q8_0.gguf") == "SmolLM2-135M.Q8_0"


def test_errors_have_openai_bodies_and_statuses():
    err = bad_request("temperature must be >= 0", "temperature")
    assert err.status == 400 and err.body() == {"error": {
        "message": "temperature must be >= 0", "type": "invalid_request_error", "param": "temperature", "code": None}}
    assert (engine_dead().status, engine_dead().code, engine_dead().type) == (503, "engine_dead", "server_error")
    failed = engine_failed(RuntimeError("boom"))
    assert (failed.status, failed.message, failed.code) == (500, "boom", "engine_error")
    mapped = from_engine_error(InvalidRequestError("top_p", "top_p must be in (0, 1], got 2.0"))
    assert (mapped.status, mapped.param, mapped.type) == (400, "top_p", "invalid_request_error")
    internal = from_engine_error(RuntimeError("bug"))
    assert (internal.status, internal.code) == (500, "internal_error")


def test_metrics_text_is_prometheus_lines():
    text = ServerMetrics().render("m")
    assert text.endswith("\n") and not text.endswith("\n\n")  # the exposition format ends every line
    assert all(line.startswith("# ") or line.startswith("metainfer:") for line in text.splitlines())


def test_chat_template_ids_are_the_rendered_text_encoded():
    """The server's chat prompt ids (serving_chat.apply_chat_template) equal the template rendered to text by
    transformers and then encoded without added special tokens (the Qwen3 tokenizer and template)."""
    from transformers import AutoTokenizer

    from metainfer.entrypoints.openai.serving_chat import apply_chat_template
    from tests.helpers.tiny_models import qwen_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi twice."}]
    for add in (True, False):
        text = tok.apply_chat_template(conversation, add_generation_prompt=add, tokenize=False)
        assert apply_chat_template(tok, conversation, None, add) == tok.encode(text, add_special_tokens=False)
