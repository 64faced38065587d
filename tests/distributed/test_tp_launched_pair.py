"""Tensor parallelism under the external launcher in the quick gates (CPU, gloo, fp32, seconds): two processes
started as a launcher starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by hand, rank 0 hosting the
store: LaunchedRank, StoreChannel, LeaderLink, the heartbeat), each running the user's script on a tiny Qwen3 at
TP=2. Every rank must return HF's greedy ids with logprobs equal to fp32 noise and hold exactly the requested
`num_kv_blocks`, and a call whose prompts differ on rank 1 is refused on both with one message naming the
difference. (torchrun itself starts the ranks in test_external_launcher.py's slow tests.)"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback

import pytest

from metainfer import LLM
from metainfer.distributed.launch import join_or_kill
from tests.helpers.tp_reference import PARAMS, assert_logprobs_match_hf, hf_reference, run

pytestmark = pytest.mark.tp

NUM_BLOCKS = 16  # requested exactly: every rank must allocate this many
TIMEOUT_S = 30.0  # distributed_timeout_s: how long a rank waits for an answer that does not come
RUN_LIMIT_S = 180  # the pair's whole run on 2 shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launched_rank(rank: int, port: int, folder: str, prompts: list[list[int]], conn) -> None:
    """One rank (a spawned process standing for one torchrun starts): the launcher's variables, then the user's
    script: build, generate, then a call whose prompts differ on rank 1."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # no torchrun agent: rank 0 hosts the store
    try:
        llm = LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=NUM_BLOCKS,
                  distributed_executor_backend="external_launcher", distributed_timeout_s=TIMEOUT_S)
        try:
            record = {"num_blocks": llm.llm_engine.runner.num_blocks}
            record["ids"], record["logprobs"] = run(llm, prompts)
            mine = prompts if rank == 0 else prompts[:-1]
            try:
                llm.generate([{"prompt_token_ids": p} for p in mine], PARAMS, use_tqdm=False)
            except ValueError as err:
                record["refused"] = str(err)
        finally:
            llm.close()
        conn.send(("ok", record))
    except BaseException:
        conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        conn.close()


@pytest.mark.slow  # two rank processes start and build (10-25 s on 2 shared cores); P9 quick runs it
def test_launched_ranks_equal_hf(tmp_path):
    folder = str(tmp_path)
    prompts, ids, logprobs = hf_reference(folder)
    ctx = multiprocessing.get_context("spawn")
    port, procs, conns, records = _free_port(), [], [], []
    try:
        for rank in range(2):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_launched_rank, args=(rank, port, folder, prompts, child_end), daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        deadline = time.monotonic() + RUN_LIMIT_S
        for rank, conn in enumerate(conns):
            assert conn.poll(max(0.0, deadline - time.monotonic())), f"launched rank {rank} did not finish"
            status, value = conn.recv()
            assert status == "ok", value
            records.append(value)
    finally:
        join_or_kill(procs)
    refusal = (f"generate() got different arguments on rank 1 ({len(prompts) - 1} prompt(s) against rank 0's "
               f"{len(prompts)}); under the external launcher every rank must pass the same prompts and sampling "
               "params")
    for rank, record in enumerate(records):
        assert record["num_blocks"] == NUM_BLOCKS, f"rank {rank}"
        assert record["ids"] == ids, f"rank {rank}"
        assert_logprobs_match_hf(record["logprobs"], logprobs)
        assert record["refused"] == refusal, f"rank {rank}"
