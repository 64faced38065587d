"""A step's inputs: every int field of a scheduled batch packed into one int32 buffer, one upload.

Flat batches (docs/CONTRACTS.md; padded only to a CUDA-graph bucket: a decode graph's rows, a piecewise
bucket's T_b tokens, the padded rows id 0, position 0, slot -1, src -1): input ids/positions [T], slot_mapping
[T] (-1: store nothing), src [T] (>= 0: a PENDING token, read from the previous step's sampled ids on the device),
context_lens [B], cu_seqlens_q [B+1], block tables [B, M] padded with -1, and the rows whose logits are
sampled. CUDA: two pinned host buffers used in turn and one device buffer the CUDA graphs read in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from metainfer.engine.sequence import PENDING


@dataclass(frozen=True)
class StepLayout:
    """Where each field of one step sits in the packed int32 staging buffer.

    Every field starts on a 16-byte boundary: Triton specialises a kernel on whether each pointer
    argument is 16-byte aligned, so unaligned views would compile a new variant of the prefill
    kernels for each alignment pattern the batch sizes happen to produce (seconds, mid-run)."""

    num_tokens: int
    num_seqs: int
    table_width: int
    num_sampling: int

    ALIGN = 4  # int32 elements: 16 bytes

    @property
    def sizes(self) -> dict[str, int]:
        t, b, w = self.num_tokens, self.num_seqs, self.table_width
        return {"ids": t, "positions": t, "slots": t, "src": t, "context_lens": b, "cu": b + 1,
                "tables": b * w, "rows": self.num_sampling}

    @property
    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for name, n in self.sizes.items():
            out[name] = at
            at += -(-n // self.ALIGN) * self.ALIGN
        out["end"] = at
        return out

    @property
    def size(self) -> int:
        return self.offsets["end"]

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o = self.offsets
        v = {name: buf[o[name]:o[name] + n] for name, n in self.sizes.items()}
        v["tables"] = v["tables"].view(self.num_seqs, self.table_width)
        return v


class StepStaging:
    """Host buffer(s) a step is packed into, and the device buffer they are copied to.

    CUDA: two pinned host buffers used in turn (a step may be packed while the previous
    one's upload is still queued behind the GPU work in flight); an event per buffer says
    when its upload has run. CPU: the host buffer is the model's input itself.
    """

    def __init__(self, capacity: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self._host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2 if on_cuda else 1)]
        self._views = [h.numpy() for h in self._host]
        self._uploaded = [torch.cuda.Event() if on_cuda else None for _ in self._host]
        self._current = 0
        self._device = torch.zeros(capacity, dtype=torch.int32, device=device) if on_cuda else self._host[0]
        self.device_buffer = self._device  # what every upload writes (CUDA graphs read it in place)
        self.upload = self._upload_cuda if on_cuda else self._upload_cpu  # chosen once

    def next_host_buffer(self) -> np.ndarray:
        self._current = (self._current + 1) % len(self._host)
        if self._uploaded[self._current] is not None:
            self._uploaded[self._current].synchronize()  # its previous upload has been read
        return self._views[self._current]

    def _upload_cuda(self, size: int) -> torch.Tensor:
        self._device[:size].copy_(self._host[self._current][:size], non_blocking=True)
        self._uploaded[self._current].record()
        return self._device

    def _upload_cpu(self, size: int) -> torch.Tensor:
        return self._device


def pack_step(batch, num_rows: int, view: np.ndarray, block_size: int, graph_width: int | None = None,
              token_rows: int | None = None) -> StepLayout:
    """Fill the host buffer `view` with the batch's fields and return their layout. Prefill and mixed steps
    (`batch.is_prefill`) pack each row's new tokens flat (a mixed step's decode row is one token whose id
    may still be PENDING: its `src` is the row's sample_row in the previous step). Pure decode batches are
    padded to `num_rows` (a CUDA-graph bucket: padded rows store nothing and attend to nothing). With
    `graph_width` the layout is the bucket's captured one (`graph_layout`: tables that wide), else tables
    are as wide as the longest one. With `token_rows` (a piecewise-graph bucket, >= the step's tokens) the
    token fields (ids, positions, slots, src) are laid out that long, at the offsets the bucket was captured
    with, their padded rows storing nothing (slot -1) at position 0. `batch` is a ScheduledBatch (or the TP
    rank's mirror of one)."""
    seqs, bs = batch.seqs, block_size
    width = graph_width if graph_width is not None else max(len(s.block_table) for s in seqs)
    sampling_rows: list[int] = []
    if batch.is_prefill:  # prefill or mixed: any number of new tokens per row over its context
        ids, pos, cu, ctx, slot_parts, pending = [], [], [0], [], [], []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            tokens = seq.token_ids[start:start + n]
            if tokens[-1] == PENDING:  # a mixed step's decode row whose token is still on the device
                tokens[-1] = 0
                pending.append((cu[-1] + n - 1, seq.sample_row))
            ids.extend(tokens)
            p = np.arange(start, start + n, dtype=np.int64)
            pos.append(p)
            slot_parts.append(np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            if seq.will_sample:
                sampling_rows.append(cu[-1] - 1)
        num_tokens, positions, slots = cu[-1], np.concatenate(pos), np.concatenate(slot_parts)
        src = [-1] * num_tokens  # known tokens; a PENDING one reads its sampled id on the device
        for index, row in pending:
            src[index] = row
        num_seqs = len(seqs)
    else:
        ids, positions, slots, src, ctx = [], [], [], [], []
        for seq in seqs:
            p = seq.num_computed_tokens
            token = seq.token_ids[p:p + 1][0]
            ids.append(max(token, 0))
            src.append(seq.sample_row if token == PENDING else -1)
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            ctx.append(p + 1)
        pad = num_rows - len(seqs)
        ids += [0] * pad
        src += [-1] * pad
        positions += [0] * pad
        slots += [-1] * pad
        ctx += [0] * pad
        num_tokens = num_seqs = num_rows
        cu = range(num_rows + 1)
        sampling_rows = list(range(len(seqs)))
    if token_rows is not None and token_rows < num_tokens:
        raise ValueError(f"token_rows {token_rows} is fewer than the step's {num_tokens} tokens")
    if graph_width is not None:
        layout = graph_layout(num_rows, graph_width)
    else:
        layout = StepLayout(token_rows or num_tokens, num_seqs, width, len(sampling_rows))
    o = layout.offsets
    if layout.num_tokens > num_tokens:  # a bucket's padded rows
        for name, value in (("ids", 0), ("positions", 0), ("slots", -1), ("src", -1)):
            view[o[name] + num_tokens:o[name] + layout.num_tokens] = value
    view[o["ids"]:o["ids"] + num_tokens] = ids
    view[o["positions"]:o["positions"] + num_tokens] = positions
    view[o["slots"]:o["slots"] + num_tokens] = slots
    view[o["src"]:o["src"] + num_tokens] = src
    view[o["context_lens"]:o["context_lens"] + num_seqs] = ctx
    view[o["cu"]:o["cu"] + num_seqs + 1] = cu
    tables = view[o["tables"]:o["tables"] + num_seqs * width].reshape(num_seqs, width)
    tables.fill(-1)
    for row, seq in enumerate(seqs):
        tables[row, :len(seq.block_table)] = seq.block_table
    view[o["rows"]:o["rows"] + len(sampling_rows)] = sampling_rows
    return layout


def graph_layout(num_rows: int, table_width: int) -> StepLayout:
    """The one layout a `num_rows`-row decode graph is captured with and packed at (fixed offsets)."""
    return StepLayout(num_rows, num_rows, table_width, num_rows)
