"""device="mlx" as an option: a clear error without MLX, "auto" never picks it, the options it cannot honour
are refused by name, and `--device mlx` works from the command line (generate, chat, serve, bench latency and
throughput)."""

from __future__ import annotations

import json
import sys

import pytest

from metainfer import LLM
from metainfer.config import ConfigError
from tests.helpers.tiny_models import build_tiny_model

HAS_MLX = __import__("importlib").util.find_spec("mlx") is not None
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="MLX is not installed (pip install 'mlx[cpu]')")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mlx-config"))
    build_tiny_model(path, "qwen3")
    return path


def test_without_mlx_the_error_names_the_install_command(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx", None)  # `import mlx.core` now raises ImportError
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    with pytest.raises(ValueError, match=r"pip install mlx .*pip install 'mlx\[cpu\]'"):
        LLM(folder, device="mlx")


def test_auto_stays_on_torch(folder):
    from metainfer.worker.model_runner import ModelRunner

    llm = LLM(folder, device="auto", num_kv_blocks=8)
    assert type(llm.llm_engine.runner) is ModelRunner


@needs_mlx
@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(async_scheduling=True), "async_scheduling"),
])
def test_options_mlx_cannot_honour_are_named(folder, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LLM(folder, device="mlx", **kwargs)


@needs_mlx
def test_external_launcher_is_refused_under_torchrun_variables(folder, monkeypatch):
    """Even where torchrun's variables are set (so the launcher's own check passes), device='mlx' refuses
    distributed_executor_backend='external_launcher' by name: it runs in one process."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29599").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="device='mlx' runs in one process: distributed_executor_backend"):
        LLM(folder, device="mlx", distributed_executor_backend="external_launcher")


@needs_mlx
def test_a_non_dense_family_is_refused(tmp_path):
    build_tiny_model(str(tmp_path), "qwen3_moe")
    with pytest.raises(ConfigError, match="dense family"):
        LLM(str(tmp_path), device="mlx")


@needs_mlx
def test_mlx_runner_and_dtype_auto_is_the_checkpoint_dtype(folder):
    from metainfer.mlx.model_runner import MLXModelRunner

    llm = LLM(folder, device="mlx", num_kv_blocks=8)
    engine = llm.llm_engine
    assert type(engine.runner) is MLXModelRunner
    assert engine.config.async_scheduling is False
    assert str(engine.runner.dtype) == "mlx.core.float32"  # save_pretrained wrote float32


@needs_mlx
def test_cli_generate_and_bench_latency_with_device_mlx(folder, tmp_path, capsys):
    from metainfer.entrypoints.cli import main

    assert main(["generate", "--model", folder, "--device", "mlx", "--max-tokens", "4", "--json",
                 "--num-kv-blocks", "16", "a1b2c3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out[0]["token_ids"]) >= 1
    record = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", folder, "--device", "mlx", "--num-kv-blocks", "16",
                 "--input-len", "8", "--output-len", "4", "--iters", "1", "--warmup", "0",
                 "--output-json", str(record)]) in (0, None)
    data = json.loads(record.read_text())
    assert data["weight_bytes"] > 0 and data["decode_tok_s"] > 0


@needs_mlx
def test_cli_chat_with_device_mlx(tmp_path, monkeypatch, capsys):
    """Two turns through `metainfer chat --device mlx` (stdin), then an empty line ends it; the chat template's
    ids need the tokenizer's whole vocabulary."""
    from metainfer.entrypoints.cli import main

    folder = str(tmp_path)
    build_tiny_model(folder, "qwen3", vocab_size=151936, num_hidden_layers=1)
    lines = iter(["hello", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", folder, "--device", "mlx", "--num-kv-blocks", "32", "--max-tokens", "3"]) == 0
    assert next(lines, None) is None  # both turns and the empty line were read
    captured = capsys.readouterr()
    assert "error" not in captured.err and captured.out.count("\n") >= 2  # a reply line a turn


@needs_mlx
def test_cli_bench_throughput_with_device_mlx_records_the_device(folder, tmp_path):
    from metainfer.entrypoints.cli import main

    record = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", folder, "--device", "mlx", "--num-kv-blocks", "32",
                 "--num-seqs", "3", "--min-input-len", "4", "--max-input-len", "8", "--min-output-len", "2",
                 "--max-output-len", "4", "--output-json", str(record)]) in (0, None)
    data = json.loads(record.read_text())
    assert data["device"] == "mlx"
    assert data["output_tokens"] >= 6 and data["output_tok_s"] > 0


@needs_mlx
@pytest.mark.slow
def test_cli_serve_with_device_mlx_answers_a_completion(folder):
    """`metainfer serve --device mlx` in its own process answers one completion with exactly the tokens asked."""
    import os
    import subprocess

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from tests.helpers.serve_process import terminate, wait_healthy
    from tests.helpers.server import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port = free_port()
    cmd = [sys.executable, "-m", "metainfer.entrypoints.cli", "serve", "--model", folder, "--device", "mlx",
           "--dtype", "float32", "--num-kv-blocks", "32", "--port", str(port), "--served-model-name", "tiny-mlx",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": root},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, port, timeout=120)
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny-mlx", "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        terminate(proc)
