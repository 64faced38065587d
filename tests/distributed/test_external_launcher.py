"""Scale-out launch (`distributed_executor_backend="external_launcher"`) under torchrun on the CPU (gloo, fp32).

The end-to-end tests start `python -m torch.distributed.run` in subprocesses running tests/helpers/spmd_generate.py:
one node with two ranks, and two "nodes" (two torchrun calls, --nnodes 2, on the loopback address) with TP=2 and
TP=4. Every rank's generate must return exactly the TP=1 greedy ids (themselves checked against HF). The fault
tests kill a rank mid-generate, start one node only, hold a rank back from joining, and give one rank another
max_model_len, or another model. Every process (torchrun and each rank, by the pid the script writes first) must
be gone (within LEFTOVER_S) once torchrun has ended, checked before anything is killed; a finally then kills
whatever is left. The fault tests check the survivor's first error line exactly and time how long the others take
to end after the fault (the script stamps the moment). The unit tests cover the pieces without processes.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
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
LEFTOVER_S = 15  # a rank may outlive its torchrun by this much (torchrun SIGTERMs, then SIGKILLs its workers)
# torchrun's own teardown once a rank has ended (it stops the node's other ranks, then the other nodes' agents see
# the rendezvous close): the margin the fault tests add to the documented bound, on 2 shared cores
TEARDOWN_S = 30
# a traceback's exception line (torchrun prefixes [rankN]:) or a logged error (the script's format: "ERROR name: ")
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s*(?:[\w.]+\.)?(\w+Error): (.*)$|^(?:\[rank\d+\]:)?ERROR metainfer: (.*)$")


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
        """Each torchrun's exit code (TimeoutError past `timeout`); `ended_at[i]`: time.time() when torchrun i was
        seen to have ended (polled every 0.1 s)."""
        deadline = time.monotonic() + timeout
        self.ended_at = [None] * len(self.procs)
        while any(t is None for t in self.ended_at):
            for i, proc in enumerate(self.procs):
                if self.ended_at[i] is None and proc.poll() is not None:
                    self.ended_at[i] = time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun did not end within {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.1)
        return [proc.returncode for proc in self.procs]

    def stamp(self, name: str) -> float:
        """A time.time() the script wrote (start{rank}: before building the engine; fault{rank}: as it died)."""
        with open(os.path.join(self.out, name)) as f:
            return float(f.read())

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
    """Wait for every torchrun, then check (before killing anything) that no rank outlives them by LEFTOVER_S;
    the kill in the finally is cleanup only."""
    try:
        codes = launch.finish(timeout)
        left = wait_gone(launch.rank_pids(), timeout=LEFTOVER_S)
        assert not left, f"rank process(es) {left} outlived their torchrun by {LEFTOVER_S} s"
        return codes
    finally:
        launch.kill()


def test_run_to_end_reports_a_rank_that_outlives_torchrun(tmp_path, monkeypatch):
    """The leftover check runs before the cleanup kill: a rank still alive LEFTOVER_S after its torchrun ended fails
    the test (here a sleeping process stands for the rank, a finished one for torchrun), and is killed after."""
    monkeypatch.setattr(sys.modules[__name__], "LEFTOVER_S", 1)
    launch = Launch.__new__(Launch)
    launch.out = str(tmp_path)
    launch.procs = [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)]
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    (tmp_path / "pid0").write_text(str(rank.pid))
    try:
        with pytest.raises(AssertionError, match=rf"rank process\(es\) \[{rank.pid}\] outlived their torchrun"):
            run_to_end(launch, timeout=30)
        assert rank.wait(timeout=10) == -signal.SIGKILL  # the finally's cleanup
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def first_error_line(text: str) -> str:
    """The first line of a log that reports an error (a traceback's exception line or a logged ERROR), without
    torchrun's [rankN]: prefix and the exception's module path."""
    for line in text.splitlines():
        m = ERROR_LINE.match(line)
        if m:
            return f"{m.group(1)}: {m.group(2)}" if m.group(1) else m.group(3)
    return ""


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
        # a call invalid on the last rank alone (its local check) is agreed first: every rank raises it
        assert record["refused"]["bad_params"] == (
            f"sampling_params has 2 entries for 1 prompts (on rank {launch.tp - 1}; every rank raises this)")
    # rank 0 alone shows progress: the bar is on node 0's output only, once
    if nodes == 2:
        assert "Processed prompts" in launch.output(0) and "Processed prompts" not in launch.output(1)
    assert launch.output().count("Processed prompts: 100%") == 1


@pytest.mark.tp
@pytest.mark.slow
def test_every_rank_replays_rank0s_warm_up_while_building(reference, tmp_path):
    """Rank 0's warm-up steps (forced on the CPU, where the torch references plan none) run on every rank before
    its LLM(...) returns, as in spawn mode (issue 23: kernels compiled before serving); outputs are unchanged."""
    folder, prompts_file, expected = reference
    launch = Launch(tmp_path, folder, prompts_file, 1, 2, "--warmup-steps", "6")
    assert run_to_end(launch) == [0], launch.output()
    for record in launch.results():
        assert record["steps_at_build"] == 6, f"rank {record['rank']}"
        assert record["token_ids"] == expected, f"rank {record['rank']}"


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


def metainfer_cmd(*args: str, torchrun: bool) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "metainfer")
    if not torchrun:
        return [exe, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--no-python", exe, *args, "--tp", "2",
            "--distributed-executor-backend", "external_launcher"]


def run_command(cmd: list[str], stdin: str = "") -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one command, killed (its whole session) past RUN_LIMIT_S."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=RUN_LIMIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


@pytest.mark.tp
@pytest.mark.slow
@pytest.mark.parametrize("command,stdin", [
    (["generate", "--json", "The capital of France is", "Hello"], ""),
    (["chat"], "Hello there\nAnd again\n\n"),
], ids=["generate", "chat"])
def test_generate_and_chat_commands_print_once_what_tp1_prints(tmp_path, command, stdin):
    """`torchrun --nproc-per-node 2 --no-python metainfer generate|chat ... --distributed-executor-backend
    external_launcher`: rank 0 prints exactly what the same command prints with one process (TP=1), once; rank 1
    prints nothing of its own. (A one-layer tiny Qwen3 with the tokenizer's whole vocabulary, so text prompts and
    the chat template's ids are in range.)"""
    folder = str(tmp_path / "text-model")
    build_tiny_model(folder, "qwen3", vocab_size=151936, num_hidden_layers=1)
    args = [command[0], "--model", folder, "--device", "cpu", "--dtype", "float32", "--max-tokens", "8",
            *command[1:]]
    code, want, err = run_command(metainfer_cmd(*args, torchrun=False), stdin)
    assert code == 0 and "error" not in want + err, want + err
    if command[0] == "generate":
        records = json.loads(want)
        assert [len(r["token_ids"]) for r in records] == [8, 8] and all(r["text"] for r in records), records
    else:
        assert want.count("\n") >= 2 and "> " not in want[:2], want  # a reply line a turn; no prompt on a pipe
    code, got, err = run_command(metainfer_cmd(*args, torchrun=True), stdin)
    assert code == 0, err
    assert got == want, err


@pytest.mark.tp
@pytest.mark.slow
def test_bench_throughput_measures_on_rank0_only(reference, tmp_path):
    """`metainfer bench throughput` under torchrun: rank 0 runs the requests, prints and writes the record once."""
    folder, _, _ = reference
    out_json = tmp_path / "throughput.json"
    code, out, err = run_command(metainfer_cmd(
        "bench", "throughput", "--model", folder, "--device", "cpu", "--dtype", "float32", "--num-seqs", "4",
        "--min-input-len", "8", "--max-input-len", "16", "--min-output-len", "4", "--max-output-len", "8",
        "--output-json", str(out_json), torchrun=True))
    assert code == 0, err
    with open(out_json) as f:
        record = json.load(f)
    assert record["tp"] == 2 and record["bench"] == "throughput", record
    assert (out + err).count("requests/s") <= 1


def test_bench_baseline_refuses_the_launcher_in_one_line():
    """The HF baseline is one process: the launcher option is refused before any model is read."""
    code, out, err = run_command(metainfer_cmd("bench", "baseline", "--model", "no-such-model",
                                               "--distributed-executor-backend", "external_launcher",
                                               torchrun=False))
    assert code == 2 and err.strip() == (
        "metainfer: error: --distributed-executor-backend: the HF baseline runs in one process on one device and "
        "cannot be launched by torchrun; leave the option out"), err


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
@pytest.mark.parametrize("dying,survivor", [
    (1, 0),  # rank 0 is in the step's all-reduce: gloo fails at once
    (0, 1),  # rank 1 waits for the step rank 0 never sends: its channel fails at once
], ids=["follower-dies", "rank0-dies"])
def test_a_rank_killed_mid_generate_ends_every_rank(reference, tmp_path, dying, survivor):
    """One rank (one node each) is SIGKILLed in its third step: the other's first error line names it (asked of
    the heartbeat), both torchrun calls exit non-zero within the bound (the survivor's ~2 heartbeat beats to name
    the rank, plus torchrun's teardown), no process is left."""
    folder, prompts_file, _ = reference
    timeout = 8
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--die-rank", str(dying), "--die-at-step", "3",
                    "--timeout", str(timeout))
    codes = run_to_end(launch)
    assert all(code != 0 for code in codes), launch.output()
    assert first_error_line(launch.output(survivor)) == (
        f"RankLostError: tensor-parallel rank {dying} stopped; rank {survivor} ends too (the group cannot go on "
        "without it)"), launch.output(survivor)
    assert launch.output(survivor).count("RankLostError") == 1, launch.output(survivor)  # one error, no chain
    took = max(launch.ended_at) - launch.stamp(f"fault{dying}")
    print(f"rank {dying} killed: every torchrun ended {took:.1f} s later")
    assert took < timeout + TEARDOWN_S, launch.output()
    assert not glob.glob(os.path.join(launch.out, "rank*.json")), "no rank may report a result"


@pytest.mark.tp
@pytest.mark.slow
def test_a_rank_that_vanishes_while_rank0_idles_ends_rank0(reference, tmp_path):
    """Rank 1 (node 1) exits after a generate while rank 0 idles (no collective would notice, as in a server
    without traffic): the heartbeat ends rank 0 within distributed_timeout_s (8 s here) and a beat, naming rank 1."""
    folder, prompts_file, _ = reference
    timeout = 8
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--vanish-rank", "1", "--idle-s", "300", "--timeout",
                    str(timeout))
    codes = run_to_end(launch, timeout=150)
    assert all(code != 0 for code in codes), launch.output()
    assert re.fullmatch(r"tensor-parallel rank 1 stopped: no heartbeat for \d+ s; rank 0 ends too \(the group "
                        r"cannot go on without it\)", first_error_line(launch.output(0))), launch.output(0)
    took = launch.ended_at[0] - launch.stamp("fault1")
    print(f"rank 1 vanished: node 0's torchrun ended {took:.1f} s later")
    assert took < timeout + 1 + TEARDOWN_S, launch.output()


