"""TP workers' life cycle: bad configurations fail before any worker starts, a failing worker is
reported, and no worker outlives the LLM (closed, left unclosed at exit, or its process killed).
Also the step payload: a batch rebuilt from it prepares exactly the tensors of the real batch."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from metainfer import LLM, SamplingParams
from metainfer.config import EngineConfig, ModelSpec
from metainfer.entrypoints import cli
from metainfer.worker.tp import driver as tp_driver
from tests.helpers.processes import alive, wait_gone
from tests.helpers.tiny_models import build_tiny_model, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 509


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tp-life"))
    build_tiny_model(folder, "qwen3", vocab_size=VOCAB)
    return folder


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail loudly if anything tries to start a worker."""
    def refuse(*a, **k):
        raise AssertionError("a worker process was started")
    monkeypatch.setattr(tp_driver.mp, "get_context", refuse)


def _config(tp, device="cpu", **overrides) -> EngineConfig:
    cfg = EngineConfig(model="unused", device="cpu", dtype="float32", tensor_parallel_size=tp)
    cfg.finalize(ModelSpec.from_dict(tiny_config("qwen3", **overrides).to_dict()))
    cfg.torch_device = torch.device(device)
    return cfg


# -- errors before any worker starts -------------------------------------------------------------
def test_heads_not_divisible_through_llm(model_dir, no_spawn):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(model_dir, device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize("tp,overrides,message", [
    (2, dict(num_attention_heads=6, num_key_value_heads=3), r"num_key_value_heads \(3\) is not divisible"),
    (4, dict(num_attention_heads=12, num_key_value_heads=3), r"not a multiple of num_key_value_heads \(3\)"),
    (4, dict(intermediate_size=130), r"intermediate_size \(130\)"),
])
def test_bad_splits_fail_before_spawn(no_spawn, tp, overrides, message):
    with pytest.raises(ValueError, match=message):
        tp_driver.TPDriver(_config(tp, **overrides))


def test_more_ranks_than_gpus_fails_before_spawn(no_spawn, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is larger than the number of visible GPUs"):
        tp_driver.TPDriver(_config(2, device="cuda"))


# -- a failing worker ----------------------------------------------------------------------------
def hook_fail_in_worker():
    raise RuntimeError("injected worker start-up failure")


@pytest.mark.tp
def test_worker_failure_is_reported_and_cleaned_up(model_dir, monkeypatch):
    monkeypatch.setattr(tp_driver.TPDriver, "worker_hooks", (hook_fail_in_worker,))
    with pytest.raises(RuntimeError, match="injected worker start-up failure"):
        LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    assert not dist.is_initialized(), "rank 0 left the process group behind"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("metainfer-tp")]


def _raise_on_step(self, batch):
    raise RuntimeError("injected step failure")


def hook_fail_on_step():
    from metainfer.worker.model_runner import ModelRunner
    ModelRunner.execute = _raise_on_step


@pytest.mark.tp
def test_worker_failure_mid_step_is_reported(model_dir, monkeypatch):
    monkeypatch.setattr(tp_driver.TPDriver, "worker_hooks", (hook_fail_on_step,))
    llm = LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    pids = llm.llm_engine.tp_driver.worker_pids
    prompt = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="unusable"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 5
    assert not [p for p in pids if alive(p)] and not dist.is_initialized()


@pytest.mark.tp
def test_a_build_that_fails_after_the_workers_started_closes_them(model_dir, monkeypatch):
    """The TP workers are up and rank 0's runner is built, then the engine's KV block manager raises: the caller gets
    that error, and the engine gave the workers and the process group back before raising (nothing is left for a
    finalizer: the error's traceback still holds the engine)."""
    import metainfer.engine.llm_engine as llm_engine

    pids = []
    build_runner = tp_driver.TPDriver.build_runner

    def recording_build_runner(self, *args, **kwargs):
        runner = build_runner(self, *args, **kwargs)
        pids.extend(self.worker_pids)
        return runner

    def fail(*args, **kwargs):
        raise RuntimeError("the KV block manager failed")

    monkeypatch.setattr(tp_driver.TPDriver, "build_runner", recording_build_runner)
    monkeypatch.setattr(llm_engine, "BlockManager", fail)
    with pytest.raises(RuntimeError, match="the KV block manager failed") as info:
        LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    assert pids and not wait_gone(pids, timeout=10), "a worker outlived the failed build"
    assert not dist.is_initialized(), "rank 0 left the process group behind"
    del info  # held the failed engine (its traceback's frames) through the checks


# -- no orphans ----------------------------------------------------------------------------------
@pytest.mark.tp
def test_close_is_idempotent_and_reaps_workers(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    pids = llm.llm_engine.tp_driver.worker_pids
    assert pids and all(alive(p) for p in pids)
    llm.close()
    assert not [p for p in pids if alive(p)]
    llm.close()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)


SCRIPT = textwrap.dedent("""
    import logging, sys, time
    from metainfer import LLM, SamplingParams
    if __name__ == "__main__":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
        print("PIDS", *llm.llm_engine.tp_driver.worker_pids, flush=True)
        if sys.argv[2] == "hang":
            time.sleep(600)
        # else: exit without close(); the finalizer must stop the workers
""")


def _start_script(tmp_path, model_dir, mode):
    """Run SCRIPT; return (process, worker pids) once the workers have served a request."""
    path = tmp_path / "tp_script.py"
    path.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, str(path), model_dir, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("PIDS"):
            return proc, [int(p) for p in line.split()[1:]]
    proc.wait()
    raise AssertionError(f"script failed: {proc.stderr.read()}")


@pytest.mark.tp
def test_unclosed_llm_stops_workers_at_exit(tmp_path, model_dir):
    proc, pids = _start_script(tmp_path, model_dir, "exit")
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    rest = proc.stdout.read()
    assert "stopped 1 worker(s), exit codes [0]" in rest, "the finalizer did not shut the worker down"
    assert not wait_gone(pids, timeout=5)


@pytest.mark.tp
def test_killed_parent_leaves_no_orphans(tmp_path, model_dir):
    proc, pids = _start_script(tmp_path, model_dir, "hang")
    assert all(alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not wait_gone(pids), "workers outlived their killed parent"


# -- CLI ----------------------------------------------------------------------------------------
@pytest.mark.tp
def test_cli_tp_flag_reaches_the_engine(model_dir, capsys):
    p = argparse.ArgumentParser()
    cli.add_engine_args(p)
    assert cli.engine_kwargs(p.parse_args(["--model", model_dir, "--tp", "2"]))["tensor_parallel_size"] == 2
    args = ["generate", "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--max-tokens", "6",
            "--json", "a1b2c3"]  # Qwen tokenizes digits one by one: ids < 509
    cli.main(args)
    single = json.loads(capsys.readouterr().out)
    cli.main(args + ["--tp", "2"])
    assert json.loads(capsys.readouterr().out) == single
    assert not dist.is_initialized()


