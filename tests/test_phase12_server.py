"""Phase 12: the OpenAI-compatible server, driven by the official `openai` client and httpx.

One tiny random Qwen3 (real Qwen3 tokenizer and chat template) is served in-process by uvicorn
on 127.0.0.1 in a background thread; a second LLM on the same folder gives the references.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from metainfer import LLM, SamplingParams
from metainfer.bench import serve as bench_serve
from metainfer.entrypoints.openai_server import ServerThread, build_app
from tests.helpers.tiny_models import build_tiny_model, make_prompts

KEY = "sk-test-key"
MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-serve"))
    build_tiny_model(folder, "qwen3", vocab_size=151936)
    return folder


@pytest.fixture(scope="module")
def ref(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32")
    app = build_app(llm, served_model_names=[MODEL], api_key=KEY)
    srv = ServerThread(app).start()
    srv.app = app
    srv.state = app.state.server
    yield srv
    srv.stop()
    llm.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def metrics(server) -> dict[str, float]:
    """Prometheus text -> {series: value}; series without labels other than model_name are
    also stored under their bare name."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        out[series] = float(value)
        name, _, labels = series.partition("{")
        if labels == f'model_name="{MODEL}"}}':
            out[name] = float(value)
    return out


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["metainfer:num_requests_running"] == 0 and m["metainfer:num_requests_waiting"] == 0
                and m["metainfer:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            assert idle, {k: v for k, v in m.items() if "num_requests" in k or "kv_cache" in k}
            assert not server.state.engine.has_unfinished_requests()
            assert server.state.num_queued == 0
            return m
        time.sleep(0.05)


def _greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _success(m, reason):
    return m[f'metainfer:request_success_total{{model_name="{MODEL}",finished_reason="{reason}"}}']


# -- endpoints ----------------------------------------------------------------------------------
def test_health_models_metrics(server, client):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_count",
                 "num_requests_running_max"):
        assert f"metainfer:{name}" in r.text, name


def test_completions_match_llm(server, client, ref):
    prompts = ["Hello world", "The capital of France is", "1, 2, 3, 4,"]
    expected = ref.generate(prompts, _greedy(12), use_tqdm=False)
    m0 = metrics(server)
    for prompt, exp in zip(prompts, expected):
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert full.choices[0].text == streamed == exp.outputs[0].text
        assert full.choices[0].finish_reason == "length"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.completion_tokens == 12
        assert full.usage.prompt_tokens == usage.prompt_tokens == len(exp.prompt_token_ids)
        assert full.usage.total_tokens == len(exp.prompt_token_ids) + 12
    m = wait_idle(server)
    assert m["metainfer:generation_tokens_total"] - m0["metainfer:generation_tokens_total"] == 6 * 12
    assert m["metainfer:prompt_tokens_total"] > m0["metainfer:prompt_tokens_total"]
    assert m["metainfer:time_to_first_token_seconds_count"] >= 6


