"""The KV reserve (engine/kv_reserve.py): what a prompt's admission leaves free for the running sequences'
future tokens. The estimate's arithmetic, the learned ratio (window, aborts ignored), and the scheduler: a pool
that greedy admission (ratio 0, vLLM's) fills and then preempts is admitted so that everything finishes
without a preemption; an idle engine still admits a request larger than its reserve."""

from __future__ import annotations

import math
import random

import pytest

from metainfer.engine.block_manager import BlockManager
from metainfer.engine.kv_reserve import CLIP_TOKENS, WINDOW, KVReserve
from metainfer.engine.scheduler import Scheduler
from metainfer.engine.sequence import Sequence
from metainfer.sampling_params import SamplingParams


def _seq(prompt_len, max_tokens, name="r"):
    return Sequence(name, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def _finished(reserve, generated, max_tokens, prompt_len=4):
    seq = _seq(prompt_len, max_tokens)
    seq.token_ids += [7] * generated
    reserve.record_finished(seq)


def test_allowed_tokens_is_max_tokens_left_within_the_context_and_the_clip():
    r = KVReserve(block_size=4, max_model_len=10_000)
    seq = _seq(10, 30)
    seq.token_ids += [7] * 12
    assert r.allowed_tokens(seq) == 18
    assert r.allowed_tokens(_seq(10, None)) == CLIP_TOKENS  # no max_tokens: the context left, clipped
    assert KVReserve(4, 100).allowed_tokens(_seq(90, 50)) == 10  # the context left
    done = _seq(10, 3)
    done.token_ids += [7] * 3
    assert r.allowed_tokens(done) == 0


def _running(prompt_len, max_tokens, generated, block_size):
    seq = _seq(prompt_len, max_tokens)
    seq.token_ids += [7] * generated
    seq.block_table = list(range(-(-seq.num_tokens // block_size)))
    return seq


def _fits_step_by_step(seqs, ratio, block_size, capacity, reserve):
    """Independent reference: walk every future step and sum the blocks of the sequences still running."""
    ends = [math.ceil(ratio * reserve.allowed_tokens(s)) for s in seqs]
    for step in range(int(max(ends, default=0)) + 2):
        held = sum(s.num_tokens / block_size + 1 + min(step, end) / block_size
                   for s, end in zip(seqs, ends) if step <= end)
        if held > capacity + 1e-9:
            return False
    return True


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_plan_admits_exactly_when_every_future_step_fits(ratio):
    rng = random.Random(3)
    for _ in range(300):
        bs = rng.choice([1, 4, 16])
        reserve = KVReserve(block_size=bs, max_model_len=400, ratio=ratio)
        running = []
        for _ in range(rng.randint(1, 6)):
            max_tokens = rng.randint(1, 80)
            running.append(_running(rng.randint(1, 60), max_tokens, rng.randint(0, max_tokens), bs))
        new = _seq(rng.randint(1, 60), rng.randint(1, 80))
        held = sum(len(s.block_table) for s in running)
        free = rng.randint(max(0, -(-new.num_tokens // bs)), held + 40)
        plan = reserve.plan(running, free)
        assert plan.admit(new) == _fits_step_by_step(running + [new], ratio, bs, free + held, reserve)


def test_a_sequence_that_ends_early_makes_room_the_sum_of_final_sizes_would_not():
    # block size 1: a sequence of n tokens holds n + 1 blocks (the +1: a partial block). Running: A and B of
    # 10 tokens, A ends after 2 more, B after 20; a new prompt N of 10 tokens with 10 to go. Held: 39 blocks
    # at step 2 (13 each), 42 at step 10 (B 21, N 21), 31 at step 20 (B): the peak is 42, while their
    # final sizes sum to 13 + 31 + 21 = 65. The running two hold 20 blocks now.
    running = [_running(10, 2, 0, 1), _running(10, 20, 0, 1)]
    assert KVReserve(block_size=1, max_model_len=400).plan(running, free_blocks=50 - 20).admit(_seq(10, 10))
    assert not KVReserve(block_size=1, max_model_len=400).plan(running, free_blocks=41 - 20).admit(_seq(10, 10))
    assert KVReserve(block_size=1, max_model_len=400).plan(running, free_blocks=41 - 20).admit(_seq(10, 9))  # 40


def test_learned_ratio_is_generated_over_allowed_of_the_last_window():
    r = KVReserve(block_size=16, max_model_len=100_000)
    assert r.ratio == 1.0  # nothing finished yet: reserve all of it
    _finished(r, 25, 100)
    _finished(r, 75, 100)
    assert r.ratio == pytest.approx(0.5)
    _finished(r, 10, None)  # allowed: the clip
    assert r.ratio == pytest.approx(110 / (200 + CLIP_TOKENS))
    for _ in range(WINDOW):
        _finished(r, 10, 40)
    assert r.ratio == pytest.approx(0.25)  # the first three left the window
    fixed = KVReserve(16, 100_000, ratio=0.3)
    _finished(fixed, 1, 100)
    assert fixed.ratio == 0.3
    with pytest.raises(ValueError, match="kv_reserve_ratio"):
        KVReserve(16, 100, ratio=1.5)


def _run(sched, seqs, stop_after=None):
    """Drive the scheduler as the engine does (tokens read back at once); returns the most sequences that ran
    together. `stop_after`: a sequence stops ("stop") after this many tokens instead of its max_tokens."""
    for seq in seqs:
        sched.add(seq)
    most = 0
    while (batch := sched.schedule()) is not None:
        sampling = batch.sampling_seqs
        sched.after_step(batch)
        most = max(most, len(sched.running))
        for seq in sampling:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= (stop_after or seq.params.max_tokens):
                seq.finish_reason = "stop" if stop_after else "length"
                sched.finish(seq)
    assert all(s.is_finished for s in seqs) and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return most


def _scheduler(num_blocks, ratio=None):
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=False), max_num_seqs=8,
                     max_num_batched_tokens=64, max_model_len=256, kv_reserve_ratio=ratio)


def test_requests_that_run_to_max_tokens_are_not_preempted():
    # 4-token blocks, 8 prompts of 8 tokens, 24 out: 8 blocks each at the end, 64 against a pool of 20.
    # Greedy admission takes all 8 prompts (16 blocks) and must preempt as they grow; the reserve admits two
    # (2 x 8 = 16 blocks; a third's 8 would not fit beside them) and the rest as they finish.
    greedy = _scheduler(20, ratio=0.0)
    assert _run(greedy, [_seq(8, 24, f"g{i}") for i in range(8)]) > 2
    assert greedy.num_preemptions > 0
    reserved = _scheduler(20)
    assert _run(reserved, [_seq(8, 24, f"r{i}") for i in range(8)]) == 2
    assert reserved.num_preemptions == 0
    assert reserved.kv_reserve.ratio == 1.0


def test_a_reserve_learned_from_early_stops_admits_more():
    # replies stop after 6 of their 24 allowed tokens: the learned ratio falls to 0.25 and later prompts
    # are admitted beside more running ones than at ratio 1 (2 at a time)
    sched = _scheduler(20)
    seqs = [_seq(8, 24, f"r{i}") for i in range(12)]
    _run(sched, seqs[:2], stop_after=6)
    assert sched.kv_reserve.ratio == pytest.approx(0.25)
    assert _run(sched, seqs[2:], stop_after=6) > 2
    assert sched.num_preemptions == 0


def test_aborted_sequences_teach_the_ratio_nothing():
    sched = _scheduler(20)
    (seq,) = [_seq(8, 24)]
    sched.add(seq)
    sched.after_step(sched.schedule())
    seq.finish_reason = "abort"
    sched.finish(seq)
    assert sched.kv_reserve.ratio == 1.0 and not sched.kv_reserve._finished


def test_an_idle_engine_admits_a_request_larger_than_its_reserve():
    # 8 + 200 tokens would need 52 blocks of a pool of 20 (the engine caps max_model_len at the pool, so this
    # only shows the rule): nothing runs, so it is admitted rather than waiting for room that cannot come
    sched = Scheduler(BlockManager(20, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=256)
    seq = _seq(8, 200)
    sched.add(seq)
    plan = sched.kv_reserve.plan([], sched.block_manager.num_free_blocks)
    assert not plan.admit(seq), "its reserve alone does not fit the pool"
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [seq]
