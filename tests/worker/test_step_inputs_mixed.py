"""A mixed step's packed inputs (issue 23, item 3), worked out by hand: decode rows first (one token each over
their context, a PENDING one read from the previous step's sampled ids on the device), then prefill rows; flat
and unpadded like a prefill step."""

from __future__ import annotations

import numpy as np
import torch

from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import PENDING, Sequence
from metainfer.sampling_params import SamplingParams
from metainfer.worker.step_inputs import pack_step


def _seq(tokens, table, computed, scheduled):
    seq = Sequence("r", 0, tokens, SamplingParams())
    seq.block_table, seq.num_computed_tokens, seq.num_scheduled_tokens = table, computed, scheduled
    return seq


def test_mixed_step_fields_by_hand():
    # block size 4. a: decode of a PENDING token at position 5 (sampled in row 2 of the previous step);
    # b: decode of a known token at position 2; c: a 3-token chunk of a 9-token prompt after 4 cached tokens
    a = _seq([1, 2, 3, 4, 5], [6, 8], computed=5, scheduled=1)
    a.token_ids.append(PENDING)
    a.sample_row = 2
    b = _seq([7, 8, 9], [3], computed=2, scheduled=1)
    c = _seq(list(range(30, 39)), [1, 4, 5], computed=4, scheduled=3)
    batch = ScheduledBatch([a, b, c], is_prefill=True, num_decode_rows=2)
    assert batch.is_mixed and batch.num_prefill_tokens == 3 and batch.sampling_seqs == [a, b]
    buf = np.zeros(512, dtype=np.int32)
    layout = pack_step(batch, 3, buf, block_size=4)
    v = {k: t.numpy().tolist() for k, t in layout.views(torch.from_numpy(buf)).items()}
    assert v["ids"] == [0, 9, 34, 35, 36]
    assert v["src"] == [2, -1, -1, -1, -1]
    assert v["positions"] == [5, 2, 4, 5, 6]
    assert v["slots"] == [8 * 4 + 1, 3 * 4 + 2, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    assert v["cu"] == [0, 1, 2, 5]
    assert v["context_lens"] == [6, 3, 7]
    assert v["tables"] == [[6, 8, -1], [3, -1, -1], [1, 4, 5]]
    assert v["rows"] == [0, 1]  # c's chunk is not its last: it samples nothing
