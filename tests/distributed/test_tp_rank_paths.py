"""Tensor parallelism's rank processes in the quick gates (CPU, gloo, fp32, seconds): a tiny Qwen3 at TP=2 with
rank 1 a spawned worker (TPDriver, worker_main, build_rank_runner), against HF: greedy ids equal, logprobs equal to
fp32 noise along them (a 1% change of one rank's weights moves them where it moves no greedy token), and every rank
holding exactly the requested `num_kv_blocks`. (test_tp_launched_pair.py starts the ranks as a launcher does.)
Also the rank-side pieces that otherwise run only inside rank processes, checked here: a group of one (its
all-reduce is the identity; a second join is refused), the pipe's send, the heartbeat's lost-rank answer, the launch
fingerprint's weight files and mismatch message."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from metainfer import LLM
from metainfer.config import EngineConfig, ModelSpec
from metainfer.distributed.external_launcher import first_mismatch, weight_files
from metainfer.distributed.heartbeat import Heartbeat
from metainfer.distributed.parallel_state import create_store, destroy_tp_group, get_group_all_reduce, init_tp_group
from metainfer.worker.tp.launched import follow_rank0
from metainfer.worker.tp.protocol import send, try_send
from tests.helpers.processes import alive
from tests.helpers.tp_reference import assert_logprobs_match_hf, hf_reference, run

pytestmark = pytest.mark.tp

NUM_BLOCKS = 16  # requested exactly: every rank must allocate this many


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tp-rank-paths"))
    return folder, *hf_reference(folder)


@pytest.mark.slow  # a worker process starts and builds (5-10 s on 2 shared cores); P9 quick runs it
def test_spawned_ranks_equal_hf(reference):
    """LLM(tensor_parallel_size=2): rank 0 in this process, rank 1 a spawned worker; no worker outlives close().
    A spawned engine is no launched follower: follow_rank0 returns False and leaves it open."""
    folder, prompts, ids, logprobs = reference
    llm = LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=NUM_BLOCKS)
    try:
        pids = llm.llm_engine.tp_driver.worker_pids
        assert len(pids) == 1 and alive(pids[0])
        assert llm.llm_engine.runner.num_blocks == NUM_BLOCKS
        assert follow_rank0(llm) is False
        got_ids, got_logprobs = run(llm, prompts)
    finally:
        llm.close()
    assert not alive(pids[0]), "the worker outlived close()"
    assert got_ids == ids
    assert_logprobs_match_hf(got_logprobs, logprobs)


def test_a_group_of_one_reduces_to_its_input_and_is_joined_once():
    """The all-reduce a rank gets on joining a group of one is the identity (a sum over one rank); a process
    joins one group: a second join is refused."""
    store = create_store(1)
    init_tp_group(0, 1, store, torch.device("cpu"))
    try:
        x = torch.randn(3, 5)
        assert torch.equal(get_group_all_reduce()(x.clone()), x)
        with pytest.raises(ValueError, match="twice"):
            init_tp_group(0, 1, store, torch.device("cpu"))
    finally:
        destroy_tp_group()
    assert not dist.is_initialized()


def test_send_delivers_the_message_and_fails_when_the_peer_is_gone():
    """A message arrives as sent; a send to a worker whose end is closed raises (rank 0 learns the worker is gone),
    where try_send, the send of the error paths, goes on."""
    ours, theirs = multiprocessing.Pipe(duplex=True)
    send(ours, ("step", [1, 2]))
    assert pickle.loads(theirs.recv_bytes()) == ("step", [1, 2])
    theirs.close()
    with pytest.raises(OSError):
        send(ours, ("close",))
    try_send(ours, ("close",))
    ours.close()


def test_the_heartbeat_names_the_rank_that_does_not_beat():
    """Of three ranks, rank 1 beats and rank 2 never did (nor closed): rank 0 is told that rank 2 is gone."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    # dead_after_s is long: rank 1's thread would end this process if ranks 0 and 2 stayed silent that long
    watcher, beating = (Heartbeat("127.0.0.1", master.port, rank, 3, "hb", dead_after_s=60.0) for rank in (0, 1))
    beating.start()
    try:
        assert watcher.lost_ranks() == [2]
    finally:
        beating.stop()


def test_the_launch_fingerprint_lists_the_weight_files_and_words_a_mismatch(reference):
    """Every *.safetensors file of the folder with its size and a 16-hex-digit digest; a mismatch is one message
    naming the field, both values and both ranks."""
    folder = reference[0]
    config = EngineConfig(folder, device="cpu")
    config.model_dir, config.gguf_file = folder, None
    config.finalize(ModelSpec.from_file(os.path.join(folder, "config.json")))
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    listed = weight_files(config)
    assert [(name, size) for name, size, _ in listed] == [(f, os.path.getsize(os.path.join(folder, f))) for f in files]
    assert all(len(digest) == 16 and int(digest, 16) >= 0 for _, _, digest in listed)
    assert first_mismatch([{"a": "1", "b": "2"}, {"a": "1", "b": "2"}]) is None
    assert first_mismatch([{"a": "1", "b": "2"}, {"a": "1", "b": "3"}]) == (
        "ranks disagree on b: 3 on rank 1, 2 on rank 0; every rank must be started with the same model and engine "
        "options")


def test_a_rank_spawned_by_a_process_that_ignores_sigterm_still_ends_on_terminate():
    """The server's engine process ignores SIGTERM and spawns the ranks, which would inherit that; TPDriver.shutdown
    ends a rank that does not close with terminate(). Here the parent ignores SIGTERM while the rank starts; the
    rank, waiting in the group's rendezvous for a rank 0 that never joins, must not ignore it."""
    import signal
    import time
    from types import SimpleNamespace

    from metainfer.distributed.parallel_state import create_store
    from metainfer.worker.tp.rank import worker_main

    ctx = multiprocessing.get_context("spawn")
    store = create_store(2)
    parent_conn, child_conn = ctx.Pipe()
    config = SimpleNamespace(torch_device=torch.device("cpu"), enable_custom_all_reduce=False)
    saved = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        proc = ctx.Process(target=worker_main, args=(1, 2, store.port, config, child_conn, os.getpid()), daemon=True)
        proc.start()
    finally:
        signal.signal(signal.SIGTERM, saved)
    try:
        assert parent_conn.poll(60), "the rank said nothing"
        assert pickle.loads(parent_conn.recv_bytes())[0] == "hello"
        with open(f"/proc/{proc.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn")).split()[1], 16)
        assert not ignored >> (signal.SIGTERM - 1) & 1, "the rank ignores SIGTERM"
        assert ignored >> (signal.SIGINT - 1) & 1, "the rank should ignore SIGINT (rank 0 decides)"
        start = time.monotonic()
        proc.terminate()
        proc.join(5)
        assert not proc.is_alive() and time.monotonic() - start < 1.0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
