"""Scheduler: the decode batch's row order and the running order that preemption follows."""

from __future__ import annotations

from metainfer.engine.block_manager import BlockManager
from metainfer.engine.scheduler import Scheduler
from metainfer.sampling_params import SamplingParams


def _scheduler_after_prefill(prompt_lens, num_blocks=64, block_size=4):
    from metainfer.engine.sequence import Sequence

    sched = Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=1024, max_model_len=512)
    seqs = [Sequence(f"r{i}", 0, list(range(1, n + 1)), SamplingParams(max_tokens=100)) for i, n in
            enumerate(prompt_lens)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.is_prefill and [s.request_id for s in batch.seqs] == ["r0", "r1", "r2", "r3"]
    sched.after_step(batch)
    for seq in seqs:
        seq.token_ids.append(7)  # the sampled token, read back
    return sched, seqs


def test_decode_rows_are_longest_context_first_and_running_order_is_kept():
    sched, seqs = _scheduler_after_prefill([5, 40, 17, 40])
    batch = sched.schedule()
    assert not batch.is_prefill
    assert [s.num_tokens for s in batch.seqs] == [41, 41, 18, 6]
    assert [s.request_id for s in batch.seqs] == ["r1", "r3", "r2", "r0"]  # a stable sort: ties keep admission order
    assert [s.request_id for s in sched.running] == ["r0", "r1", "r2", "r3"]


def test_preemption_still_takes_the_most_recently_admitted():
    # 4-token blocks: the prompts (8, 12, 12, 12) fill 2 + 3 + 3 + 3 = 11 of 12 blocks; with the
    # read-back token each needs one more. r0 takes the last free block, r1 finds none and the newest
    # running sequence, r3, is preempted (its 3 blocks serve r1 and r2)
    sched, seqs = _scheduler_after_prefill([8, 12, 12, 12], num_blocks=12)
    batch = sched.schedule()
    assert sched.num_preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["r3"]
    assert [s.request_id for s in batch.seqs] == ["r1", "r2", "r0"]
    assert [s.request_id for s in sched.running] == ["r0", "r1", "r2"]


def test_admission_order_switch(monkeypatch):
    monkeypatch.setenv("METAINFER_DECODE_ORDER", "admission")
    sched, _ = _scheduler_after_prefill([5, 40, 17, 40])
    assert [s.request_id for s in sched.schedule().seqs] == ["r0", "r1", "r2", "r3"]
