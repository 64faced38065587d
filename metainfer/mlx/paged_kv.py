"""The MLX KV pool and one step's attention inputs.

Layout: per layer one K and one V array `[num_blocks * block_size, num_kv_heads, head_dim]`: the torch
path's `[num_blocks, block_size, kv_heads, head_dim]` with the first two axes flattened, so a token's slot
(`block * block_size + offset`, from the engine's BlockManager) indexes it directly. The pool is paged
like the torch path's, not per sequence as mlx-lm's caches are: the engine's block manager stays the one
owner of KV memory, so prefix caching (shared blocks), preemption (freed blocks, recomputed later) and a
batch of sequences of different lengths decoding together all hold by construction. A step stores its
K/V with one scatter per layer (`pool[slots] = k`, in place: MLX donates the old buffer) and gathers each
sequence's context through its block table.

Decode: the batch's block tables padded to the widest, gathered to [B, kv_heads, L, d], an additive mask
hiding slots past each context length; one `scaled_dot_product_attention` for the batch. Prefill (and
chunked prefill over a cached prefix): per sequence, its context gathered, the bottom-right-aligned
causal mask (queries are the last `n` of the `ctx` positions).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class PagedKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    @classmethod
    def of(cls, k: list[mx.array], v: list[mx.array]) -> PagedKVPool:
        """A pool over existing arrays (the compiled decode step's inputs)."""
        pool = cls.__new__(cls)
        pool.k, pool.v = k, v
        return pool

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def arrays(self) -> list[mx.array]:
        return self.k + self.v


class DecodeAttention:
    """B sequences, one query token each (rows of the flat batch in order)."""

    def __init__(self, slots: mx.array, gather: mx.array, mask: mx.array):
        self.slots, self.gather, self.mask = slots, gather, mask

    @classmethod
    def from_tables(cls, tables: mx.array, positions: mx.array, block_size: int, dtype) -> DecodeAttention:
        """Built inside the decode graph from its two int32 inputs: tables [B, W] padded with -1 (a padded
        slot reads slot 0 and is masked) and each row's query position [B]. Slots, the gather indices and
        the mask are a few fused integer ops there, not host arrays packed and copied every step."""
        B, W = tables.shape
        length = W * block_size
        gather = (mx.maximum(tables, 0)[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32))
        block = mx.take_along_axis(tables, (positions // block_size)[:, None], axis=1)[:, 0]
        slots = block * block_size + positions % block_size
        hidden = mx.arange(length, dtype=mx.int32)[None, :] > positions[:, None]
        mask = mx.where(hidden, mx.array(-mx.inf, dtype=dtype), mx.array(0, dtype=dtype))
        return cls(slots, gather.reshape(B, length), mask[:, None, None, :])

    def attend(self, q: mx.array, k_pool: mx.array, v_pool: mx.array, scale: float) -> mx.array:
        """q [B, heads, 1, d] -> [B, heads * d]."""
        B = q.shape[0]
        k = k_pool[self.gather].transpose(0, 2, 1, 3)  # [B, kv_heads, L, d]
        v = v_pool[self.gather].transpose(0, 2, 1, 3)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=self.mask)
        return out.reshape(B, -1)


class PrefillAttention:
    """Sequences of n_i new tokens each after `ctx_i - n_i` cached ones (rows of the flat batch in order)."""

    def __init__(self, slots: np.ndarray, spans: list[tuple[int, int, np.ndarray]]):
        """spans: per sequence (first row, new tokens n, context slots [ctx] in position order)."""
        self.slots = mx.array(slots)
        self.spans = [(start, n, mx.array(ctx_slots)) for start, n, ctx_slots in spans]

    def attend(self, q: mx.array, k_pool: mx.array, v_pool: mx.array, scale: float) -> mx.array:
        """q [T, heads, 1, d] -> [T, heads * d]."""
        outs = []
        for start, n, ctx_slots in self.spans:
            qs = q[start:start + n, :, 0, :].transpose(1, 0, 2)[None]  # [1, heads, n, d]
            k = k_pool[ctx_slots].transpose(1, 0, 2)[None]  # [1, kv_heads, ctx, d]
            v = v_pool[ctx_slots].transpose(1, 0, 2)[None]
            o = mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale, mask="causal" if n > 1 else None)
            outs.append(o[0].transpose(1, 0, 2).reshape(n, -1))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
