"""Scheduler on its own: the prefill token budget (chunked prompts), admission limits, the decode batch's
row order, preemption of the most recently admitted sequence and its recomputation, finishing."""

from __future__ import annotations

from metainfer.engine.block_manager import BlockManager
from metainfer.engine.scheduler import Scheduler
from metainfer.engine.sequence import Sequence, SequenceStatus
from metainfer.sampling_params import SamplingParams


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512,
               kv_reserve_ratio=0.0):
    """Greedy admission (vLLM's) by default: these tests pin the budget, order and preemption mechanics on small
    pools; the KV reserve's own tests (tests/engine/test_kv_reserve.py) turn it on."""
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     kv_reserve_ratio=kv_reserve_ratio)


def _seqs(prompt_lens, max_tokens=100):
    return [Sequence(f"r{i}", 0, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens)) for i, n in
            enumerate(prompt_lens)]


def _step(sched, batch):
    """What the engine does after launching a step and reading it back: advance, append sampled tokens."""
    sampling = batch.sampling_seqs
    sched.after_step(batch)
    for seq in sampling:
        seq.token_ids.append(7)


def _scheduler_after_prefill(prompt_lens, num_blocks=64, block_size=4):
    sched = _scheduler(num_blocks, block_size)
    seqs = _seqs(prompt_lens)
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


