"""Step-input packing (worker/step_inputs.py): a batch's int fields in one int32 buffer, checked against
values worked out by hand from the batch (slots = block * block_size + offset, cu_seqlens, padding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import PENDING, Sequence
from metainfer.sampling_params import SamplingParams
from metainfer.worker.step_inputs import StepLayout, StepStaging, graph_layout, pack_step


def _seq(tokens, table, computed, scheduled):
    seq = Sequence("r", 0, tokens, SamplingParams())
    seq.block_table, seq.num_computed_tokens, seq.num_scheduled_tokens = table, computed, scheduled
    return seq


def _unpack(layout: StepLayout, buf: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in layout.views(torch.from_numpy(buf)).items()}


def test_prefill_fields_by_hand():
    # block size 4; seq a: 6 prompt tokens, a chunk of 5 after 1 computed; seq b: 3 tokens from scratch
    a = _seq([10, 11, 12, 13, 14, 15], [7, 2], computed=1, scheduled=5)
    b = _seq([20, 21, 22], [5], computed=0, scheduled=3)
    buf = np.zeros(256, dtype=np.int32)
    layout = pack_step(ScheduledBatch([a, b], is_prefill=True), 2, buf, block_size=4)
    v = _unpack(layout, buf)
    assert v["ids"].tolist() == [11, 12, 13, 14, 15, 20, 21, 22]
    assert v["positions"].tolist() == [1, 2, 3, 4, 5, 0, 1, 2]
    # position p of a lives in block a.table[p // 4] at offset p % 4
    assert v["slots"].tolist() == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 20, 21, 22]
    assert v["src"].tolist() == [-1] * 8
    assert v["cu"].tolist() == [0, 5, 8]
    assert v["context_lens"].tolist() == [6, 3]
    assert v["tables"].tolist() == [[7, 2], [5, -1]]
    assert v["rows"].tolist() == [4, 7]  # both finish their prompts: the last token of each samples


def test_chunked_prefill_samples_only_on_the_last_chunk():
    a = _seq(list(range(10)), [0, 1, 2], computed=0, scheduled=4)  # 4 of 10: no token sampled
    buf = np.zeros(256, dtype=np.int32)
    layout = pack_step(ScheduledBatch([a], is_prefill=True), 1, buf, block_size=4)
    assert layout.num_sampling == 0 and _unpack(layout, buf)["rows"].tolist() == []


def test_decode_pending_token_and_graph_padding():
    a = _seq([1, 2, 3, 4, 5], [3, 9], computed=4, scheduled=1)  # known last token 5 at position 4
    b = _seq([6, 7], [4], computed=2, scheduled=1)
    b.token_ids.append(PENDING)  # launched, not read back: sampled row 1 of the previous step
    b.sample_row = 1
    buf = np.zeros(512, dtype=np.int32)
    layout = pack_step(ScheduledBatch([a, b], is_prefill=False), 4, buf, block_size=4, graph_width=6)
    assert layout == graph_layout(4, 6)
    v = _unpack(layout, buf)
    assert v["ids"].tolist() == [5, 0, 0, 0]  # the PENDING id is 0 on the host, src says where it comes from
    assert v["src"].tolist() == [-1, 1, -1, -1]
    assert v["positions"].tolist() == [4, 2, 0, 0]
    assert v["slots"].tolist() == [9 * 4 + 0, 4 * 4 + 2, -1, -1]  # padded rows store nothing
    assert v["context_lens"].tolist() == [5, 3, 0, 0]  # and attend to nothing
    assert v["tables"].tolist() == [[3, 9, -1, -1, -1, -1], [4, -1, -1, -1, -1, -1]] + [[-1] * 6] * 2
    assert v["rows"].tolist()[:2] == [0, 1] and v["cu"].tolist() == [0, 1, 2, 3, 4]  # replay keeps rows [:2]


def test_a_piecewise_bucket_packs_every_step_at_its_offsets_with_padded_rows_storing_nothing():
    """The captured pieces read ids, positions, slots and src in place (worker/piecewise_graphs.py): for one
    `token_rows`, mixed, prefill and decode steps of any size land at the same offsets, and the rows past the
    step's tokens are rewritten (id 0, position 0, slot -1, src -1) over whatever the buffer held before."""
    from metainfer.worker.warmup import BlockCycle, WarmupStep, warmup_batch

    blocks, rows = BlockCycle(512), 64
    steps = [warmup_batch(WarmupStep("mixed", 40, decode_rows=3), blocks, 16),
             warmup_batch(WarmupStep("decode", decode_rows=20), blocks, 16),
             warmup_batch(WarmupStep("prefill", 64), blocks, 16),
             warmup_batch(WarmupStep("mixed", 1, decode_rows=1), blocks, 16)]
    buf = np.full(StepLayout(rows, 64, 64, 64).size, 777, dtype=np.int32)  # a dirty buffer: stale values
    offsets = None
    for batch in steps:
        layout = pack_step(batch, len(batch.seqs), buf, 16, token_rows=rows)
        o = {name: layout.offsets[name] for name in ("ids", "positions", "slots", "src")}
        assert offsets in (None, o), "a bucket's token fields must not move between its steps"
        offsets, n = o, batch.num_tokens
        v = _unpack(layout, buf)
        for name, pad in (("ids", 0), ("positions", 0), ("slots", -1), ("src", -1)):
            assert len(v[name]) == rows and (v[name][n:] == pad).all(), (name, n)
        assert (v["slots"][:n] >= 0).all() and v["cu"][-1] == (n if batch.is_prefill else len(batch.seqs))
    with pytest.raises(ValueError, match="token_rows"):
        pack_step(steps[2], len(steps[2].seqs), buf, 16, token_rows=32)  # 64 tokens cannot fit 32 rows


@pytest.mark.parametrize("tokens, seqs, width, sampling", [(13, 3, 5, 2), (8192, 13, 37, 13), (7, 3, 1, 2),
                                                          (1, 1, 5, 1)])
def test_fields_are_16_byte_aligned_and_disjoint(tokens, seqs, width, sampling):
    """Every field view starts on a 16-byte boundary (Triton specialises on pointer alignment, so
    varying alignment would recompile the prefill kernels mid-run) and the fields never overlap."""
    layout = StepLayout(num_tokens=tokens, num_seqs=seqs, table_width=width, num_sampling=sampling)
    offsets, sizes = layout.offsets, layout.sizes
    spans = sorted((offsets[k], offsets[k] + n) for k, n in sizes.items())
    assert all(start % 4 == 0 for start, _ in spans)  # int32 elements: 16 bytes
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert layout.size >= spans[-1][1]
    buf = torch.zeros(layout.size, dtype=torch.int32)
    views = layout.views(buf)
    assert set(views) == set(sizes)
    for name, view in views.items():
        assert (view.data_ptr() - buf.data_ptr()) % 16 == 0, name
        assert view.numel() == sizes[name], name
        view.fill_(1)
    assert int(buf.sum()) == sum(sizes.values())  # disjoint: each element written once
    assert views["tables"].shape == (seqs, width)


def test_cpu_staging_is_the_model_input_itself():
    staging = StepStaging(64, torch.device("cpu"))
    host = staging.next_host_buffer()
    host[:3] = [7, 8, 9]
    assert staging.upload(3)[:3].tolist() == [7, 8, 9]