def test_chat_matches_llm(server, client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    exp = ref.chat(messages, _greedy(10), chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                          temperature=0, extra_body=NO_THINK)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=NO_THINK)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == exp.outputs[0].text
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(exp.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == 10
    # the template kwargs reach the template: with thinking on the prompt differs
    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert thinking.usage.prompt_tokens != full.usage.prompt_tokens
    # content given as a list of text parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    wait_idle(server)


def test_completion_options(server, client, ref):
    # a list of prompts with n=2: choices are prompt-major
    prompts = ["Once upon a time", "def main():"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    exp = ref.generate(prompts, _greedy(6), use_tqdm=False)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == exp[c.index // 2].outputs[0].text
    assert r.usage.completion_tokens == 4 * 6
    # token-id prompt, and echo
    ids = make_prompts([9], vocab=512, seed=3)[0]
    exp_ids = ref.generate({"prompt_token_ids": ids}, _greedy(5), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == exp_ids.text and r.usage.prompt_tokens == 9
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, echo=True)
    plain = ref.generate("Hello world", _greedy(5), use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].text == "Hello world" + plain
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    # logprobs, streamed and not
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 6
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    # seeded sampling is reproducible and equals LLM with the same seed
    a, b = (client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=1.0, seed=123)
            for _ in range(2))
    exp_seed = ref.generate("Hi", SamplingParams(temperature=1.0, seed=123, max_tokens=8), use_tqdm=False)[0]
    assert a.choices[0].text == b.choices[0].text == exp_seed.outputs[0].text
    # vLLM extras: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos
    g = ref.generate("Tell me", _greedy(8), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=1.0,
                                  extra_body={"top_k": 1, "min_p": 0.1, "ignore_eos": True})
    assert r.choices[0].text == g.text
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [g.token_ids[2]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 3
    assert r.choices[0].stop_reason == g.token_ids[2]
    rep = ref.generate("Tell me", _greedy(8, repetition_penalty=1.5), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0,
                                  extra_body={"repetition_penalty": 1.5})
    assert r.choices[0].text == rep.text
    wait_idle(server)


def test_stop_strings_stream_equals_full(server, client, ref):
    """A stop string that completes mid-output: streamed text never shows the cut-off part."""
    base = ref.generate("Stop here", _greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = next((base[i:i + 3] for i in range(len(base) // 3, len(base) - 3)
                 if base[i:i + 3].strip() and base.find(base[i:i + 3]) == i), None)
    assert stop, base
    exp = ref.generate("Stop here", _greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert exp.finish_reason == "stop"
    full = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0, stop=[stop])
    chunks = list(client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0,
                                            stop=[stop], stream=True))
    assert full.choices[0].text == "".join(c.choices[0].text for c in chunks) == exp.text
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    assert full.choices[0].stop_reason == stop
    chat = [{"role": "user", "content": "Stop here"}]
    c_full = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24, temperature=0, stop=stop)
    c_stream = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24, temperature=0, stop=stop,
                                              stream=True)
    assert c_full.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in c_stream)
    wait_idle(server)


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


# -- errors ---------------------------------------------------------------------------------
def _post(server, path, body, headers=None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json", **(_auth() if headers is None else headers)})


def _assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_bad_requests_get_openai_errors(server, client):
    _assert_error(_post(server, "/v1/completions", b'{"prompt": "x", '), 400)
    _assert_error(_post(server, "/v1/completions", b"[1, 2]"), 400)
    _assert_error(_post(server, "/v1/completions", b""), 400)
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": "ten"}), 400, "max_tokens")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "temperature": "0.5"}), 400, "temperature")
    _assert_error(_post(server, "/v1/completions", {"prompt": 5}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "stream": True, "stream_options": 1}), 400,
                  "stream_options")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "stop": [1]}), 400, "stop")
    _assert_error(_post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": -1}), 400, "max_tokens")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "temperature": -1}), 400, "temperature")
    _assert_error(_post(server, "/v1/completions", {"prompt": [10**9]}), 400, "prompt")
    _assert_error(_post(server, "/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    _assert_error(_post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    _assert_error(_post(server, "/v1/chat/completions",
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
    _assert_error(_post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model", "model_not_found")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    _assert_error(_post(server, "/v1/completions", {"prompt": "x"}, headers={}), 401, code="invalid_api_key")
    _assert_error(httpx.get(server.url + "/v1/models", timeout=10), 401)
    _assert_error(httpx.get(server.url + "/v1/nothing-here", headers=_auth(), timeout=10), 404)
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
        _assert_error(_post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 4}), 500, code="engine_error")
        fail["next"] = True
        r = _post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 4, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_error"
    finally:
        del engine.step
    assert client.completions.create(model=MODEL, prompt="fine again", max_tokens=3).usage.completion_tokens == 3
    m = wait_idle(server)
    assert m["metainfer:engine_errors_total"] - m0["metainfer:engine_errors_total"] == 2
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_queue_cap_answers_503(server, client):
    state = server.state
    try:
        state.max_queued_requests = 0
        err = _assert_error(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}), 503, code="queue_full")
        assert err["type"] == "server_error"
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        state.max_queued_requests = 1  # one at a time is fine: the slot is released after the first token
        for _ in range(3):
            assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        state.max_queued_requests = None
    wait_idle(server)


# -- load ---------------------------------------------------------------------------------------
def test_64_concurrent_streams_batch_and_match(server, ref):
    lengths = [1 + (i * 37) % 90 for i in range(64)]
    prompts = make_prompts(lengths, vocab=512, seed=11)
    max_tokens = [4 + (i * 7) % 21 for i in range(64)]
    expected = ref.generate([{"prompt_token_ids": p} for p in prompts],
                            [_greedy(n, ignore_eos=True) for n in max_tokens], use_tqdm=False)
    m0 = metrics(server)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)

        async def one(prompt, n):
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            return text, usage, finish

        try:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    for (text, usage, finish), exp, n, p in zip(results, expected, max_tokens, prompts):
        assert text == exp.outputs[0].text
        assert usage.completion_tokens == n and usage.prompt_tokens == len(p) and finish == "length"
    m = wait_idle(server)
    assert m["metainfer:num_requests_running_max"] > 1
    single_key = f'metainfer:step_batch_size_bucket{{model_name="{MODEL}",le="1.0"}}'
    multi_now = m["metainfer:step_batch_size_count"] - m[single_key]
    multi_before = m0["metainfer:step_batch_size_count"] - m0[single_key]
    assert multi_now - multi_before > 0  # during THIS test some steps ran more than one request
    assert m["metainfer:generation_tokens_total"] - m0["metainfer:generation_tokens_total"] == sum(max_tokens)
    assert _success(m, "length") - _success(m0, "length") == 64


