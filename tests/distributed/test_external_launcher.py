"""Scale-out launch (`distributed_executor_backend="external_launcher"`) under torchrun on the CPU (gloo, fp32).

The end-to-end tests start `python -m torch.distributed.run` in subprocesses running tests/helpers/spmd_generate.py:
one node with two ranks, and two "nodes" (two torchrun calls, --nnodes 2, on the loopback address) with TP=2 and
TP=4. Every rank's generate must return exactly the TP=1 greedy ids (themselves checked against HF). The fault
tests kill a rank mid-generate, start one node only, hold a rank back from joining, and give one rank another
max_model_len. Every process (torchrun and each rank, by the pid the script writes first) must be gone when a
test ends; a finally kills whatever is left. The unit tests cover the pieces without processes.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from metainfer import LLM, SamplingParams
from metainfer.config import ConfigError, EngineConfig, ModelSpec
from metainfer.distributed.external_launcher import (
    LauncherEnv,
    check_launch,
    config_fingerprint,
    first_mismatch,
    launched_device,
    read_launcher_env,
)
from metainfer.distributed.store_channel import StoreChannel
from metainfer.worker.tp.launched import call_fingerprint, describe_difference
from tests.helpers.engine_checks import generate_ids
from tests.helpers.processes import alive, wait_gone
from tests.helpers.tiny_models import build_tiny_model, hf_greedy, make_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "helpers", "spmd_generate.py")
VOCAB = 509  # prime: the vocabulary is padded on every tp > 1
LENGTHS = [1, 7, 16, 33]
NEW_TOKENS = 12
RUN_LIMIT_S = 240  # one torchrun run (model build on every rank, two generate calls), on 2 shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """One job: `nodes` torchrun calls of `nproc` ranks each on 127.0.0.1, started together; `finish()` waits for
    them, `kill()` (always called) ends every torchrun and every rank that wrote its pid."""

    def __init__(self, tmp_path, model: str, prompts_file: str, nodes: int, nproc: int, *script_args: str,
                 node_ranks: list[int] | None = None, rdzv_timeout: int = 60):
        self.out = str(tmp_path / "out")
        os.makedirs(self.out, exist_ok=True)
        self.tp = nodes * nproc
        port = free_port()
        self.logs, self.procs = [], []
        args = ["--model", model, "--tp", str(self.tp), "--out", self.out, "--prompts", prompts_file,
                "--max-tokens", str(NEW_TOKENS), *script_args]
        for node in node_ranks if node_ranks is not None else range(nodes):
            log_path = str(tmp_path / f"node{node}.log")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "--rdzv-conf", f"timeout={rdzv_timeout}", SCRIPT, *args]
            with open(log_path, "w") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                   start_new_session=True))
            self.logs.append(log_path)

    def finish(self, timeout: float = RUN_LIMIT_S) -> list[int]:
        """Each torchrun's exit code (TimeoutError past `timeout`)."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"torchrun did not end within {timeout:.0f} s:\n{self.output()}") from None
        return codes

    def rank_pids(self) -> list[int]:
        pids = []
        for path in glob.glob(os.path.join(self.out, "pid*")):
            with open(path) as f:
                text = f.read().strip()
            if text:
                pids.append(int(text))
        return pids

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in self.rank_pids():  # ranks run in sessions of their own
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)

    def output(self, node: int | None = None) -> str:
        paths = self.logs if node is None else [self.logs[node]]
        return "\n".join(open(p, errors="replace").read() for p in paths)

    def results(self) -> list[dict]:
        out = []
        for rank in range(self.tp):
            with open(os.path.join(self.out, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny Qwen3 (4 heads, 2 KV heads: TP=4 replicates each KV head on two ranks), its prompts, and the TP=1
    greedy ids, which equal HF's."""
    folder = tmp_path_factory.mktemp("launcher-model")
    model = build_tiny_model(str(folder), "qwen3", vocab_size=VOCAB)
    prompts = make_prompts(LENGTHS, vocab=VOCAB, seed=7)
    prompts_file = str(folder / "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    try:
        expected = generate_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.close()
    assert expected == hf_greedy(model, prompts, NEW_TOKENS)
    return str(folder), prompts_file, expected


def run_to_end(launch: Launch, timeout: float = RUN_LIMIT_S) -> list[int]:
    try:
        return launch.finish(timeout)
    finally:
        launch.kill()
        assert not wait_gone(launch.rank_pids(), timeout=15), "a rank outlived its torchrun"


# -- end to end -------------------------------------------------------------------------------------------
@pytest.mark.tp
@pytest.mark.slow
@pytest.mark.parametrize("nodes,nproc", [(1, 2), (2, 1), (2, 2)], ids=["1node-tp2", "2nodes-tp2", "2nodes-tp4"])
def test_every_rank_returns_the_tp1_outputs(reference, tmp_path, nodes, nproc):
    folder, prompts_file, expected = reference
    launch = Launch(tmp_path, folder, prompts_file, nodes, nproc)
    codes = run_to_end(launch)
    assert codes == [0] * nodes, launch.output()
    results = launch.results()
    for record in results:
        assert record["token_ids"] == expected, f"rank {record['rank']}"
        assert record["finish_reasons"] == ["length"] * len(expected)
        assert record["second_call"] == expected[0], f"rank {record['rank']}: a later generate call"
        # refused calls raise the same ValueError on every rank, and the group goes on
        assert record["refused"]["bad_prompt"].startswith("prompt_token_ids contain ids outside [0, 509)")
        assert record["refused"]["different_args"] == (
            f"generate() got different arguments on rank {launch.tp - 1} (3 prompt(s) against rank 0's 4); under "
            "the external launcher every rank must pass the same prompts and sampling params")
    # rank 0 alone shows progress: the bar is on node 0's output only, once
    if nodes == 2:
        assert "Processed prompts" in launch.output(0) and "Processed prompts" not in launch.output(1)
    assert launch.output().count("Processed prompts: 100%") == 1


@pytest.mark.tp
@pytest.mark.slow
def test_processes_started_without_torchrun_agree_too(reference, tmp_path):
    """The same variables set by hand (as srun or a job script would): rank 0 hosts the store itself, so its
    close waits until the follower has read the close."""
    folder, prompts_file, expected = reference
    out = tmp_path / "out"
    out.mkdir()
    port, procs = free_port(), []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            procs.append(subprocess.Popen([sys.executable, SCRIPT, "--model", folder, "--tp", "2", "--out", str(out),
                                           "--prompts", prompts_file, "--max-tokens", str(NEW_TOKENS)],
                                          cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=RUN_LIMIT_S)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for rank in range(2):
        with open(out / f"rank{rank}.json") as f:
            assert json.load(f)["token_ids"] == expected


@pytest.mark.tp
@pytest.mark.slow
def test_serve_runs_the_api_server_on_rank0_only(reference, tmp_path):
    """`torchrun --no-python metainfer serve ... --distributed-executor-backend external_launcher`: rank 0 answers
    HTTP with the TP=1 text, rank 1 follows; SIGTERM ends every process."""
    import httpx

    folder, _, _ = reference
    prompt = make_prompts([9], vocab=VOCAB, seed=11)[0]
    llm = LLM(folder, device="cpu", dtype="float32")
    try:
        want = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.close()
    http_port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--no-python", os.path.join(os.path.dirname(sys.executable), "metainfer"),
           "serve", "--model", folder, "--device", "cpu", "--dtype", "float32", "--tp", "2", "--port", str(http_port),
           "--distributed-executor-backend", "external_launcher", "--served-model-name", "tiny"]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            ranks = [int(x) for x in f.read().split()]
        assert len(ranks) == 2
        body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == want.outputs[0].text
        assert reply["usage"]["completion_tokens"] == NEW_TOKENS
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        assert not wait_gone(ranks, timeout=15), "a rank outlived torchrun"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in ranks:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.tp
@pytest.mark.slow
def test_bench_latency_measures_on_rank0_only(reference, tmp_path):
    """`metainfer bench latency` under torchrun: rank 0 measures, prints and writes the JSON; rank 1 follows."""
    folder, _, _ = reference
    out_json = tmp_path / "latency.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--no-python", os.path.join(os.path.dirname(sys.executable), "metainfer"),
           "bench", "latency", "--model", folder, "--device", "cpu", "--dtype", "float32", "--tp", "2",
           "--distributed-executor-backend", "external_launcher", "--batch-size", "2", "--input-len", "16",
           "--output-len", "8", "--iters", "2", "--warmup", "1", "--output-json", str(out_json)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=RUN_LIMIT_S)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output
    assert output.count("batch 2 in 16 out 8: TTFT") == 1, output
    with open(out_json) as f:
        record = json.load(f)
    assert record["tp"] == 2 and record["ttft_ms"] > 0 and record["tpot_ms"] > 0


@pytest.mark.gpu
@pytest.mark.tp
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_ranks_on_two_gpus_equal_spawn_mode(reference, tmp_path):
    """NCCL, one GPU a rank (cuda:LOCAL_RANK), fp32: every launched rank returns exactly what the spawn mode's TP=2
    on the same two GPUs returns (same kernels, same all-reduce), and the first token of each prompt equals TP=1's."""
    folder, prompts_file, _ = reference
    with open(prompts_file) as f:
        prompts = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = {}
    for tp in (1, 2):
        llm = LLM(folder, device="cuda", dtype="float32", tensor_parallel_size=tp)
        try:
            want[tp] = generate_ids(llm, prompts, params)
        finally:
            llm.close()
    launch = Launch(tmp_path, folder, prompts_file, 1, 2, "--device", "cuda")
    codes = run_to_end(launch)
    assert codes == [0], launch.output()
    for record in launch.results():
        assert record["token_ids"] == want[2], f"rank {record['rank']}"
        assert [ids[0] for ids in record["token_ids"]] == [ids[0] for ids in want[1]]


# -- faults -----------------------------------------------------------------------------------------------
@pytest.mark.tp
@pytest.mark.slow
@pytest.mark.parametrize("dying,survivor,message", [
    (1, 0, "tensor-parallel rank 0: a step failed"),  # rank 0 is in the step's all-reduce: gloo fails at once
    (0, 1, "rank 1 lost rank 0"),  # rank 1 waits for the step rank 0 never sends: its channel fails at once
], ids=["follower-dies", "rank0-dies"])
def test_a_rank_killed_mid_generate_ends_every_rank(reference, tmp_path, dying, survivor, message):
    """One rank (one node each) is SIGKILLed in its third step: the other raises one clear error, both torchrun
    calls exit non-zero, no process is left."""
    folder, prompts_file, _ = reference
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--die-rank", str(dying), "--die-at-step", "3")
    start = time.monotonic()
    codes = run_to_end(launch)
    assert all(code != 0 for code in codes), launch.output()
    assert message in launch.output(survivor), launch.output(survivor)
    assert time.monotonic() - start < RUN_LIMIT_S
    assert not glob.glob(os.path.join(launch.out, "rank*.json")), "no rank may report a result"


@pytest.mark.tp
@pytest.mark.slow
def test_a_rank_that_vanishes_while_rank0_idles_ends_rank0(reference, tmp_path):
    """Rank 1 (node 1) exits after a generate while rank 0 idles (no collective would notice, as in a server
    without traffic): the heartbeat ends rank 0 within distributed_timeout_s (8 s here), naming rank 1."""
    folder, prompts_file, _ = reference
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--vanish-rank", "1", "--idle-s", "300", "--timeout", "8")
    start = time.monotonic()
    codes = run_to_end(launch, timeout=150)
    assert all(code != 0 for code in codes), launch.output()
    assert "tensor-parallel rank 1 stopped: no heartbeat for" in launch.output(0), launch.output(0)
    assert time.monotonic() - start < 150


@pytest.mark.tp
@pytest.mark.slow
def test_one_node_alone_fails_after_the_rendezvous_timeout(reference, tmp_path):
    """Only node 0 of two is started: torchrun's rendezvous gives up after --rdzv-conf timeout with a message
    saying how many nodes came; no rank is ever started."""
    folder, prompts_file, _ = reference
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, node_ranks=[0], rdzv_timeout=5)
    start = time.monotonic()
    codes = run_to_end(launch, timeout=60)
    assert codes[0] != 0
    assert time.monotonic() - start < 40
    assert "1/2 clients joined" in launch.output()
    assert not launch.rank_pids()


@pytest.mark.tp
@pytest.mark.slow
def test_a_rank_that_never_joins_fails_the_others_naming_it(reference, tmp_path):
    """Rank 1 starts but never builds an engine: rank 0 waits distributed_timeout_s, then fails naming rank 1;
    torchrun ends rank 1 too."""
    folder, prompts_file, _ = reference
    launch = Launch(tmp_path, folder, prompts_file, 1, 2, "--stall-rank", "1", "--timeout", "8")
    codes = run_to_end(launch, timeout=120)
    assert codes[0] != 0, launch.output()
    assert "tensor-parallel rank(s) [1] of 2 did not join within 8 s" in launch.output()


@pytest.mark.tp
@pytest.mark.slow
def test_a_different_max_model_len_is_refused_on_every_rank(reference, tmp_path):
    """Each node runs one rank, so each rank's error reaches its own log before anything stops it."""
    folder, prompts_file, _ = reference
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--max-model-len-on", "1:64")
    codes = run_to_end(launch, timeout=120)
    assert all(code != 0 for code in codes)
    message = "ranks disagree on max_model_len: 64 on rank 1, 512 on rank 0"
    assert message in launch.output(0) and message in launch.output(1), launch.output()


# -- the pieces -------------------------------------------------------------------------------------------
def test_launcher_env_names_what_is_missing_or_wrong():
    with pytest.raises(ConfigError, match="missing: RANK, MASTER_PORT"):
        read_launcher_env({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError, match="RANK=2 is outside WORLD_SIZE=2"):
        read_launcher_env({**base, "RANK": "2"})
    with pytest.raises(ConfigError, match="MASTER_PORT='x' is not an integer"):
        read_launcher_env({**base, "MASTER_PORT": "x"})
    env = read_launcher_env({**base, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert env == LauncherEnv(1, 2, 0, 1, "10.0.0.1", 29500, 2)
    assert not env.single_node and env.key_prefix == "metainfer/2"
    assert read_launcher_env({**base, "LOCAL_WORLD_SIZE": "2"}).single_node


def test_engine_config_checks_the_backend_and_timeout(tmp_path):
    build_tiny_model(str(tmp_path), "qwen3", vocab_size=VOCAB)
    spec = ModelSpec.from_file(str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, external_launcher; "
                                         "got 'ray'"):
        EngineConfig(str(tmp_path), distributed_executor_backend="ray").finalize(spec)
    with pytest.raises(ValueError, match="distributed_timeout_s must be > 0"):
        EngineConfig(str(tmp_path), distributed_timeout_s=0).finalize(spec)
    config = EngineConfig(str(tmp_path), device="cpu", tensor_parallel_size=2,
                          distributed_executor_backend="external_launcher")
    config.finalize(spec)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(2\) must equal the launcher's WORLD_SIZE \(4\)"):
        check_launch(config, LauncherEnv(0, 4, 0, 4, "127.0.0.1", 29500))


def test_a_cuda_rank_takes_gpu_local_rank(monkeypatch):
    """cuda:LOCAL_RANK made current; cuda:0 where the launcher shows each process one GPU; a LOCAL_RANK past the
    node's GPUs is refused naming it. (torch.cuda is faked: the choice is host-side.)"""
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    config = types.SimpleNamespace(torch_device=torch.device("cuda"))
    env = LauncherEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, master_addr="h", master_port=1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launched_device(config, env) == torch.device("cuda", 1) and chosen == [1]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launched_device(config, env) == torch.device("cuda", 0) and chosen == [1, 0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="LOCAL_RANK=3 needs GPU 3, but this node shows 2"):
        launched_device(config, LauncherEnv(3, 8, 3, 4, "h", 1))
    cpu = types.SimpleNamespace(torch_device=torch.device("cpu"))
    assert launched_device(cpu, env) == torch.device("cpu")


def test_without_torchrun_the_llm_names_the_missing_variables(tmp_path, monkeypatch):
    build_tiny_model(str(tmp_path), "qwen3", vocab_size=VOCAB)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="missing: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        LLM(str(tmp_path), device="cpu", distributed_executor_backend="external_launcher")


def test_config_fingerprint_names_the_first_differing_field(tmp_path):
    build_tiny_model(str(tmp_path), "qwen3", vocab_size=VOCAB)
    spec = ModelSpec.from_file(str(tmp_path / "config.json"))

    def fingerprint(**kw):
        config = EngineConfig(str(tmp_path), device="cpu", **kw)
        config.model_dir, config.gguf_file = str(tmp_path), None
        config.finalize(spec)
        return config_fingerprint(config)

    same = fingerprint()
    assert first_mismatch([same, fingerprint(), fingerprint()]) is None
    assert "model.num_layers" in same and "model weights" in same and "model" not in same  # no paths
    message = first_mismatch([same, fingerprint(), fingerprint(block_size=32)])
    assert message.startswith("ranks disagree on block_size: 32 on rank 2, 16 on rank 0")
    other = dict(same, **{"model.hidden_size": "128"})
    assert first_mismatch([same, other]).startswith("ranks disagree on model.hidden_size: 128 on rank 1, 64")


def test_call_fingerprint_tells_prompts_from_params():
    params = SamplingParams(temperature=0.0, max_tokens=4, stop=["a", "b"])
    args = [{"prompt_token_ids": [1, 2]}, params, "hello", params]
    assert call_fingerprint(args) == call_fingerprint([{"prompt_token_ids": [1, 2]}, SamplingParams(
        temperature=0.0, max_tokens=4, stop=["a", "b"]), "hello", params])
    assert describe_difference(call_fingerprint(args), call_fingerprint(args)) is None
    assert describe_difference(call_fingerprint(args[:2]), call_fingerprint(args)) == "1 prompt(s) against rank 0's 2"
    changed = [args[0], params, "hello!", params]
    assert describe_difference(call_fingerprint(changed), call_fingerprint(args)) == "prompt 1 differs from rank 0's"
    hotter = [args[0], SamplingParams(temperature=0.5, max_tokens=4), "hello", params]
    assert describe_difference(call_fingerprint(hotter), call_fingerprint(args)) == (
        "the sampling params of prompt 0 differs from rank 0's")


def _channel_on_rank(rank: int, world: int, port: int) -> dict:
    """One rank of test_store_channel_...: rank 0 sends, the others receive and answer."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    channel = StoreChannel(store, rank, world, "t/msg")
    if rank != 0:
        got = [channel.recv(), channel.recv()]
        channel.reply(2, None if rank == 1 else "differs")
        return {"got": got, "big": len(channel.recv()[1]), "received": channel.received}
    out = {"indices": [channel.send(("step", 1)), channel.send(("call", ["x"]))],
           "replies": channel.replies(2, timeout=20)}
    out["answers_kept"] = store.check(["t/msg/reply/2/1"]) or store.check(["t/msg/reply/2/2"])
    try:
        channel.replies(1, timeout=1)
    except TimeoutError as err:
        out["timeout"] = str(err)
    channel.send(("result", list(range(200_000))))  # an outputs-sized message
    return out


@pytest.mark.tp
@pytest.mark.slow
def test_store_channel_orders_messages_collects_replies_and_forgets():
    """Three ranks over gloo: messages arrive in order on every follower (a large one too), rank 0 collects the
    answers to message 2 and deletes them from the store, and names the ranks that did not answer message 1."""
    from metainfer.distributed.launch import run_on_ranks

    master = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    leader, *followers = run_on_ranks(_channel_on_rank, 3, master.port, timeout=120)
    assert leader["indices"] == [1, 2] and leader["replies"] == {1: None, 2: "differs"}
    assert not leader["answers_kept"]
    assert leader["timeout"].startswith("tensor-parallel rank(s) [1, 2] did not answer rank 0 within 1 s")
    for f in followers:
        assert f == {"got": [("step", 1), ("call", ["x"])], "big": 200_000, "received": 3}
