"""The attention backend interface: how an attention layer reaches its KV cache and kernels.

A backend is chosen once, when the engine is built (models/registry.py: `build_attention_backend`), and
shared by every
attention layer of the model. It owns four jobs, so that a model file calls `self.attn(q, k, v)` and
knows nothing about caches or kernels:
  metadata  `build_metadata`: the step's packed int fields -> the AttentionMetadata its kernels read;
  KV pool   `bytes_per_block` / `allocate` / `release`: the layout of the paged cache, per layer;
  store     write this step's K/V (or latent) at the metadata's slot_mapping;
  attend    prefill/extend over the paged cache, or decode (one query token per sequence).
The dense family's paged GQA backend is the first (attention/paged.py); MLA's latent cache the next.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from metainfer.attention.metadata import AttentionMetadata, get_attention_metadata


class AttentionBackend(ABC):
    """One attention implementation over one paged-cache layout (see the module docstring)."""

    name = "abstract"

    @staticmethod
    def build_metadata(is_prefill: bool, views: dict[str, torch.Tensor], positions: torch.Tensor,
                       max_seqlen_q: int, seq_lens: tuple[tuple[int, int], ...] | None = None,
                       num_decode_rows: int = 0) -> AttentionMetadata:
        """The step's metadata over the packed step views (worker/step_inputs.py: StepLayout.views);
        `seq_lens` the host (new tokens, context) of each sequence of a prefill step; a mixed step's first
        `num_decode_rows` sequences are 1-token decode rows (rows 0 .. D-1 of q), given their own part."""
        meta = AttentionMetadata(is_prefill=is_prefill, slot_mapping=views["slots"],
                                 context_lens=views["context_lens"], block_tables=views["tables"],
                                 cu_seqlens_q=views["cu"], max_seqlen_q=max_seqlen_q, positions=positions,
                                 seq_lens=seq_lens)
        if is_prefill and num_decode_rows:
            d = num_decode_rows
            meta.decode_part = AttentionMetadata(
                is_prefill=False, slot_mapping=meta.slot_mapping[:d], context_lens=meta.context_lens[:d],
                block_tables=meta.block_tables[:d], positions=positions[:d])
            meta.prefill_part = AttentionMetadata(
                is_prefill=True, slot_mapping=meta.slot_mapping, context_lens=meta.context_lens[d:],
                block_tables=meta.block_tables[d:], cu_seqlens_q=meta.cu_seqlens_q[d:],  # absolute offsets
                max_seqlen_q=max(q_len for q_len, _ in seq_lens[d:]) if seq_lens else max_seqlen_q,
                positions=positions, seq_lens=seq_lens[d:] if seq_lens else None, first_row=d)
        return meta

    @abstractmethod
    def bytes_per_block(self, num_layers: int, block_size: int) -> int:
        """Bytes one KV block takes over all layers (sizes the pool from a memory budget)."""

    @abstractmethod
    def allocate(self, layers: list, num_blocks: int, block_size: int) -> None:
        """Allocate the pool for `num_blocks` blocks and give each attention layer its cache views."""

    @abstractmethod
    def release(self, layers: list) -> None:
        """Drop the pool (the memory profile allocates a trial one first)."""

    @abstractmethod
    def store(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write this step's K/V into `layer`'s cache at meta.slot_mapping; returns the query to attend with
        (a backend may transform it on the way, e.g. the paged one's fused q/k norm and rotary)."""

    @abstractmethod
    def prefill(self, layer, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of a prefill/extend step's new tokens over the cache (theirs already stored) ->
        [T, width]; written into `out` ([T, width]) when given."""

    @abstractmethod
    def decode(self, layer, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one query token per sequence over its cache (this step's K/V already stored) ->
        [B, width]; written into `out` when given."""

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """store, then attend, under the current forward context (the step's metadata)."""
        meta = get_attention_metadata()
        return self.attend(layer, self.store(layer, q, k, v, meta), meta)

    def attend(self, layer, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill or decode of q (as `store` returned it) over the cache, into `out` when given (the
        piecewise graphs' static output: the store runs inside their captured pieces, this between them).
        A mixed step: prefill over the prefill rows (absolute row offsets: rows 0 .. D-1 are left to the
        decode), then the decode rows through the decode kernel, written into rows 0 .. D-1 in place."""
        if not meta.is_prefill:
            return self.decode(layer, q, meta, out)
        if meta.decode_part is None:
            return self.prefill(layer, q, meta, out)
        d = meta.prefill_part.first_row
        out = self.prefill(layer, q, meta.prefill_part, out)
        self.decode(layer, q[:d], meta.decode_part, out[:d])
        return out
