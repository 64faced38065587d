"""Paged attention layer and the per-step attention metadata.

The model runner builds one `AttentionMetadata` per step and installs it with
`forward_context(meta)`; attention layers read it, so `model.forward(input_ids, positions)`
keeps a plain signature (and CUDA graphs capture the same buffers every replay).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # int32 [T], -1 = do not store
    context_lens: torch.Tensor  # int32 [B], tokens in cache after this step's store
    block_tables: torch.Tensor  # int32 [B, M], padded with -1
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B+1], prefill only
    max_seqlen_q: int = 1


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


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    `forward(q, k, v)` = `store(k, v)` then `attend(q)`. Models whose K/V reach the cache another
    way call `attend(q)` alone (the dense family's prefill, after its fused `qk_norm_rope_store`), or
    `decode_qkv` for a decode step (q/k prep, the store and attention in one op).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)  # views into the runner's KV pool
        self._store = ops.store_kv
        self._decode = ops.paged_decode_attention
        self._prefill = ops.paged_prefill_attention
        self._decode_qkv = ops.paged_decode_attention_qkv

    def bind_decode_workspace(self, workspace: torch.Tensor) -> None:
        """Give the (Triton) decode launches their split scratch (kernels/attention.py:
        decode_workspace_numel_for), so a split launch allocates nothing per step. One buffer
        serves every layer: the layers run one after another."""
        self._decode = functools.partial(self._decode, workspace=workspace)
        self._decode_qkv = functools.partial(self._decode_qkv, workspace=workspace)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's K/V into the cache at the metadata's slot_mapping (-1 skipped)."""
        meta = get_attention_metadata()
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self._store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """Attention of q ([T, Hq*D] or [T, Hq, D], may be strided) over the cache, whose K/V for
        this step must already be stored. Returns [T, Hq*D]."""
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        if meta.is_prefill:
            out = self._prefill(q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.context_lens,
                                meta.block_tables, meta.max_seqlen_q, self.scale)
        else:
            out = self._decode(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def decode_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, eps: float) -> torch.Tensor:
        """A decode step from the raw qkv projection [B, (Hq+2Hk)*D]: per-head q/k RMSNorm (weights
        given) and neox rotary, this step's K/V into the cache, attention (one launch on the Triton
        path: kernels/attention.py, paged_decode_attention_qkv). Returns [B, Hq*D]."""
        meta = get_attention_metadata()
        out = self._decode_qkv(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, self.k_cache, self.v_cache,
                               meta.slot_mapping, meta.block_tables, meta.context_lens, self.scale,
                               self.num_heads, self.num_kv_heads, self.head_dim)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store(k, v)
        return self.attend(q)
