"""Issue 24 over HTTP: poisoned values answer 400 naming the field while concurrent well-formed requests
finish with exactly their outputs alone; a step that fails on one request's data fails only that request;
only application/json bodies; the API docs behind the key (or off); the served model id is a name, not a path."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from metainfer import LLM
from metainfer.entrypoints.openai.api_server import build_app
from tests.helpers.server import (
    MODEL,
    ServerThread,
    assert_error,
    auth,
    greedy,
    metrics,
    post,
    serving,
    wait_idle,
)
from tests.helpers.tiny_models import make_prompts

MARK = 999  # a prompt holding this token fails its steps (fault hook): a request whose data breaks a step

POISONED = [  # (path, raw body, the field the 400 names): the list and their neighbours
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"min_tokens":2,"stop_token_ids":[1000000000]}',
     "stop_token_ids"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"min_tokens":2,"stop_token_ids":[-1000000000]}',
     "stop_token_ids"),
    ("/v1/completions", f'{{"prompt":"x","max_tokens":4,"stop_token_ids":[{2**63}]}}', "stop_token_ids"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"top_k":9223372036854775808}', "top_k"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"temperature":NaN}', "temperature"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"top_p":Infinity}', "top_p"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"temperature":1e999}', "temperature"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"repetition_penalty":NaN}', "repetition_penalty"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"presence_penalty":-Infinity}', "presence_penalty"),
    ("/v1/completions", f'{{"prompt":"x","max_tokens":4,"seed":{2**64}}}', "seed"),
    ("/v1/completions", '{"prompt":"x","max_tokens":1,"n":20000}', "n"),
    ("/v1/completions", f'{{"prompt":"x","max_tokens":{10**30}}}', "max_tokens"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"logprobs":1000000}', "logprobs"),
    ("/v1/completions", f'{{"prompt":[{2**63}],"max_tokens":4}}', "prompt"),
    ("/v1/completions", f'{{"prompt":"x","max_tokens":4,"min_tokens":{2**64}}}', "min_tokens"),
    ("/v1/chat/completions", f'{{"messages":[{{"role":"user","content":"x"}}],"seed":{2**64}}}', "seed"),
    ("/v1/chat/completions", f'{{"messages":[{{"role":"user","content":"x"}}],"max_completion_tokens":{2**64}}}',
     "max_completion_tokens"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":1000000}',
     "top_logprobs"),
    # -1 (the whole vocabulary) passes the server's check, as vLLM's; the engine's max_logprobs (20) refuses it
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":-1}',
     "top_logprobs"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"logprobs":-1}', "logprobs"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"temperature":NaN}', "temperature"),
    # finite in float64, 0 or inf in the sampler's float32 (review item 3)
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"top_p":1e-300,"seed":1}', "top_p"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"repetition_penalty":1e-300}', "repetition_penalty"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"temperature":1e39,"min_tokens":2}', "temperature"),
    ("/v1/completions", '{"prompt":"x","max_tokens":4,"min_p":1e-300}', "min_p"),
    ("/v1/completions", '{"prompt":["x","y","z"],"max_tokens":1,"n":100}', "prompt"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"chat_template":'
     '"{% for i in range(10**9) %}a{% endfor %}"}}', "chat_template_kwargs"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"messages":5}}',
     "chat_template_kwargs"),
]


def _raw_post(server, path: str, body: str, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode(), timeout=30,
                      headers={"Content-Type": content_type, **auth()})


def _good_requests(ref, n: int = 4, max_tokens: int = 24):
    """Four greedy requests and what each gives alone (the reference LLM on the same folder)."""
    prompts = make_prompts([3 + 5 * i for i in range(n)], vocab=512, seed=21)
    alone = [ref.generate({"prompt_token_ids": p}, greedy(max_tokens, ignore_eos=True), use_tqdm=False)[0]
             for p in prompts]
    return prompts, [o.outputs[0].text for o in alone]


def _post_good(server, prompts, max_tokens, results, stream: bool, finished_at: dict | None = None):
    def one(i, p):
        try:
            _one(i, p)
        finally:
            if finished_at is not None:
                finished_at[i] = time.monotonic()

    def _one(i, p):
        body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
        r = post(server, "/v1/completions", body)
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", r.text
            results[i] = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        else:
            assert r.status_code == 200, r.text
            results[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.slow  # ~5-20 s on 2 shared cores
@pytest.mark.parametrize("stream", [False, True])
def test_poisoned_bodies_get_400_while_four_requests_finish_exactly(server, ref, stream):
    """The poisoned bodies are posted all at once while the four well-formed requests are in the engine (a
    slowed engine: ~30 ms a step), and every 400 arrives before any of the four finishes."""
    prompts, expected = _good_requests(ref, max_tokens=48)
    engine_loop = server.state.engine_loop
    results: dict[int, str] = {}
    finished_at: dict[int, float] = {}
    answered: dict[int, tuple[float, httpx.Response]] = {}

    def poison(k, path, body):
        r = _raw_post(server, path, body)
        answered[k] = (time.monotonic(), r)

    server.state.engine.fault_hook = lambda seqs: time.sleep(0.03)
    try:
        threads = _post_good(server, prompts, 48, results, stream, finished_at)
        deadline = time.monotonic() + 60
        while engine_loop.num_in_flight < 4:  # all four added to the engine
            assert time.monotonic() < deadline
            time.sleep(0.005)
        bad = [threading.Thread(target=poison, args=(k, path, body)) for k, (path, body, _) in enumerate(POISONED)]
        for t in bad:
            t.start()
        for t in bad:
            t.join(60)
        for t in threads:
            t.join(120)
    finally:
        server.state.engine.fault_hook = None
    for k, (_, _, field) in enumerate(POISONED):
        err = assert_error(answered[k][1], 400, field)
        assert field in err["message"] or field in ("prompt", "max_completion_tokens", "top_logprobs"), err
    assert max(t for t, _ in answered.values()) < min(finished_at.values()), "a good request finished first"
    assert [results[i] for i in range(4)] == expected
    wait_idle(server)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_step_failure_fails_only_its_own_request(server, ref):
    """The fault hook makes every step holding a MARK prompt raise: that request alone ends (500, or an SSE
    error event then [DONE]); four neighbours finish with exactly their outputs alone."""
    engine, m0 = server.state.engine, metrics(server)
    prompts, expected = _good_requests(ref)

    def hook(seqs):
        if any(MARK in s.token_ids[: s.num_prompt_tokens] for s in seqs):
            raise IndexError("index 1000000000 is out of bounds (injected)")

    engine.fault_hook = hook
    try:
        results: dict[int, str] = {}
        threads = _post_good(server, prompts, 24, results, stream=True)
        bad = post(server, "/v1/completions", {"prompt": [5, MARK, 6], "max_tokens": 8})
        err = assert_error(bad, 500, code="engine_error")
        assert "injected" in err["message"]
        r = post(server, "/v1/completions", {"prompt": [MARK], "max_tokens": 8, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_error"
        for t in threads:
            t.join(120)
    finally:
        engine.fault_hook = None
    assert [results[i] for i in range(4)] == expected
    m = wait_idle(server)
    assert m["metainfer:request_failed_total"] - m0["metainfer:request_failed_total"] == 2
    assert m["metainfer:engine_errors_total"] == m0["metainfer:engine_errors_total"]  # no step failed everyone


def test_only_json_bodies(server):
    body = '{"prompt": "x", "max_tokens": 2}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        assert_error(_raw_post(server, "/v1/completions", body, content_type), 415, code="unsupported_media_type")
    assert_error(_raw_post(server, "/v1/chat/completions", '{"messages": []}', "text/plain"), 415)
    assert _raw_post(server, "/v1/completions", body, "application/json; charset=utf-8").status_code == 200
    assert _raw_post(server, "/v1/completions", body, "Application/JSON").status_code == 200
    # the key is checked first: a keyless text/plain post is 401, not 415
    r = httpx.post(server.url + "/v1/completions", content=body.encode(), headers={"Content-Type": "text/plain"})
    assert_error(r, 401)
    wait_idle(server)


def test_api_docs_are_behind_the_key(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(httpx.get(server.url + path, timeout=10), 401)
        assert httpx.get(server.url + path, headers=auth(), timeout=10).status_code == 200, path
    schema = httpx.get(server.url + "/openapi.json", headers=auth(), timeout=10).json()
    assert "/v1/completions" in schema["paths"] and "/docs" not in schema["paths"]
    # vLLM leaves /health and /metrics open; so do we (README: API key scope)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_docs_off_and_the_default_model_id_is_the_folder_name(ref, model_dir):
    """No served name given: the id, the model card and the metrics label are the folder's name."""
    app = build_app(ref, docs=False)
    name = os.path.basename(model_dir)
    with ServerThread(app) as srv:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert_error(httpx.get(srv.url + path, timeout=10), 404)
        card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == card["root"] == name and os.sep not in json.dumps(card)
        r = post(srv, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2}, headers={})
        assert r.status_code == 200 and r.json()["model"] == name
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert f'model_name="{name}"' in text and model_dir not in text


