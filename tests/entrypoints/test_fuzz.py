"""Property-based fuzzing (hypothesis) of SamplingParams and of request bodies against the running server.

Every generated input either succeeds or is refused with a ValueError / HTTP 4xx that names one of the
fields it set; meanwhile well-formed greedy requests keep their exact outputs, and the engine serves
afterwards. Bounded twice: a number of examples and a wall-clock budget a test (METAINFER_FUZZ_SECONDS,
default 60: examples past it are skipped); no example database, no per-example deadline (the CPU is shared).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metainfer import LLM, SamplingParams
from tests.helpers.server import KEY, auth, greedy, serving, wait_idle
from tests.helpers.tiny_models import make_prompts

# values that broke or could break a step: widths, signs, NaN / inf, wrong types
NASTY = st.sampled_from([0, -1, 1, 2, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**9), 10**9,
                         math.nan, math.inf, -math.inf, 0.5, -0.5, 1e-9, 1e300, True, False, None, "1", "", [],
                         {}, [1], [-1], [2**63], [10**9], ["a"], [""],
                         # finite in float64, 0 or inf in the sampler's float32
                         1e-300, 5e-324, 1e-45, 1e-7, 1e39, 3.5e38, -1e39])
BUDGET_S = float(os.environ.get("METAINFER_FUZZ_SECONDS", "60"))


class Budget:
    """A wall-clock bound over a hypothesis run: `spent` turns true once the budget is used up."""

    def __init__(self, seconds: float = BUDGET_S):
        self.end, self.skipped = time.monotonic() + seconds, 0

    @property
    def spent(self) -> bool:
        if time.monotonic() > self.end:
            self.skipped += 1
            return True
        return False


def _out_of_budget(holder: list[Budget]) -> bool:
    """Start a hypothesis run's budget at its first example (`holder` keeps it); True once it is spent."""
    if not holder:
        holder.append(Budget())
    return holder[0].spent
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SMALL_INTS = st.integers(min_value=-3, max_value=40)
BIG_INTS = st.integers(min_value=-(2**70), max_value=2**70)

# per SamplingParams field: plausible values, edge values, and the nasty ones
FIELD_VALUES = {
    "n": st.one_of(st.integers(1, 3), SMALL_INTS, BIG_INTS, NASTY),
    "temperature": st.one_of(st.floats(0, 2), FLOATS, NASTY),
    "top_p": st.one_of(st.floats(0, 1), FLOATS, NASTY),
    "top_k": st.one_of(SMALL_INTS, BIG_INTS, NASTY),
    "min_p": st.one_of(st.floats(0, 1), FLOATS, NASTY),
    "seed": st.one_of(BIG_INTS, NASTY),
    "max_tokens": st.one_of(st.integers(1, 4), SMALL_INTS, BIG_INTS, NASTY),
    "min_tokens": st.one_of(st.integers(0, 3), BIG_INTS, NASTY),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), NASTY),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 600), max_size=3), st.lists(BIG_INTS, max_size=2), NASTY),
    "ignore_eos": st.one_of(st.booleans(), NASTY),
    "logprobs": st.one_of(st.integers(0, 3), SMALL_INTS, BIG_INTS, NASTY),
    "presence_penalty": st.one_of(st.floats(-2, 2), FLOATS, NASTY),
    "frequency_penalty": st.one_of(st.floats(-2, 2), FLOATS, NASTY),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), FLOATS, NASTY),
    "skip_special_tokens": st.one_of(st.booleans(), NASTY),
    "include_stop_str_in_output": st.one_of(st.booleans(), NASTY),
}
PARAMS = st.fixed_dictionaries({}, optional=FIELD_VALUES)


_PARAMS_BUDGET: list[Budget] = []


@settings(max_examples=400, deadline=None, database=None)
@given(PARAMS)
def test_sampling_params_accept_or_name_a_field(kwargs):
    """Construction either succeeds (and re-validation agrees) or raises ValueError naming a field it set."""
    if _out_of_budget(_PARAMS_BUDGET):
        return
    try:
        params = SamplingParams(**kwargs)
    except ValueError as err:
        assert getattr(err, "param", None) in kwargs, (kwargs, err)
        return
    params.validate()
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert math.isfinite(getattr(params, name))
    for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "seed"):
        value = getattr(params, name)
        assert value is None or (type(value) is int and -(2**63) <= value < 2**63)


