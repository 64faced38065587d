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
                       max_seqlen_q: int, seq_lens: tuple[tuple[int, int], ...] | None = None) -> AttentionMetadata:
        """The step's metadata over the packed step views (worker/step_inputs.py: StepLayout.views);
        `seq_lens` the host (new tokens, context) of each sequence of a prefill step."""
        return AttentionMetadata(is_prefill=is_prefill, slot_mapping=views["slots"],
                                 context_lens=views["context_lens"], block_tables=views["tables"],
                                 cu_seqlens_q=views["cu"], max_seqlen_q=max_seqlen_q, positions=positions,
                                 seq_lens=seq_lens)

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
    def prefill(self, layer, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of a prefill/extend step's new tokens over the cache (theirs already stored)."""

    @abstractmethod
    def decode(self, layer, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of one query token per sequence over its cache (this step's K/V already stored)."""

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """store, then prefill or decode, under the current forward context (the step's metadata)."""
        meta = get_attention_metadata()
        q = self.store(layer, q, k, v, meta)
        return self.prefill(layer, q, meta) if meta.is_prefill else self.decode(layer, q, meta)