@pytest.mark.tp
@pytest.mark.slow
def test_a_frozen_rank0_ends_the_follower_waiting_for_it(reference, tmp_path):
    """Rank 0 (node 0) freezes after a generate (SIGSTOP: a hung host, no connection closes) while rank 1 waits for
    rank 0's next call on the year-long control group: rank 1's heartbeat ends it within distributed_timeout_s
    (8 s) and a beat, naming rank 0, and node 1's torchrun ends. (Node 0's torchrun waits on its stopped worker;
    the test kills it.)"""
    folder, prompts_file, _ = reference
    timeout = 8
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--freeze-rank", "0", "--timeout", str(timeout))
    node1 = launch.procs[1]
    try:
        node1.wait(timeout=RUN_LIMIT_S)
        ended = time.time()
        took = ended - launch.stamp("fault0")
        print(f"rank 0 froze: node 1's torchrun ended {took:.1f} s later")
        assert node1.returncode != 0
        assert re.fullmatch(r"tensor-parallel rank 0 stopped: no heartbeat for \d+ s; rank 1 ends too \(the group "
                            r"cannot go on without it\)", first_error_line(launch.output(1))), launch.output(1)
        assert took < timeout + 1 + TEARDOWN_S, launch.output(1)
        pids = launch.rank_pids()
        assert len(pids) == 2
        rank0 = int(open(os.path.join(launch.out, "pid0")).read())
        assert not wait_gone([p for p in pids if p != rank0], timeout=LEFTOVER_S), "rank 1 outlived its torchrun"
    finally:
        for pid in launch.rank_pids():
            if alive(pid):
                os.killpg(pid, signal.SIGCONT)
        launch.kill()


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
    assert first_error_line(launch.output()).startswith(
        "TimeoutError: tensor-parallel rank(s) [1] of 2 did not join within 8 s"), launch.output()
    # rank 0 starts building at start0; it waits out the join timeout (8 s), then torchrun ends both ranks
    took = launch.ended_at[0] - launch.stamp("start0")
    print(f"rank 1 never joined: torchrun ended {took:.1f} s after rank 0 started building")
    assert took < 8 + TEARDOWN_S, launch.output()


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