_ENGINE_BUDGET: list[Budget] = []


@pytest.mark.slow
@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(PARAMS)
def test_engine_accepts_or_names_a_field(ref, kwargs):
    """What SamplingParams accepts, the engine either queues or refuses naming a field; what it queues runs
    a prefill and a few decode steps (where penalties and min_tokens act) without failing and samples ids
    inside the vocabulary (bounded: the request is aborted after them)."""
    if _out_of_budget(_ENGINE_BUDGET):
        return
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return
    engine = ref.llm_engine
    try:
        engine.add_request("fuzz", {"prompt_token_ids": [1, 2, 3]}, params)
    except ValueError as err:
        assert getattr(err, "param", None) in kwargs, (kwargs, err)
        return
    failed = engine.stats.get("failed_requests", 0)
    try:
        for _ in range(4):
            for out in engine.step():
                assert out.error is None, (kwargs, out.error)
                assert all(0 <= t < engine.spec.vocab_size for c in out.outputs for t in c.token_ids), kwargs
            if not engine.has_unfinished_requests():
                break
        assert engine.stats.get("failed_requests", 0) == failed
    finally:
        engine.abort_request("fuzz")
        while engine.in_flight:  # read back what async scheduling left in flight
            engine.step()


# request bodies: the sampling fields plus the API's own; the values may be anything JSON can carry
PROMPTS = st.one_of(st.text(max_size=12), st.lists(st.integers(0, 600), max_size=6),
                    st.lists(st.text(max_size=6), max_size=2), NASTY,
                    st.lists(st.just("x"), min_size=1, max_size=9))  # fan-out through the prompt list (max_n 4)
TEMPLATE_KWARGS = st.one_of(
    st.fixed_dictionaries({}, optional={"chat_template": st.one_of(st.sampled_from(
        ["{{ messages }}", "{% for i in range(10**9) %}a{% endfor %}", "{{ x() }}"]), NASTY),
        "messages": NASTY, "tools": NASTY, "add_generation_prompt": NASTY, "enable_thinking": st.booleans(),
        "documents": NASTY, "continue_final_message": NASTY}),
    NASTY)
COMPLETION_BODY = st.fixed_dictionaries({"prompt": PROMPTS}, optional={
    **{k: v for k, v in FIELD_VALUES.items() if k != "logprobs"},
    "logprobs": st.one_of(st.integers(0, 3), BIG_INTS, NASTY), "echo": st.one_of(st.booleans(), NASTY),
    "stream": st.one_of(st.booleans(), NASTY), "best_of": st.one_of(st.integers(1, 2), NASTY),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=3), FLOATS, max_size=2), NASTY),
    "user": st.one_of(st.text(max_size=4), NASTY), "suffix": st.one_of(st.none(), NASTY)})
MESSAGES = st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                     "content": st.one_of(st.text(max_size=10), NASTY)}),
                              max_size=3), NASTY)
CHAT_BODY = st.fixed_dictionaries({"messages": MESSAGES}, optional={
    **{k: v for k, v in FIELD_VALUES.items() if k not in ("logprobs", "max_tokens")},
    "max_completion_tokens": FIELD_VALUES["max_tokens"], "logprobs": st.one_of(st.booleans(), NASTY),
    "top_logprobs": st.one_of(st.integers(0, 3), BIG_INTS, NASTY), "stream": st.one_of(st.booleans(), NASTY),
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=3), FLOATS, max_size=2), NASTY)})
# plausible values only: most of these succeed, so the accepted paths (penalties, seeds, stops, logprobs, n,
# streaming) run beside the neighbours too
PLAUSIBLE = {"n": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
             "top_k": st.integers(-1, 50), "min_p": st.floats(0, 0.5), "seed": st.integers(0, 2**63 - 1),
             "max_tokens": st.integers(1, 4), "min_tokens": st.integers(0, 1),
             "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
             "stop_token_ids": st.lists(st.integers(0, 600), max_size=3), "ignore_eos": st.booleans(),
             "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
             "repetition_penalty": st.floats(0.5, 2), "stream": st.booleans(), "logprobs": st.integers(0, 3),
             "logit_bias": st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100), max_size=3),
             "allowed_token_ids": st.lists(st.integers(0, 600), min_size=1, max_size=4)}