def test_served_name_of_a_gguf_file_drops_the_extension():
    from metainfer.entrypoints.openai.api_server import default_served_name

    assert default_served_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert default_served_name("/models/Qwen3-8B/") == "Qwen3-8B"
    assert default_served_name("Qwen3-8B") == "Qwen3-8B"


# -- review of issue 24 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(model_dir):
    """max_n 4, a 96-token KV pool, a 48-token context; request-supplied chat templates allowed."""
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=48, max_n=4, num_kv_blocks=6, block_size=16)
    with serving(llm, trust_request_chat_template=True) as srv:
        yield srv


def test_prompt_list_fan_out_is_bounded_and_a_neighbour_is_not_delayed(small_server):
    """The review's repro at small numbers: a prompt list whose prompts x n pass max_n is a 400 naming `prompt`
    (or `n`), as is one whose sequences cannot fit the KV pool together; a concurrent small request finishes
    in its usual time; nothing is left queued."""
    srv = small_server
    alone = time.monotonic()
    assert post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, headers={}).status_code == 200
    alone = time.monotonic() - alone
    answers: dict[str, tuple[int, float]] = {}

    def neighbour():
        t0 = time.monotonic()
        r = post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, headers={})
        answers["neighbour"] = (r.status_code, time.monotonic() - t0)

    thread = threading.Thread(target=neighbour)
    thread.start()
    t0 = time.monotonic()
    err = assert_error(post(srv, "/v1/completions", {"prompt": ["x"] * 5, "max_tokens": 1}, headers={}), 400,
                       "prompt")
    assert "5 choices" in err["message"] and "max_n (4)" in err["message"], err
    assert_error(post(srv, "/v1/completions", {"prompt": [[1, 2]] * 3, "n": 2, "max_tokens": 1}, headers={}),
                 400, "prompt")
    assert_error(post(srv, "/v1/completions", {"prompt": "x", "n": 5, "max_tokens": 1}, headers={}), 400, "n")
    err = assert_error(post(srv, "/v1/completions", {"prompt": [[1, 2, 3]] * 3, "max_tokens": None}, headers={}),
                       400, "prompt")  # 3 x (3 + 45) = 144 tokens together > the pool's 96
    assert "KV cache together" in err["message"], err
    refused = time.monotonic() - t0
    thread.join(60)
    assert answers["neighbour"][0] == 200
    assert refused < 10 and answers["neighbour"][1] < 10 + 5 * alone, (refused, answers, alone)
    r = post(srv, "/v1/completions", {"prompt": [[1, 2]] * 2, "n": 2, "max_tokens": 2}, headers={})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4  # exactly max_n choices are fine
    wait_idle(srv)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}


