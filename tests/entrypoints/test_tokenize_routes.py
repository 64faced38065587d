"""POST /tokenize, /detokenize and GET /version (vLLM's routes): the ids equal what the generation endpoints run
(a completion's prompt_token_ids, a chat's usage) and transformers' own tokenizer; bad bodies are 400s naming the
field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import transformers

from metainfer import __version__
from tests.helpers.server import KEY, MODEL

AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _post(server, route: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=headers, timeout=60)


def test_tokenize_a_prompt_equals_transformers_and_the_completion(server, client, hf_tokenizer):
    text = "Hello world, 你好 🙂"
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = hf_tokenizer.encode(text, add_special_tokens=True)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    assert body["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]
    plain = _post(server, "/tokenize", {"prompt": text}).json()
    assert plain["tokens"] == expected and plain["token_strs"] is None  # model optional, strings on request


def test_tokenize_messages_equals_the_chat_endpoints_prompt(server, client, hf_tokenizer):
    kwargs = {"enable_thinking": False}
    r = _post(server, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    expected = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, **kwargs)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert r.json()["tokens"] == list(expected)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"chat_template_kwargs": kwargs})
    assert chat.usage.prompt_tokens == r.json()["count"]
    no_prompt = _post(server, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs,
                                            "add_generation_prompt": False}).json()
    assert no_prompt["count"] < r.json()["count"]


def test_continue_final_message_leaves_the_last_message_open(server, client, hf_tokenizer):
    """vLLM's continue_final_message: the ids end inside the assistant's message (transformers' own rendering), on
    /tokenize and on /v1/chat/completions alike."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    kwargs = {"enable_thinking": False}
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "chat_template_kwargs": kwargs, "return_token_strs": None}
    r = _post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    expected = hf_tokenizer.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                                tokenize=True, **kwargs)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert r.json()["tokens"] == list(expected) and r.json()["token_strs"] is None
    assert hf_tokenizer.decode(expected).endswith("The answer is")
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "chat_template_kwargs": kwargs})
    assert chat.usage.prompt_tokens == len(expected)


def test_detokenize_round_trips(server, hf_tokenizer):
    ids = hf_tokenizer.encode("emoji 🙂 and <think> tags", add_special_tokens=False)
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf_tokenizer.decode(ids)}
    assert r.json()["prompt"] == "emoji 🙂 and <think> tags"
    # the model's padded ids past the tokenizer's (151,669 .. 151,935 for Qwen3) decode to nothing, as in transformers
    padded = _post(server, "/detokenize", {"tokens": [*ids, len(hf_tokenizer) + 3]})
    assert padded.status_code == 200 and padded.json()["prompt"] == hf_tokenizer.decode(ids)


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 7]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_bad_bodies_are_400_naming_the_field(server, client, route, body, param):
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].finish_reason


def test_unknown_model_key_and_content_type(server):
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert _post(server, "/detokenize", {"tokens": [1]}, headers={}).status_code == 401
    r = httpx.post(server.url + "/tokenize", content=b'{"prompt": "x"}', timeout=30,
                   headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415


def test_version_is_open(server):
    r = httpx.get(server.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": __version__}