PLAUSIBLE_BODY = st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=12),
                                                            st.lists(st.integers(0, 500), min_size=1, max_size=6))},
                                       optional=PLAUSIBLE)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
NOT_OBJECTS = st.one_of(st.just([]), st.none(), st.text(max_size=4), st.integers(), st.lists(st.integers(), max_size=2))
BODIES = st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION_BODY),
                   st.tuples(st.just("/v1/chat/completions"), CHAT_BODY),
                   st.tuples(st.just("/v1/completions"), PLAUSIBLE_BODY),
                   st.tuples(PATHS, NOT_OBJECTS))  # a body that is not a JSON object: 400, param null


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    """A server of its own with a short context and a small max_n, so that every valid fuzzed request (say
    max_tokens=2**63-1, clamped to the context) stays short."""
    with serving(LLM(model_dir, device="cpu", dtype="float32", max_model_len=48, max_n=4), api_key=KEY) as srv:
        yield srv


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={"Content-Type": "application/json", **auth()})


class Neighbours:
    """Four well-formed greedy requests posted over and over in the background; each must give its output alone."""

    def __init__(self, server, ref, max_tokens: int = 12):
        self.server, self.max_tokens = server, max_tokens
        self.prompts = make_prompts([4, 7, 2, 11], vocab=512, seed=33)
        self.expected = [ref.generate({"prompt_token_ids": p}, greedy(max_tokens, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text for p in self.prompts]
        self.rounds, self.wrong, self.stop = 0, [], threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _one(self, i: int) -> None:
        body = {"prompt": self.prompts[i], "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        r = post(self.server, "/v1/completions", body)
        got = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        if got != self.expected[i]:
            self.wrong.append((i, got))

    def _loop(self) -> None:
        while not self.stop.is_set():
            threads = [threading.Thread(target=self._one, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            self.rounds += 1


def _check_answer(path: str, body, r: httpx.Response) -> None:
    if not isinstance(body, dict):
        assert r.status_code == 400 and r.json()["error"]["param"] is None, (path, body, r.text)
        return
    if r.status_code == 200:
        if body.get("stream") is True:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", r.text
            assert all("error" not in json.loads(e) for e in events[:-1]), r.text
        else:
            assert r.json()["choices"], r.text
        return
    assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["param"] in body, (path, body, err)


@pytest.mark.slow  # a few tens of seconds on 2 CPU cores
def test_fuzzed_bodies_against_the_server(fuzz_server, ref):
    server = fuzz_server
    neighbours = Neighbours(server, ref)
    neighbours.thread.start()
    statuses: dict[int, int] = {}
    start, budget = time.monotonic(), Budget()

    @settings(max_examples=int(os.environ.get("METAINFER_FUZZ_EXAMPLES", "70")), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(BODIES)
    def fuzz(path_body):
        if budget.spent:
            return
        path, body = path_body
        raw = json.dumps(body).encode()  # NaN / Infinity are written as JSON's common extension
        r = post(server, path, raw)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        _check_answer(path, body, r)

    try:
        fuzz()
    finally:
        neighbours.stop.set()
        neighbours.thread.join(180)
    elapsed = time.monotonic() - start
    assert neighbours.rounds >= 1 and neighbours.wrong == [], neighbours.wrong[:3]
    assert statuses.get(200) and statuses.get(400), statuses  # both outcomes were exercised
    r = post(server, "/v1/completions", {"prompt": "still serving", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_idle(server, timeout=60)
    assert elapsed < BUDGET_S + 120, elapsed  # the budget, plus the neighbours' last round and the checks
    print(f"fuzz: {sum(statuses.values())} bodies {statuses}, {neighbours.rounds} neighbour rounds, {elapsed:.1f} s, "
          f"{budget.skipped} examples past the {BUDGET_S:g} s budget skipped")