def test_a_long_request_is_tokenized_on_a_lane_of_its_own(server):
    """A request body over LONG_REQUEST_BYTES (a megabyte prompt costs seconds of encoding) is tokenized on the
    second lane. While that lane is busy, short requests to every endpoint are answered, and the long ones wait
    for it (each endpoint passes its body's size); once it is free they are answered too."""
    from concurrent.futures import ThreadPoolExecutor

    from metainfer.entrypoints.openai.engine_loop import LONG_REQUEST_BYTES

    bodies = {"/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
              "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1},
              "/tokenize": {"model": MODEL, "prompt": "hi"},
              "/detokenize": {"model": MODEL, "tokens": [1, 2]}}
    pad = "u" * LONG_REQUEST_BYTES  # `user` (ignored where unknown) makes the body long, not the prompt
    release = threading.Event()
    busy = server.state.engine_loop.lanes[1].executor.submit(release.wait, 60)
    with ThreadPoolExecutor(len(bodies)) as pool:
        try:
            longs = {path: pool.submit(post, server, path, {**body, "user": pad}) for path, body in bodies.items()}
            for path, body in bodies.items():
                assert post(server, path, body).status_code == 200, path
            time.sleep(0.3)
            assert not [path for path, f in longs.items() if f.done()]
        finally:
            release.set()
        assert busy.result(5)
        for path, f in longs.items():
            assert f.result(60).status_code == 200, path


