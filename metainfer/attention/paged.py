"""Paged GQA attention for the dense family (Qwen3, Qwen2, Llama).

Cache per layer: K `[num_blocks, block_size, Hk, D]` and V of the same shape, views of one pool
`[2, L, N, S, Hk, D]` in the KV dtype. An fp8 cache keeps K block-major and V token-major (kernels/kv_cache.py:
block_major_k_cache, token_major_v_cache; faster decode attention, docs/PERFORMANCE.md). Each step runs two kernels
per layer: `qk_norm_rope_store` (per-head q/k RMSNorm where the model has it, neox rotary, K/V into
the cache; q comes back normed and rotated, in place) and the paged prefill or split-KV decode
attention. The q/k norm and the rotary are applied here, not in the model, because the store fuses
them: the layer is built with references to the model's norms and rotary cache.
"""

from __future__ import annotations

import functools

import torch

from metainfer.attention.backend import AttentionBackend
from metainfer.kernels import FP8_KV_DTYPE, block_major_k_cache, decode_workspace_numel_for, token_major_v_cache


def _as_is(memory: torch.Tensor) -> torch.Tensor:
    return memory


class PagedAttentionBackend(AttentionBackend):
    name = "paged"

    def __init__(self, ops, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                 device: torch.device, max_num_seqs: int, max_model_len: int, block_size: int):
        """Per-rank heads (num_heads, num_kv_heads: this rank's share, see layers/linear.py)."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.kv_dtype, self.device = kv_dtype, device
        self._table_tokens = -(-max_model_len // block_size) * block_size
        self._max_num_seqs = max_num_seqs
        self.decode_workspace: torch.Tensor | None = None
        self.bind_ops(ops)
        fp8 = kv_dtype == FP8_KV_DTYPE
        self._k_view = block_major_k_cache if fp8 else _as_is
        self._v_view = token_major_v_cache if fp8 else _as_is
        self.pool: torch.Tensor | None = None

    def bind_ops(self, ops) -> None:
        """The kernels; on the Triton path one split-KV scratch for every decode launch this engine can
        make (sized before the KV pool, so the memory profile sees it), so no step allocates."""
        self._prep = ops.qk_norm_rope_store
        self._prefill = ops.paged_prefill_attention
        self._decode = ops.paged_decode_attention
        if ops.backend == "triton":
            if self.decode_workspace is None:
                numel = decode_workspace_numel_for(self._max_num_seqs, self.num_heads, self.num_kv_heads,
                                                   self.head_dim, self._table_tokens)
                self.decode_workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=self.device)
            self._decode = functools.partial(self._decode, workspace=self.decode_workspace)

    def bytes_per_block(self, num_layers: int, block_size: int) -> int:
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, layers: list, num_blocks: int, block_size: int) -> None:
        shape = (2, len(layers), num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self._k_view(self.pool[0, i]), self._v_view(self.pool[1, i])

    def release(self, layers: list) -> None:
        for layer in layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.pool = None

    def store(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q [T, Hq*D], k and v [T, Hk*D]: column slices of one packed [T, (Hq+2Hk)*D] projection (read in
        place; q and k are normed and rotated in place). Stores K/V; returns q [T, Hq, D] normed and rotated."""
        qkv = _packed(q, k, self.q_size, self.q_size + 2 * self.kv_size)
        q, _, _ = self._prep(qkv, meta.positions, layer.cos_sin, layer.q_norm_weight, layer.k_norm_weight,
                             layer.eps, layer.k_cache, layer.v_cache, meta.slot_mapping,
                             self.num_heads, self.num_kv_heads, self.head_dim)
        return q

    def prefill(self, layer, q: torch.Tensor, meta, out: torch.Tensor | None = None) -> torch.Tensor:
        out = self._prefill(q, layer.k_cache, layer.v_cache, meta.cu_seqlens_q, meta.context_lens,
                            meta.block_tables, meta.max_seqlen_q, layer.scale,
                            out=None if out is None else out.view(q.shape), plans=meta.launch_plans)
        return out.reshape(-1, self.q_size)

    def decode(self, layer, q: torch.Tensor, meta, out: torch.Tensor | None = None) -> torch.Tensor:
        out = self._decode(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens, layer.scale,
                           out=None if out is None else out.view(q.shape), plans=meta.launch_plans)
        return out.reshape(-1, self.q_size)


def _packed(q: torch.Tensor, k: torch.Tensor, q_size: int, width: int) -> torch.Tensor:
    """The packed projection q, k, v were sliced from (they must be adjacent column slices of it)."""
    if q.stride(-1) != 1 or k.data_ptr() != q.data_ptr() + q_size * q.element_size():
        raise ValueError("attention expects q, k, v as adjacent column slices of one packed projection")
    return q.as_strided((q.shape[0], width), (q.stride(0), 1))
