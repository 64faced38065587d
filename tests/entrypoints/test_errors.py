"""OpenAI error bodies: bad bodies and values (400), unknown model (404), auth (401), unknown route,
a failing engine step (500 / an SSE error event), the queue cap (503); the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.server import MODEL, assert_error, auth, metrics, post, wait_idle
from tests.helpers.tiny_models import make_prompts


def test_logit_bias_refusal_shows_the_values_as_sent(server, client, model_dir):
    """A logit_bias the server refuses (an id outside the model's vocabulary, NaN) is a one-line 400 naming
    logit_bias and showing the client's own entries: not the values clamped to [-100, 100] the engine would run
    with, not the entries that were fine."""
    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
        for bias, shown, hidden in (({"-1": 200}, '{"-1": 200', "100"),
                                    ({str(vocab): -250, "5": 1.5}, f'{{"{vocab}": -250', '"5"'),
                                    ({"12": 3, str(vocab + 7): 1e9}, f'{{"{vocab + 7}": 1000000000', '"12"')):
            err = assert_error(post(server, path, {**extra, "max_tokens": 2, "logit_bias": bias}), 400, "logit_bias")
            assert shown in err["message"] and hidden not in err["message"], err
            assert f"[0, {vocab})" in err["message"] and "\n" not in err["message"], err
        raw = json.dumps({**extra, "max_tokens": 2}).encode()[:-1] + b', "logit_bias": {"3": 250, "7": NaN}}'
        err = assert_error(post(server, path, raw), 400, "logit_bias")
        assert err["message"].endswith('got {"7": NaN}') and "[-100, 100]" in err["message"], err
    with pytest.raises(openai.BadRequestError, match='"-1": 200'):  # the official client shows it too
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"-1": 200})
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"5": 200}).usage  # clamped
    wait_idle(server)


def test_chat_whole_vocabulary_refusal_names_top_logprobs(server):
    """Chat's top_logprobs=-1 (the whole vocabulary) under the engine's default cap of 20: a 400 whose param and
    message both name the body's field, top_logprobs (the engine calls it logprobs)."""
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                              "max_tokens": 2, "logprobs": True, "top_logprobs": -1}),
                       400, "top_logprobs")
    assert err["message"].startswith("top_logprobs=-1 requests the whole vocabulary"), err
    wait_idle(server)


def test_bad_requests_get_openai_errors(server, client):
    assert_error(post(server, "/v1/completions", b'{"prompt": "x", '), 400)
    assert_error(post(server, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(server, "/v1/completions", b""), 400)
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": "ten"}), 400, "max_tokens")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "temperature": "0.5"}), 400, "temperature")
    assert_error(post(server, "/v1/completions", {"prompt": 5}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "stream": True, "stream_options": 1}), 400,
                  "stream_options")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "stop": [1]}), 400, "stop")
    assert_error(post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": -1}), 400, "max_tokens")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "temperature": -1}), 400, "temperature")
    assert_error(post(server, "/v1/completions", {"prompt": [10**9]}), 400, "prompt")
    assert_error(post(server, "/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}}),
                  400, "chat_template_kwargs")
    # the same through the official client
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
    assert e.value.status_code == 400
    too_long = make_prompts([600], vocab=512, seed=5)[0]  # max_model_len is 512
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 600}], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert_error(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model", "model_not_found")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, headers={}), 401, code="invalid_api_key")
    assert_error(httpx.get(server.url + "/v1/models", timeout=10), 401)
    assert_error(httpx.get(server.url + "/v1/nothing-here", headers=auth(), timeout=10), 404)
    # still serving, nothing leaked
    r = client.completions.create(model=MODEL, prompt="still alive", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    wait_idle(server)


def test_engine_step_failure_is_contained(server, client):
    """A step that raises fails only the requests in flight (500 / an SSE error event)."""
    engine, m0 = server.state.engine, metrics(server)
    real_step, fail = engine.step, {"next": True}

    def flaky_step():
        if fail["next"]:
            fail["next"] = False
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = flaky_step
    try:
        assert_error(post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 4}), 500, code="engine_error")
        fail["next"] = True
        r = post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 4, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_error"
    finally:
        del engine.step
    assert client.completions.create(model=MODEL, prompt="fine again", max_tokens=3).usage.completion_tokens == 3
    m = wait_idle(server)
    assert m["metainfer:engine_errors_total"] - m0["metainfer:engine_errors_total"] == 2
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200  # load balancers probe with HEAD


def test_queue_cap_answers_503(server, client):
    state = server.state
    try:
        state.engine_loop.max_queued_requests = 0
        err = assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}), 503, code="queue_full")
        assert err["type"] == "server_error"
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        state.engine_loop.max_queued_requests = 1  # one at a time is fine: the slot is released after the first token
        for _ in range(3):
            assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        state.engine_loop.max_queued_requests = None
    wait_idle(server)
