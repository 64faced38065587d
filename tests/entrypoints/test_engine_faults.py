"""Engine faults as the server's two halves see them (the engine core in a thread of this process, the same pipes and
messages as its own process): a failed step fails exactly the requests the engine had, not one whose "add" is still
in the pipe; a prompt's isolated fault ends its whole client request, siblings included."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers.server import MODEL, auth, post

pytestmark = pytest.mark.slow  # they generate hundreds of tokens on 2 shared cores


def _engine_idle(server, timeout: float = 30.0) -> None:
    engine, loop = server.state.engine, server.state.engine_loop
    deadline = time.monotonic() + timeout
    while engine.requests or loop.num_in_flight:
        assert time.monotonic() < deadline, (list(engine.requests), loop.num_in_flight)
        time.sleep(0.02)


def _stream(server, max_tokens: int, results: dict, name: str) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(), timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    results[name] = events


def test_a_failed_step_fails_only_the_requests_the_engine_had(server):
    """A and B run; the step that fails (no single sequence reproduces it) waits until C's "add" was written to
    the engine's pipe. A and B end with engine_error; C, which the engine adds after the failure, runs to its end
    for its client (before: the HTTP side failed C too, and the engine then ran it with nobody reading)."""
    engine, loop = server.state.engine, server.state.engine_loop
    _engine_idle(server)
    armed = threading.Event()

    def hook(seqs):
        if armed.is_set() and len(seqs) >= 2:
            armed.clear()
            deadline = time.monotonic() + 10
            while not loop._adds and time.monotonic() < deadline:  # C submitted: its "add" is being sent
                time.sleep(0.005)
            time.sleep(0.3)  # the sender thread writes it to the pipe meanwhile
            raise RuntimeError("a failure no single sequence reproduces")

    results: dict[str, list[str]] = {}
    engine.fault_hook = hook
    try:
        a = threading.Thread(target=_stream, args=(server, 400, results, "A"))
        a.start()
        while not engine.requests:
            time.sleep(0.005)
        armed.set()
        b = threading.Thread(target=_stream, args=(server, 400, results, "B"))
        b.start()
        while armed.is_set() and len(engine.requests) < 2:
            time.sleep(0.005)
        c = threading.Thread(target=_stream, args=(server, 24, results, "C"))
        c.start()
        for t in (a, b, c):
            t.join(120)
    finally:
        engine.fault_hook = None
    for name in "AB":
        assert results[name][-1] == "[DONE]"
        assert json.loads(results[name][-2])["error"]["code"] == "engine_error", results[name][-2:]
    assert results["C"][-1] == "[DONE]" and "error" not in results["C"][-2], results["C"][-2:]
    texts = [json.loads(e)["choices"][0] for e in results["C"][:-1]]
    assert texts[-1]["finish_reason"] == "length"
    _engine_idle(server)


def test_an_isolated_fault_ends_the_sibling_prompts_of_its_request(server):
    """Prompt 0 of a two-prompt request fails alone (fault isolation finds it): the answer is its error, and prompt 1
    is aborted at once (before: it ran to max_tokens for nobody and held up the drain)."""
    engine = server.state.engine
    _engine_idle(server)

    def hook(seqs):
        for s in seqs:
            if s.request_id.endswith("-0") and s.num_known_output_tokens >= 3:
                raise RuntimeError("bad data in prompt 0")

    engine.fault_hook = hook
    try:
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7, 8], [9, 10, 11, 12]],
                                             "max_tokens": 3000, "ignore_eos": True})
        answered = time.monotonic()
        assert r.status_code == 500 and "bad data in prompt 0" in r.text, r.text
        assert server.state.engine_loop.num_in_flight == 0
        _engine_idle(server, timeout=10)
        assert time.monotonic() - answered < 2
    finally:
        engine.fault_hook = None
