"""The TP step delta (worker/tp/protocol.py): a worker's StepMirror, fed only what changed, must hand
its runner the batch rank 0 runs — checked by packing both (worker/step_inputs.py) and comparing the
buffers, over a run with new sequences, appended blocks, preemption (a new table), finishing and a chunked
prefill. Also: what travels is the delta, not every table."""

from __future__ import annotations

import numpy as np

from metainfer.engine.scheduler import ScheduledBatch, prompt_logprob_rows
from metainfer.engine.sequence import Sequence, SequenceStatus
from metainfer.sampling_params import SamplingParams
from metainfer.worker.step_inputs import pack_step
from metainfer.worker.tp.protocol import StepEncoder, StepMirror

BS = 4


def _pack(batch: ScheduledBatch) -> np.ndarray:
    buf = np.full(1024, -7, dtype=np.int32)
    layout = pack_step(batch, len(batch.seqs), buf, BS)
    return buf[: layout.size]


def _check(encoder: StepEncoder, mirror: StepMirror, batch: ScheduledBatch):
    delta = encoder.encode(batch)
    mirrored = mirror.apply(delta)
    assert np.array_equal(_pack(mirrored), _pack(batch))
    assert (mirrored.is_prefill, mirrored.num_decode_rows) == (batch.is_prefill, batch.num_decode_rows)
    rows = batch.prompt_logprobs.rows if batch.prompt_logprobs is not None else None
    assert (mirrored.prompt_logprobs.rows if mirrored.prompt_logprobs is not None else None) == rows
    return delta


def _seq(n):
    return Sequence("r", 0, list(range(100, 100 + n)), SamplingParams())


def test_mirror_follows_a_run():
    enc, mirror = StepEncoder(), StepMirror()
    a, b = _seq(6), _seq(3)
    a.block_table, b.block_table = [0, 1], [2]
    a.num_scheduled_tokens, b.num_scheduled_tokens = 4, 3  # a chunked: 4 of 6
    delta = _check(enc, mirror, ScheduledBatch([a, b], True))
    assert [sid for sid, _ in delta.new] == [a.seq_id, b.seq_id] and not delta.appended
    a.num_computed_tokens, b.num_computed_tokens = 4, 3
    a.num_scheduled_tokens, b.num_scheduled_tokens = 2, 0  # the rest of a's prompt
    delta = _check(enc, mirror, ScheduledBatch([a], True))
    assert delta.new == [] and delta.appended == []  # nothing changed but the rows
    # a mixed step: a's first decode row beside b's re-sent prompt tail (the workers split the attention alike)
    a.num_computed_tokens, a.num_scheduled_tokens = 6, 1
    a.token_ids.append(6)
    b.num_computed_tokens, b.num_scheduled_tokens = 2, 1
    _check(enc, mirror, ScheduledBatch([a, b], True, num_decode_rows=1))
    a.token_ids.pop()
    a.num_computed_tokens, b.num_computed_tokens = 6, 3
    for step in range(3):  # decode: a crosses into a third block, b into a second
        for s in (a, b):
            s.token_ids.append(7 + step)
            s.num_scheduled_tokens = 1
        if step == 0:
            b.block_table.append(3)
        if step == 2:
            a.block_table.append(4)
        delta = _check(enc, mirror, ScheduledBatch([a, b], False))
        if step == 0:
            assert delta.appended == [(b.seq_id, [3])]
        if step == 2:
            assert delta.appended == [(a.seq_id, [4])]
        for s in (a, b):
            s.num_computed_tokens += 1
    # b preempted: its blocks freed (a new, empty table object), later re-admitted with new blocks
    b.block_table = []
    b.block_table = [9, 8]
    b.num_computed_tokens, b.num_scheduled_tokens = 0, b.num_tokens
    delta = _check(enc, mirror, ScheduledBatch([b], True))
    assert delta.new == [(b.seq_id, [9, 8])]
    # a finishes: the next step tells the workers to forget it
    a.status = SequenceStatus.FINISHED
    b.num_computed_tokens, b.num_scheduled_tokens = b.num_tokens, 1
    b.token_ids.append(1)
    delta = _check(enc, mirror, ScheduledBatch([b], False))
    assert delta.gone == [a.seq_id] and a.seq_id not in mirror.seqs


def test_delta_does_not_resend_tables():
    enc, mirror = StepEncoder(), StepMirror()
    seqs = [_seq(5) for _ in range(8)]
    for i, s in enumerate(seqs):
        s.block_table = [2 * i, 2 * i + 1]
        s.num_computed_tokens, s.num_scheduled_tokens = 5, 1
        s.token_ids.append(0)
    _check(enc, mirror, ScheduledBatch(seqs, False))
    for s in seqs:
        s.num_computed_tokens += 1
        s.token_ids.append(0)
    delta = _check(enc, mirror, ScheduledBatch(seqs, False))
    assert delta.new == [] and delta.appended == [] and delta.gone == []
    assert all(len(tokens) == 1 for _, _, tokens, _ in delta.rows)


def test_scored_prompt_rows_reach_the_workers():
    """A prefill step that scores prompt tokens (SamplingParams.prompt_logprobs) sends its rows: every rank runs
    the LM head over them (its gather is collective)."""
    enc, mirror = StepEncoder(), StepMirror()
    plain = _seq(5)
    scored = Sequence("s", 0, list(range(200, 209)), SamplingParams(prompt_logprobs=1))
    plain.block_table, scored.block_table = [0, 1], [2, 3, 4]
    plain.num_scheduled_tokens, scored.num_scheduled_tokens = 5, 6  # the scored prompt's first chunk
    seqs = [plain, scored]
    batch = ScheduledBatch(seqs, is_prefill=True, prompt_logprobs=prompt_logprob_rows(seqs))
    assert batch.prompt_logprobs.rows == [5, 6, 7, 8, 9, 10]  # after plain's 5 tokens: positions 0..5 of 9
    assert batch.prompt_logprobs.targets == scored.token_ids[1:7]
    _check(enc, mirror, batch)
