"""Sequence bookkeeping: token counts with PENDING (launched, not read back) entries, which outputs and
hashes leave out, the length limit, when a step samples, and per-sample seeds."""

from __future__ import annotations

import torch

from metainfer.engine.sequence import PENDING, Sequence, SequenceStatus
from metainfer.sampling_params import SamplingParams


def _seq(prompt=(1, 2, 3), **params):
    return Sequence("r", 0, list(prompt), SamplingParams(**params))


def test_pending_tokens_count_for_scheduling_but_not_for_outputs():
    seq = _seq()
    assert (seq.num_tokens, seq.num_known_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.status == SequenceStatus.WAITING
    first = seq.add_pending(sample_row=4)
    second = seq.add_pending(sample_row=1)
    assert (first, second, seq.sample_row) == (3, 4, 1)
    assert seq.token_ids == [1, 2, 3, PENDING, PENDING]
    assert (seq.num_tokens, seq.num_known_tokens, seq.num_pending) == (5, 3, 2)
    assert seq.num_output_tokens == 2 and seq.num_known_output_tokens == 0 and seq.output_token_ids == []
    seq.resolve_pending(first, 42)
    assert seq.output_token_ids == [42] and seq.num_known_output_tokens == 1 and seq.num_pending == 1
    seq.drop_pending()  # finished: the token still in flight is dropped
    assert seq.token_ids == [1, 2, 3, 42] and seq.num_pending == 0
    seq.drop_pending()
    assert seq.token_ids == [1, 2, 3, 42]


def test_length_limit_counts_tokens_in_flight():
    seq = _seq(max_tokens=2)
    seq.add_pending(0)
    assert not seq.reached_length_limit(max_model_len=100)
    seq.add_pending(0)  # the second output is launched: a further step would be thrown away
    assert seq.reached_length_limit(max_model_len=100)
    unlimited = _seq(max_tokens=None)
    assert not unlimited.reached_length_limit(max_model_len=4)
    unlimited.token_ids.append(9)
    assert unlimited.reached_length_limit(max_model_len=4)


def test_will_sample_only_when_the_step_reaches_the_last_token():
    seq = _seq(range(10))
    seq.num_computed_tokens, seq.num_scheduled_tokens = 0, 6
    assert not seq.will_sample
    seq.num_computed_tokens, seq.num_scheduled_tokens = 6, 4
    assert seq.will_sample


def test_block_tokens_slices_by_block():
    seq = _seq(range(10))
    assert seq.block_tokens(0, 4) == [0, 1, 2, 3] and seq.block_tokens(2, 4) == [8, 9]


def test_seeded_samples_get_their_own_generators():
    params = SamplingParams(seed=7)
    a, a2, b = (Sequence("r", i, [1], params) for i in (0, 0, 1))
    draw = [torch.rand(3, generator=s.generator) for s in (a, a2, b)]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])
    assert _seq().generator is None
    assert a.seq_id != a2.seq_id
