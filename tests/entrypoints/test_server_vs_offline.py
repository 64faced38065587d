"""The served path against the offline engine, in seconds (P10 quick): the in-process server (`build_app(llm)`: the
same EngineCore over the same pipes, in a thread) answers completions and chat, streamed and not, with the tokens,
text, finish reasons, logprobs and usage (cached prompt tokens included) that `LLM.generate` / `LLM.chat` of the same
engine settings give; its metrics count what the responses carried. One server (the package's fixture) for the file.

Why: the HTTP side applies the engine's token deltas and detokenizes them itself (engine_loop.RequestState), the
engine core sends only deltas (EngineCore._progress / _final), and the endpoint classes frame them; a change in any
of them must fail the quick gates (the perturbation evidence, docs/results/knowledge_perturb.json)."""

from __future__ import annotations

import pytest

from metainfer import SamplingParams
from tests.helpers.server import MODEL, assert_error, auth, post, success, wait_idle
from tests.helpers.tiny_models import make_prompts

NO_THINK = {"enable_thinking": False}
SEED, N, MAX = 11, 2, 8


def _sampled(**kw) -> SamplingParams:
    return SamplingParams(n=N, temperature=1.0, seed=SEED, max_tokens=MAX, logprobs=2, **kw)


def _check_choice(text, finish, tokens, token_lps, exp, tok, top=None):
    """One served choice against the offline CompletionOutput: text, finish reason, tokens, logprobs."""
    assert text == exp.text
    assert finish == exp.finish_reason
    assert tokens == [tok.decode([t]) for t in exp.token_ids]
    want = [d[t] for t, d in zip(exp.token_ids, exp.logprobs)]
    assert token_lps == pytest.approx(want, abs=1e-4)
    if top is not None:  # the top-2 of each position, by token text
        for got, d in zip(top, exp.logprobs):
            best = sorted(d.items(), key=lambda kv: -kv[1])[:2]
            assert {tok.decode([t]): lp for t, lp in best} == pytest.approx(dict(list(got.items())[:2]), abs=1e-4)


def _check_streamed(streamed, usages, exp, tok) -> int:
    """Every streamed choice (by index) against the offline outputs, and each usage's prompt and completion
    tokens; returns the tokens generated offline."""
    assert sorted(streamed) == list(range(N))
    for index, g in streamed.items():
        _check_choice(g["text"], g["finish"], g["tokens"], g["lps"], exp.outputs[index], tok)
    num_generated = sum(len(o.token_ids) for o in exp.outputs)
    for u in usages:
        assert (u.prompt_tokens, u.completion_tokens) == (len(exp.prompt_token_ids), num_generated)
    return num_generated


def _stream_completion(client, **kw):
    """The streamed choices by index: text, finish reason, tokens, token logprobs; and the usage chunk."""
    got: dict[int, dict] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            g = got.setdefault(c.index, {"text": "", "finish": None, "tokens": [], "lps": []})
            g["text"] += c.text
            g["finish"] = c.finish_reason or g["finish"]
            if c.logprobs is not None:
                g["tokens"] += c.logprobs.tokens
                g["lps"] += c.logprobs.token_logprobs
    return got, usage


