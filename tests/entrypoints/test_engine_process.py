"""The server the way `metainfer serve` runs it: the engine in its own process (engine_core.py), this process
tokenizing, decoding and framing. One module-scoped server (spawning the engine costs seconds on 2 cores); the
offline `LLM` on the same folder is the reference. The crash test kills that server's engine, so it runs last."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from metainfer.config import ConfigError
from metainfer.entrypoints.openai.api_server import build_app
from tests.helpers.server import KEY, MODEL, ServerThread, assert_error, auth, greedy, metrics, post
from tests.helpers.tiny_models import make_prompts


@pytest.fixture(scope="module")
def proc_server(model_dir):
    app = build_app({"model": model_dir, "device": "cpu", "dtype": "float32"}, served_model_names=[MODEL],
                    api_key=KEY)
    srv = ServerThread(app).start()
    srv.state = app.state.server
    yield srv
    srv.stop()
    assert not srv.state.handle.process.is_alive()  # the app's end ends the engine process


@pytest.fixture()
def pclient(proc_server):
    return openai.OpenAI(base_url=proc_server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["metainfer:num_requests_running"] == 0 and m["metainfer:num_requests_waiting"] == 0
                and m["metainfer:kv_cache_usage_perc"] == 0 and server.state.engine_loop.num_in_flight == 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_the_engine_runs_in_another_process(proc_server):
    handle = proc_server.state.handle
    assert proc_server.state.engine is None and handle.process.is_alive() and handle.pid != os.getpid()
    # the engine process froze its startup heap before "ready": the model, torch and the tokenizer at least
    assert handle.ready_info["gc_frozen"] > 10_000, handle.ready_info


def test_freezing_the_startup_heap_removes_it_from_full_collections():
    """In a fresh process (a freeze is for good): a full collection after freeze_startup_heap scans none of the
    objects alive at the freeze, so it is faster than one before it."""
    code = ("import gc, time, torch, transformers; from metainfer.entrypoints.openai.engine_core import "
            "freeze_startup_heap as f; t = time.perf_counter(); gc.collect(); before = time.perf_counter() - t; "
            "n = f(); t = time.perf_counter(); gc.collect(); after = time.perf_counter() - t; "
            "print(n, len(gc.get_objects()), before, after)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    frozen, tracked, before, after = out.stdout.split()
    assert int(frozen) > 10_000 and int(tracked) < int(frozen) // 10  # what is left tracked is what came after
    assert float(after) < float(before) / 5, out.stdout


def test_greedy_outputs_equal_the_offline_engine(proc_server, pclient, ref):
    """Text and token-id prompts, n=2, streamed and not: the same tokens and text as LLM.generate."""
    prompts = ["Hello world", "The capital of France is"] + make_prompts([5, 40], vocab=512, seed=3)
    expected = ref.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
                            greedy(10, ignore_eos=True), use_tqdm=False)
    for prompt, exp in zip(prompts, expected):
        want = exp.outputs[0]
        full = pclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, n=2,
                                          logprobs=1, extra_body={"ignore_eos": True})
        assert [c.text for c in full.choices] == [want.text] * 2
        assert [c.finish_reason for c in full.choices] == ["length"] * 2
        assert len(full.choices[0].logprobs.tokens) == 10
        chunks = list(pclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "return_token_ids": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert chunks[-1].usage.completion_tokens == 10
        assert chunks[-1].usage.prompt_tokens == len(exp.prompt_token_ids)
    conversation = [{"role": "user", "content": "Say hi"}]
    exp = ref.chat(conversation, greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    chunks = list(pclient.chat.completions.create(model=MODEL, messages=conversation, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.text


def test_stop_strings_cut_in_the_engine_stream_equal_full(proc_server, pclient, ref):
    prompt = make_prompts([12], vocab=512, seed=5)[0]
    free = ref.generate({"prompt_token_ids": prompt}, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:2]
    exp = ref.generate({"prompt_token_ids": prompt}, greedy(16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert exp.finish_reason == "stop" and exp.stop_reason == stop
    body = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    full = pclient.completions.create(**body)
    streamed = "".join(c.choices[0].text for c in pclient.completions.create(**body, stream=True) if c.choices)
    assert full.choices[0].text == streamed == exp.text and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(exp.token_ids)


def test_sampled_choices_cut_at_a_stop_string_stream_their_cut_text(proc_server, pclient, ref):
    """n=6, sampled with a seed: one choice hits the stop string while its siblings run on. Each choice's streamed
    text equals its non-streamed text and LLM.generate's (before: a choice cut before its siblings finished was
    streamed with the stop string, decoded here from all its tokens)."""
    from metainfer import SamplingParams

    prompt = [11, 22, 33, 44, 55]
    sampling = dict(n=6, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    free = ref.generate({"prompt_token_ids": prompt}, SamplingParams(**sampling), use_tqdm=False)[0].outputs
    texts = [c.text for c in free]
    stop = None  # two characters early in choice 0 that no other choice has as early
    for i in range(2, len(texts[0]) - 2):
        candidate = texts[0][i:i + 2]
        if candidate.strip() and all(candidate not in t[:i + 1] for t in texts[1:]):
            stop = candidate
            break
    assert stop is not None, texts
    exp = ref.generate({"prompt_token_ids": prompt}, SamplingParams(**sampling, stop=[stop]), use_tqdm=False)[0]
    exp = sorted(exp.outputs, key=lambda c: c.index)
    assert exp[0].finish_reason == "stop" and len(exp[0].token_ids) < max(len(c.token_ids) for c in exp), exp
    body = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=7, n=6, stop=[stop],
                extra_body={"ignore_eos": True})
    full = sorted(pclient.completions.create(**body).choices, key=lambda c: c.index)
    streamed = [""] * 6
    for chunk in pclient.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [c.text for c in full] == [c.text for c in exp]
    assert streamed == [c.text for c in exp]


def test_validation_in_the_engine_process_is_a_400(proc_server):
    """Checks that need the engine (the context length, the vocabulary) answer 400 naming the field."""
    assert_error(post(proc_server, "/v1/completions", {"model": MODEL, "prompt": [1] * 5000, "max_tokens": 4}),
                 400, "prompt")
    assert_error(post(proc_server, "/v1/completions", {"model": MODEL, "prompt": [10**7], "max_tokens": 4}),
                 400, "prompt")
    assert_error(post(proc_server, "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}), 400, "prompt")
    assert post(proc_server, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_abort_frees_blocks_across_the_process_boundary(proc_server):
    m0 = _idle(proc_server)
    body = {"model": MODEL, "prompt": make_prompts([30], vocab=512, seed=9)[0], "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", proc_server.url + "/v1/completions", json=body, headers=auth(), timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        m = metrics(proc_server)
        assert m["metainfer:kv_cache_usage_perc"] > 0 and m["metainfer:num_requests_running"] == 1
    m = _idle(proc_server)  # the engine process freed the request's blocks and said so
    assert m["metainfer:request_aborted_total"] == m0["metainfer:request_aborted_total"] + 1
    assert m["metainfer:generation_tokens_total"] - m0["metainfer:generation_tokens_total"] < 400


def test_cached_tokens_and_prefix_metrics_come_from_the_engine_process(proc_server, pclient):
    prompt = make_prompts([80], vocab=512, seed=21)[0]
    m0 = _idle(proc_server)
    first = pclient.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = pclient.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64  # whole 16-token blocks of the 80
    m = _idle(proc_server)
    assert m["metainfer:prefix_cache_queries_total"] - m0["metainfer:prefix_cache_queries_total"] >= 160
    assert m["metainfer:prefix_cache_hits_total"] - m0["metainfer:prefix_cache_hits_total"] >= 64


def test_engine_step_intervals_are_observed_between_steps_of_a_busy_engine(proc_server, pclient):
    """One request of 12 tokens from an idle engine: its step messages give intervals (the first after idle gives
    none, so fewer observations than tokens), each between two of the request's tokens, so their sum is within
    the request's own time from first token to last (the ITL histogram's sum, observed in this process)."""
    prompt = make_prompts([20], vocab=512, seed=23)[0]
    m0 = _idle(proc_server)
    pclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    m = _idle(proc_server)
    name = "metainfer:engine_step_interval_seconds"
    count = m[f"{name}_count"] - m0[f"{name}_count"]
    total = m[f"{name}_sum"] - m0[f"{name}_sum"]
    itl_total = m["metainfer:inter_token_latency_seconds_sum"] - m0["metainfer:inter_token_latency_seconds_sum"]
    assert 1 <= count <= 11 and total > 0
    assert total <= itl_total + 0.05, (total, itl_total)


def test_build_error_is_forwarded_as_one_line(model_dir):
    before = {p.pid for p in mp.active_children()}
    with pytest.raises(ConfigError) as info:
        build_app({"model": model_dir, "device": "cpu", "dtype": "float32", "max_num_seqs": 0})
    assert "max_num_seqs" in str(info.value) and "\n" not in str(info.value)
    assert {p.pid for p in mp.active_children()} <= before  # the failed engine process is gone


@pytest.mark.slow  # a fresh interpreter spawns and builds an engine process
def test_an_app_that_is_never_run_does_not_hang_the_exit(model_dir, tmp_path):
    """build_app(dict) starts the engine process (not a daemon: it spawns TP ranks); a program that never runs
    the app and returns must still exit, and the engine process with it (it blocked reading a pipe the exiting
    program held open, and multiprocessing joined it forever)."""
    script = tmp_path / "unrun_app.py"
    script.write_text(
        "from metainfer.entrypoints.openai.api_server import build_app\n"
        "if __name__ == '__main__':\n"
        f"    app = build_app({{'model': {model_dir!r}, 'device': 'cpu', 'dtype': 'float32'}})\n"
        "    print('engine pid', app.state.server.handle.pid, flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script)], cwd=root, env={**os.environ, "PYTHONPATH": root},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = int(proc.stdout.split("engine pid")[1].split()[0])
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]


def test_engine_process_crash_fails_requests_and_health(proc_server):
    """Last in this module: SIGKILL the engine mid-stream. The stream ends with an error event, /health and new
    requests answer 503, nothing hangs."""
    body = {"model": MODEL, "prompt": make_prompts([8], vocab=512, seed=2)[0], "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", proc_server.url + "/v1/completions", json=body, headers=auth(), timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(proc_server.state.handle.pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "engine_error" and "not running" in error["message"]
    assert_error(httpx.get(proc_server.url + "/health", timeout=10), 503, code="engine_dead")
    assert_error(post(proc_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}), 503,
                 code="engine_dead")
    assert metrics(proc_server)["metainfer:engine_errors_total"] >= 1