@pytest.mark.tp
@pytest.mark.slow
def test_a_different_checkpoint_on_one_rank_is_refused_on_every_rank(reference, tmp_path):
    """Rank 1 is given another checkpoint of the same architecture (same config, same file names and sizes,
    other random weights): the weights digest differs, and every rank refuses with the same message."""
    folder, prompts_file, _ = reference
    other = tmp_path / "other-model"
    build_tiny_model(str(other), "qwen3", seed=1, vocab_size=VOCAB)
    assert os.path.getsize(other / "model.safetensors") == os.path.getsize(os.path.join(folder, "model.safetensors"))
    launch = Launch(tmp_path, folder, prompts_file, 2, 1, "--model-on", f"1:{other}")
    codes = run_to_end(launch, timeout=120)
    assert all(code != 0 for code in codes)
    for node in range(2):
        line = first_error_line(launch.output(node))
        weights = r"\[\('model\.safetensors', \d+, '\w{16}'\)\]"
        want = (rf"ConfigError: ranks disagree on model weights: {weights} on rank 1, {weights} on rank 0; every rank "
                r"must be started with the same model and engine options")
        assert re.fullmatch(want, line), launch.output(node)


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


def test_weights_digest_tells_checkpoints_apart(tmp_path):
    """Same architecture, other random weights: same names and sizes, another digest; a copy has the same one."""
    import shutil

    from metainfer.distributed.external_launcher import weights_digest

    build_tiny_model(str(tmp_path / "a"), "qwen3", seed=0, vocab_size=VOCAB)
    build_tiny_model(str(tmp_path / "b"), "qwen3", seed=1, vocab_size=VOCAB)
    a, b = str(tmp_path / "a" / "model.safetensors"), str(tmp_path / "b" / "model.safetensors")
    shutil.copy(a, tmp_path / "copy.safetensors")
    assert os.path.getsize(a) == os.path.getsize(b)
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(a) == weights_digest(str(tmp_path / "copy.safetensors"))
    with open(tmp_path / "copy.safetensors", "r+b") as f:  # one changed byte inside a sampled read
        f.seek(os.path.getsize(a) - 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert weights_digest(a) != weights_digest(str(tmp_path / "copy.safetensors"))


HEARTBEAT_CHILD = """
import logging, sys, time
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
from metainfer.distributed.heartbeat import Heartbeat
Heartbeat("127.0.0.1", int(sys.argv[1]), 0, 1, "hb", dead_after_s=float(sys.argv[2])).start()
print("started", flush=True)
time.sleep(600)
"""
STORE_HOST = """
import datetime, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["store-ends", "store-freezes"])
def test_a_rank_that_loses_the_store_ends_within_the_bound(fault):
    """The process hosting the rendezvous store (node 0's torchrun) is killed, or frozen (SIGSTOP: a hung or
    cut-off host, where no connection closes): a rank's heartbeat ends it with one error line within
    dead_after_s + a beat (+ 3 s for a loaded machine), instead of the rank waiting on for its collectives."""
    dead_after = 2.0
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    rank = None
    try:
        port = int(host.stdout.readline())
        rank = subprocess.Popen([sys.executable, "-c", HEARTBEAT_CHILD, str(port), str(dead_after)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert rank.stdout.readline().strip() == "started"
        time.sleep(1.0)  # a few beats
        assert rank.poll() is None
        os.kill(host.pid, fault)
        start = time.monotonic()
        rank.wait(timeout=60)
        took = time.monotonic() - start
        print(f"store {signal.Signals(fault).name}: the rank ended {took:.1f} s later (dead_after {dead_after} s)")
        err = rank.stderr.read()
        assert rank.returncode == -signal.SIGTERM, err
        lines = [line for line in err.splitlines() if line.startswith("ERROR")]
        assert lines == ["ERROR metainfer: tensor-parallel rank 0 lost the rendezvous store (node 0 ended, frozen or "
                         "unreachable) and ends (the group cannot go on without it)"], err
        assert took < dead_after + 0.2 + 3.0, took
    finally:
        for proc in (host, rank):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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