def test_a_body_over_the_cap_is_a_413_before_it_is_parsed(server):
    """By its Content-Length, or counted as its chunks arrive when it has none; a body under the cap is served,
    and so is the next request."""
    state = server.state
    cap, state.max_request_bytes, mb = state.max_request_bytes, 2000, state.max_request_mb
    state.max_request_mb = 2000 / 2**20
    try:
        big = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "u" * 3000}
        err = assert_error(post(server, "/v1/completions", big), 413, code="request_too_large")
        assert "--max-request-mb" in err["message"]
        raw = json.dumps(big).encode()
        chunked = httpx.post(server.url + "/v1/chat/completions", content=(raw[i:i + 500] for i in range(0, 4000, 500)),
                             headers={"Content-Type": "application/json", **auth()}, timeout=30)
        assert_error(chunked, 413, code="request_too_large")
        small = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
        ok = httpx.post(server.url + "/v1/completions", content=iter([small[:10], small[10:]]),
                        headers={"Content-Type": "application/json", **auth()}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    finally:
        state.max_request_bytes, state.max_request_mb = cap, mb
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_request_chat_templates_are_refused_by_default(server):
    for kwargs in ({"chat_template": "{{ messages[0].content }}"},
                   {"chat_template": "{% for i in range(10**9) %}a{% endfor %}"}):
        err = assert_error(post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs}), 400,
                           "chat_template_kwargs")
        assert "--trust-request-chat-template" in err["message"], err
    for key in ("messages", "tools", "documents", "continue_final_message", "conversation"):
        assert_error(post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: 5}}), 400,
                     "chat_template_kwargs")
    assert post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
                ).status_code == 200
    wait_idle(server)


def test_a_trusted_request_template_that_fails_is_a_400(small_server):
    """With --trust-request-chat-template a template that raises while rendering (range(10**9): OverflowError in
    jinja's sandbox; an undefined call) is a 400 naming chat_template_kwargs, not a 500; a good one is used."""
    srv = small_server
    for template in ("{% for i in range(10**9) %}a{% endfor %}", "{{ nothing() }}", "{% raise %}"):
        assert_error(post(srv, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": template}},
                          headers={}), 400, "chat_template_kwargs")
    r = post(srv, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "logprobs": True}, headers={})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(srv.state.engine_loop.tokenizer.encode("hi"))
    wait_idle(srv)


def test_drain_refuses_new_requests_and_lets_short_ones_finish(ref):
    """Shutdown's drain (what SIGTERM / SIGINT start, EngineLoop.request_drain): a new request gets 503
    server_shutdown; a request finishing within the drain time completes normally with its exact output; a
    non-streaming request still running when the time is up gets a 503 server_shutdown."""
    short_prompt = [11, 12, 13]
    expected = ref.generate({"prompt_token_ids": short_prompt}, greedy(6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    engine = ref.llm_engine
    app = build_app(ref, served_model_names=[MODEL])
    results: dict[str, httpx.Response] = {}

    def run(name, body):
        results[name] = post(srv, "/v1/completions", body, headers={})

    engine.fault_hook = lambda seqs: time.sleep(0.03)  # a slow engine: ~30 ms a step
    try:
        with ServerThread(app) as srv:
            loop = app.state.server.engine_loop
            threads = [threading.Thread(target=run, args=("long", {"prompt": [1, 2], "max_tokens": 400,
                                                                   "ignore_eos": True})),
                       threading.Thread(target=run, args=("short", {"prompt": short_prompt, "max_tokens": 6,
                                                                    "temperature": 0, "ignore_eos": True}))]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while loop.num_in_flight < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            loop.request_drain(2.0)
            assert_error(post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers={}), 503,
                         code="server_shutdown")
            for t in threads:
                t.join(60)
    finally:
        engine.fault_hook = None
    assert results["short"].status_code == 200 and results["short"].json()["choices"][0]["text"] == expected
    assert_error(results["long"], 503, code="server_shutdown")
    assert not engine.has_unfinished_requests()