def test_completions_equal_offline_generate(server, client, ref):
    tok = ref.get_tokenizer()
    m0 = wait_idle(server)
    prompt = "The capital of France is"
    before = dict(ref.llm_engine.stats)
    exp = ref.generate(prompt, _sampled(), use_tqdm=False)[0]
    counted = {k: ref.llm_engine.stats[k] - before[k] for k in ("prompt_tokens", "generation_tokens")}
    assert len(exp.outputs) == N
    full = client.completions.create(model=MODEL, prompt=prompt, n=N, temperature=1.0, seed=SEED, max_tokens=MAX,
                                     logprobs=2)
    assert sorted(c.index for c in full.choices) == list(range(N)) and full.model == MODEL
    for c in full.choices:
        lp = c.logprobs
        _check_choice(c.text, c.finish_reason, lp.tokens, lp.token_logprobs, exp.outputs[c.index], tok,
                      lp.top_logprobs)
    streamed, usage = _stream_completion(client, prompt=prompt, n=N, temperature=1.0, seed=SEED, max_tokens=MAX,
                                         logprobs=2)
    num_generated = _check_streamed(streamed, (full.usage, usage), exp, tok)
    for u in (full.usage, usage):
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    # a stop string that completes mid-output (greedy): the text is cut there, streamed or not
    base = ref.generate("Stop here", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    stop = next((base[i:i + 3] for i in range(len(base) // 3, len(base) - 3)
                 if base[i:i + 3].strip() and base.find(base[i:i + 3]) == i), None)
    assert stop, base
    greedy_stop = SamplingParams(temperature=0, max_tokens=24, stop=[stop], logprobs=1)
    before = dict(ref.llm_engine.stats)
    exp_stop = ref.generate("Stop here", greedy_stop, use_tqdm=False)[0]
    counted = {k: counted[k] + ref.llm_engine.stats[k] - before[k] for k in counted}
    assert exp_stop.outputs[0].finish_reason == "stop" and exp_stop.outputs[0].stop_reason == stop
    kw = dict(prompt="Stop here", temperature=0, max_tokens=24, stop=[stop], logprobs=1)
    full_stop = client.completions.create(model=MODEL, **kw)
    c = full_stop.choices[0]
    _check_choice(c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.token_logprobs, exp_stop.outputs[0], tok)
    assert c.stop_reason == stop
    streamed, usage_stop = _stream_completion(client, **kw)
    g = streamed[0]
    _check_choice(g["text"], g["finish"], g["tokens"], g["lps"], exp_stop.outputs[0], tok)
    assert usage_stop.completion_tokens == full_stop.usage.completion_tokens == len(exp_stop.outputs[0].token_ids)

    # the metrics: the server sent each request twice, so its engine counted twice what the offline one did
    m = wait_idle(server)
    assert server.state.engine_loop.num_in_flight == 0
    assert counted["generation_tokens"] == num_generated + len(exp_stop.outputs[0].token_ids)
    for key in ("prompt_tokens", "generation_tokens"):
        assert m[f"metainfer:{key}_total"] - m0[f"metainfer:{key}_total"] == 2 * counted[key], key
    reasons = [exp.outputs[0].finish_reason] * 2 + ["stop"] * 2  # a request counts its first choice's reason
    for reason in set(reasons):
        assert success(m, reason) - success(m0, reason) == reasons.count(reason), reason
    ttft = "metainfer:time_to_first_token_seconds_count"
    assert m[ttft] - m0[ttft] == 4
    longest = max(len(o.token_ids) for o in exp.outputs)
    itl = "metainfer:inter_token_latency_seconds_count"
    assert m[itl] - m0[itl] == 2 * (longest - 1) + 2 * (len(exp_stop.outputs[0].token_ids) - 1)


def test_chat_equal_offline_chat(server, client, ref):
    tok = ref.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    exp = ref.chat(messages, _sampled(), chat_template_kwargs=NO_THINK, use_tqdm=False)[0]
    kw = dict(model=MODEL, messages=messages, n=N, temperature=1.0, seed=SEED, max_completion_tokens=MAX,
              logprobs=True, top_logprobs=2, extra_body={"chat_template_kwargs": NO_THINK})
    full = client.chat.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == list(range(N))
    for c in full.choices:
        content = c.logprobs.content
        assert c.message.role == "assistant"
        _check_choice(c.message.content, c.finish_reason, [x.token for x in content], [x.logprob for x in content],
                      exp.outputs[c.index], tok, [{t.token: t.logprob for t in x.top_logprobs} for x in content])
    got: dict[int, dict] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            g = got.setdefault(c.index, {"text": "", "finish": None, "tokens": [], "lps": []})
            g["text"] += c.delta.content or ""
            g["finish"] = c.finish_reason or g["finish"]
            if c.logprobs is not None:
                g["tokens"] += [x.token for x in c.logprobs.content]
                g["lps"] += [x.logprob for x in c.logprobs.content]
    _check_streamed(got, (full.usage, usage), exp, tok)
    wait_idle(server)


def test_cached_tokens_equal_offline(server, client, ref):
    """A repeated prompt: usage's cached tokens are the offline engine's num_cached_tokens for the same repeat."""
    prompt = make_prompts([41], vocab=512, seed=77)[0]  # a prompt no other test sends
    params = SamplingParams(temperature=0, max_tokens=3)
    offline = [ref.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for _ in range(2)]
    assert offline[1].num_cached_tokens > 0
    served = [client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3) for _ in range(2)]
    for got, exp in zip(served, offline):
        assert got.usage.prompt_tokens_details.cached_tokens == exp.num_cached_tokens
        assert got.choices[0].text == exp.outputs[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == offline[1].num_cached_tokens
    wait_idle(server)


def test_models_and_auth(server, client, ref):
    """The served name is the one given to build_app, with the engine's context length; a request without the key
    (or not JSON) is refused before the engine."""
    cards = client.models.list().data
    assert [m.id for m in cards] == [MODEL]
    assert cards[0].model_extra["max_model_len"] == ref.llm_engine.config.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert_error(post(server, "/v1/completions", body, headers={}), 401)
    assert_error(post(server, "/v1/completions", b"{}", headers={"Content-Type": "text/plain", **auth()}), 415)
    assert post(server, "/v1/completions", body).json()["model"] == MODEL