def test_disconnects_abort_and_free_blocks(server, ref):
    keep_prompts = ["Keep going " + str(i) for i in range(6)]
    expected = ref.generate(keep_prompts, _greedy(16, ignore_eos=True), use_tqdm=False)
    m0 = metrics(server)
    url = server.url + "/v1/completions"
    long_body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def quitter(client, i):  # reads three events, then hangs up
        body = {**long_body, "prompt": f"Quit early {i}", "stream": True}
        async with client.stream("POST", url, json=body, headers=_auth()) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break

    async def impatient(client, i):  # a non-streaming request whose client times out
        with pytest.raises(httpx.ReadTimeout):
            await client.post(url, json={**long_body, "prompt": f"Too slow {i}"}, headers=_auth(), timeout=0.5)

    async def keeper(client, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = ""
        async with client.stream("POST", url, json=body, headers=_auth()) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    text += json.loads(line[5:])["choices"][0]["text"]
        return text

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            jobs = [quitter(client, i) for i in range(20)] + [impatient(client, i) for i in range(2)]
            jobs += [keeper(client, p) for p in keep_prompts]
            return await asyncio.gather(*jobs)

    start = time.monotonic()
    results = asyncio.run(run())
    assert results[22:] == [e.outputs[0].text for e in expected]
    m = wait_idle(server, timeout=20)
    assert time.monotonic() - start < 60
    assert m["metainfer:request_aborted_total"] - m0["metainfer:request_aborted_total"] == 22
    assert _success(m, "length") - _success(m0, "length") == 6


# -- bench and CLI ---------------------------------------------------------------------------
def _bench_args(argv):
    parser = argparse.ArgumentParser()
    bench_serve.add_serve_bench_parser(parser.add_subparsers(dest="bench_command"))
    return parser.parse_args(["serve", *argv])


def test_bench_serve_reports_metrics(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = _bench_args(["--base-url", server.url, "--api-key", KEY, "--num-prompts", "8", "--input-len", "16",
                        "--output-len", "6", "--max-concurrency", "4", "--request-rate", "100",
                        "--metric-percentiles", "50,99", "--output-json", str(out)])
    record = bench_serve.main(args)
    table = capsys.readouterr().out
    for label in ("Successful requests:", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):",
                  "P50 E2EL (ms):", "Output token throughput (tok/s):"):
        assert label in table, table
    saved = json.loads(out.read_text())
    assert saved["completed"] == 8 and saved["failed"] == 0
    assert saved["total_input_tokens"] == 8 * 16 and saved["total_output_tokens"] == 8 * 6
    assert 1 <= saved["max_concurrent_requests"] <= 4
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99", "p50"):
            assert saved[f"{stat}_{name}_ms"] >= 0
    assert saved["mean_e2el_ms"] >= saved["mean_ttft_ms"] > 0
    assert saved["request_throughput"] > 0 and saved["output_throughput"] > 0
    assert record["model"] == MODEL
    chat = bench_serve.main(_bench_args(["--base-url", server.url, "--api-key", KEY, "--endpoint",
                                         "/v1/chat/completions", "--num-prompts", "2", "--input-len", "8",
                                         "--output-len", "4", "--json", "--no-warmup"]))
    assert chat["completed"] == 2 and chat["total_output_tokens"] == 8
    wait_idle(server)


def test_bench_serve_standalone_and_cli(server):
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "metainfer.bench.serve", "--base-url", server.url, "--api-key", KEY,
           "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completed"] == 3
    import importlib.util

    if importlib.util.find_spec("metainfer.bench.cli") is None:
        pytest.skip("metainfer.bench.cli is not there yet")
    from metainfer.entrypoints import cli

    assert cli.main(["bench", "serve", "--base-url", server.url, "--api-key", KEY, "--num-prompts", "2",
                     "--input-len", "4", "--output-len", "2", "--no-warmup"]) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metainfer_serve_command(model_dir):
    from metainfer.entrypoints import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    port = _free_port()
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", model_dir, "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--served-model-name", "tiny-cli", "--api-key", KEY,
           "--max-queued-requests", "8", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == ["tiny-cli"]
        r = c.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode is not None
