"""`metainfer bench serve` against the live server, and `metainfer serve` as a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import openai
import pytest

from metainfer.bench import serve as bench_serve
from tests.helpers.serve_process import terminate, wait_healthy
from tests.helpers.server import KEY, MODEL, free_port, wait_idle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.slow  # starts a second Python that loads the model
def test_metainfer_serve_command(model_dir):
    from metainfer.entrypoints import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    port = free_port()
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", model_dir, "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--served-model-name", "tiny-cli", "--api-key", KEY,
           "--max-queued-requests", "8", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, port, timeout=90)
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == ["tiny-cli"]
        r = c.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        terminate(proc)
    assert proc.returncode is not None


def test_cli_imports_without_the_server_extras():
    """`metainfer --help` and `metainfer serve --help` load neither fastapi nor uvicorn (the serve extra)."""
    code = ("import sys\n"
            "from metainfer.entrypoints import cli\n"
            "for argv in (['--help'], ['serve', '--help']):\n"
            "    try:\n"
            "        cli.main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_serve_caps_the_prompt_tokens_of_mixed_steps_by_default_and_offline_does_not():
    """`serve` defaults --max-mixed-prefill-tokens to SERVE_MAX_MIXED_PREFILL_TOKENS (the ITL tail's cap,
    docs/PERFORMANCE.md), `generate` and the benches to none; 0 turns the server's cap off."""
    from metainfer.entrypoints.cli import SERVE_MAX_MIXED_PREFILL_TOKENS, build_parser, engine_kwargs

    parser = build_parser()
    served = parser.parse_args(["serve", "--model", "m"])
    assert served.max_mixed_prefill_tokens == SERVE_MAX_MIXED_PREFILL_TOKENS == 256
    assert engine_kwargs(served)["max_mixed_prefill_tokens"] == 256
    assert engine_kwargs(parser.parse_args(["serve", "--max-mixed-prefill-tokens", "0"]))[
        "max_mixed_prefill_tokens"] is None
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["max_mixed_prefill_tokens"] is None


@pytest.mark.parametrize("argv, option", [
    (["--max-num-seqs", "0"], "--max-num-seqs"), (["--block-size", "0"], "--block-size"),
    (["--max-model-len", "100000"], "--max-model-len"), (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
    (["--tp", "3"], "--tp"),
])
def test_serve_refuses_a_bad_engine_option_before_its_engine_process_starts(model_dir, monkeypatch, capsys, argv,
                                                                            option):
    """One line naming the option, exit 2, and no engine process (api_server.serve is never reached)."""
    from metainfer.entrypoints import cli
    from metainfer.entrypoints.openai import api_server

    def no_engine(*a, **k):
        raise AssertionError("the engine process was started")

    monkeypatch.setattr(api_server, "serve", no_engine)
    assert cli.main(["serve", "--model", model_dir, "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("metainfer: error: ") and option in err[0], err


@pytest.mark.slow  # starts a second Python that loads the model
def test_serve_reads_a_step_message_larger_than_the_pipe_buffer(model_dir):
    """A step's message from the engine process bigger than the output pipe's buffer (64 KiB on Linux): here the
    prompt logprobs of a 500-token prompt (echo, 20 top logprobs: ~300 KB pickled) in one message. The HTTP process
    must wait for all of it: under uvloop the pipe's read end is non-blocking, and a half-arrived message once read
    as the engine's death (a 500, then 503 for every request; found by session 28's README verifier)."""
    port = free_port()
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", model_dir, "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--served-model-name", "tiny-cli", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, port, timeout=90)
        import httpx

        prompt = [(i * 7919) % 50000 + 10 for i in range(500)]  # the tiny model's max_model_len is 512
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": "tiny-cli", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 20})
        assert r.status_code == 200, r.text
        top = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert len(top) == 501 and top[0] is None and all(len(t) >= 20 for t in top[1:])
        assert httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        terminate(proc)
    assert proc.returncode == 0