# -- prefill: the token budget, chunking, admission limits -----------------------------------------
def test_chunked_prefill_fills_the_token_budget_and_resumes_the_chunk_first():
    sched = _scheduler(max_num_batched_tokens=10)
    a, b, c = _seqs([7, 8, 2])
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [a, b] and batch.num_tokens == 10
    assert (a.num_scheduled_tokens, b.num_scheduled_tokens) == (7, 3)  # b: a 3-token chunk of 8
    assert batch.sampling_seqs == [a], "a non-final chunk samples nothing"
    assert list(sched.running) == [a] and list(sched.waiting) == [b, c]
    _step(sched, batch)
    assert (a.num_computed_tokens, b.num_computed_tokens) == (7, 3)
    batch = sched.schedule()  # a mixed step: a's decode token first, then b's rest (5), then c (2) within 10
    assert batch.is_prefill and batch.is_mixed and batch.seqs == [a, b, c] and batch.num_tokens == 8
    assert batch.num_decode_rows == 1 and batch.num_prefill_tokens == 7
    assert b.num_scheduled_tokens == 5 and batch.sampling_seqs == [a, b, c]
    assert b.block_table and len(b.block_table) == 2, "a chunked prompt keeps the blocks it was given"
    _step(sched, batch)
    assert list(sched.running) == [a, b, c] and not sched.waiting
    assert [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 3
    batch = sched.schedule()
    assert not batch.is_prefill and batch.num_tokens == 3


def test_a_prompt_larger_than_the_budget_runs_in_budget_sized_chunks():
    sched = _scheduler(max_num_batched_tokens=4)
    (seq,) = _seqs([10])
    sched.add(seq)
    chunks = []
    while seq.status == SequenceStatus.WAITING:
        batch = sched.schedule()
        assert batch.is_prefill
        chunks.append((batch.num_tokens, bool(batch.sampling_seqs)))
        _step(sched, batch)
    assert chunks == [(4, False), (4, False), (2, True)] and list(sched.running) == [seq]
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11


def test_max_num_seqs_caps_the_running_set():
    sched = _scheduler(max_num_seqs=2)
    seqs = _seqs([3, 3, 3])
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and list(sched.waiting) == seqs[2:]
    _step(sched, batch)
    batch = sched.schedule()
    assert not batch.is_prefill and len(batch.seqs) == 2


def test_admission_is_in_order_and_stops_at_a_prompt_that_does_not_fit():
    sched = _scheduler(num_blocks=4)  # 16 tokens of KV
    big, small = _seqs([20, 2])
    sched.add(big)
    sched.add(small)
    batch = sched.schedule()  # big does not fit, and small may not overtake it
    assert batch is None and list(sched.waiting) == [big, small] and not big.block_table
    assert sched.block_manager.num_free_blocks == 4


def test_decode_takes_at_most_the_token_budget_of_sequences():
    sched = _scheduler(max_num_batched_tokens=10)
    seqs = _seqs([2, 2, 2, 2, 2])
    for seq in seqs:
        sched.add(seq)
    _step(sched, sched.schedule())  # all five admitted
    sched.max_num_batched_tokens = 3
    batch = sched.schedule()
    assert not batch.is_prefill and len(batch.seqs) == 3
    assert [s.request_id for s in sched.running] == [f"r{i}" for i in range(5)], "running order kept"


# -- preemption and recomputation -------------------------------------------------------------------
def test_a_preempted_sequence_frees_its_blocks_and_recomputes_prompt_and_outputs():
    sched, seqs = _scheduler_after_prefill([8, 12, 12, 12], num_blocks=12)
    r3 = seqs[3]
    batch = sched.schedule()  # as in the test above: r3 is preempted
    assert r3.status == SequenceStatus.WAITING and r3.num_preemptions == 1
    assert (r3.block_table, r3.num_computed_tokens, r3.num_scheduled_tokens) == ([], 0, 0)
    assert sched.block_manager.num_free_blocks == 1  # r3's three blocks: one each to r1 and r2
    _step(sched, batch)
    sched.finish(seqs[0])  # frees 3 blocks: room for r3's 13 tokens (4 blocks)
    batch = sched.schedule()  # mixed: r1 and r2 decode, r3 recomputes in the same step
    assert batch.is_prefill and batch.seqs == [seqs[1], seqs[2], r3] and batch.num_decode_rows == 2
    assert r3.num_scheduled_tokens == 13, "the prompt and the token sampled before preemption"
    assert batch.sampling_seqs == [seqs[1], seqs[2], r3]
    assert r3.num_cached_prompt_tokens == 0, "a readmission is not a prefix-cache statistic"


def test_a_preempted_sequence_goes_back_ahead_of_the_waiting_queue():
    sched, seqs = _scheduler_after_prefill([8, 12, 12, 12], num_blocks=12)
    (late,) = _seqs([20])  # 5 blocks: cannot be admitted while 1 block is free
    sched.add(late)
    batch = sched.schedule()
    assert not batch.is_prefill and sched.num_preemptions == 1
    assert list(sched.waiting) == [seqs[3], late]


def test_cached_prompt_tokens_are_recorded_at_the_first_admission_only():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512,
                      kv_reserve_ratio=0.0)
    bm = sched.block_manager

    def run(batch):
        _step(sched, batch)
        for seq in batch.seqs:
            bm.register_full_blocks(seq)  # the engine hashes on read-back

    (a,) = _seqs([8])
    sched.add(a)
    run(sched.schedule())
    b = Sequence("b", 0, a.token_ids[:8] + [50, 51, 52], SamplingParams(max_tokens=100))
    sched.add(b)
    batch = sched.schedule()  # a decodes beside b's prefill
    assert batch.seqs == [a, b] and b.num_scheduled_tokens == 3 and b.num_cached_prompt_tokens == 8
    run(batch)
    run(sched.schedule())  # a decode step: b's third block is full and hashed
    sched.running.remove(b)  # as the scheduler does before preempting
    sched._preempt(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and b.num_computed_tokens == 12, "the readmission hits b's own blocks"
    assert b.num_cached_prompt_tokens == 8


def test_the_last_running_sequence_preempts_itself_when_no_block_is_left():
    sched, (seq,) = _scheduler_after_prefill_one(8, num_blocks=2)
    batch = sched.schedule()  # position 8 needs a third block; nothing else to preempt
    assert batch is None and list(sched.waiting) == [seq] and not sched.running
    assert sched.num_preemptions == 1 and sched.block_manager.num_free_blocks == 2


def _scheduler_after_prefill_one(n, num_blocks):
    sched = _scheduler(num_blocks)
    seqs = _seqs([n])
    sched.add(seqs[0])
    _step(sched, sched.schedule())
    return sched, seqs


# -- limits and finishing ---------------------------------------------------------------------------
def test_a_sequence_at_its_length_limit_is_not_scheduled_again():
    sched = _scheduler(max_model_len=6)
    short, long = _seqs([3, 5], max_tokens=2)
    for seq in (short, long):
        sched.add(seq)
    _step(sched, sched.schedule())
    batch = sched.schedule()  # long has 6 tokens = max_model_len; short 4 and 1 output of 2
    assert batch.seqs == [short]
    _step(sched, batch)
    assert sched.schedule() is None  # short has its 2 outputs
    assert list(sched.running) == [short, long], "left for the engine to finish on read-back"


def test_finish_removes_the_sequence_and_frees_its_blocks():
    sched = _scheduler(num_blocks=8, max_num_batched_tokens=6)
    a, b = _seqs([4, 9])
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a, and a 2-token chunk of b (b waits with its blocks)
    assert batch.seqs == [a, b] and b.block_table
    _step(sched, batch)
    sched.finish(b)
    assert not sched.waiting and b.status == SequenceStatus.FINISHED and not b.block_table
    sched.finish(a)
    assert not sched.running and sched.block_manager.num_free_blocks == 8
