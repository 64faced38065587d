"""The per-step attention metadata and the context that carries it to the attention layers.

The model runner builds one `AttentionMetadata` per step and installs it with
`forward_context(meta)`; attention layers read it, so `model(input_ids, positions)` keeps a plain
signature and CUDA graphs capture the same buffers every replay. Flat, unpadded batches
(docs/CONTRACTS.md): T tokens, B sequences, tables M blocks wide.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # int32 [T], -1 = do not store
    context_lens: torch.Tensor  # int32 [B], tokens in cache after this step's store
    block_tables: torch.Tensor  # int32 [B, M], padded with -1
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B+1], prefill only
    max_seqlen_q: int = 1
    positions: torch.Tensor | None = None  # int64 [T]: rotary positions (backends that fuse rope read them)
    # prefill only, on the host: (new tokens, context after the step) per sequence, for a backend whose
    # prefill form is chosen or shaped by length (MLA's expanded prefill); None where not known
    seq_lens: tuple[tuple[int, int], ...] | None = None
    # a mixed step (prefill path with decode rows first): the decode rows' and the prefill rows' own metadata,
    # so each part runs its own kernel (the prefill kernel reads K/V once per q head: a 1-token decode row
    # there costs the GQA group's factor in bytes). `first_row`: the part's first row of the step's q.
    decode_part: AttentionMetadata | None = None
    prefill_part: AttentionMetadata | None = None
    first_row: int = 0
    # the step's attention launches, planned by its first layer and replayed by the others (kernels/_triton.py:
    # PlannedLaunch): every layer of a step launches the same kernel over its own cache views, with the same scale
    # and cache layout (one pool, one attention_scale; a model with per-layer scale or window would key on it)
    launch_plans: dict = field(default_factory=dict)


_CURRENT: list[AttentionMetadata | None] = [None]


@contextmanager
def forward_context(meta: AttentionMetadata):
    _CURRENT[0] = meta
    try:
        yield
    finally:
        _CURRENT[0] = None


def get_attention_metadata() -> AttentionMetadata:
    meta = _CURRENT[0]
    if meta is None:
        raise RuntimeError("attention called outside forward_context(); the model runner sets it")
    return meta
