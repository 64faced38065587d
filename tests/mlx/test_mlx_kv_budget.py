"""The MLX KV pool's size by hand: a block holds K and V of every layer, block_size tokens, the KV heads' head
dims, at the cache dtype's item size (what MLXModelRunner divides its memory budget by)."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")

from metainfer.mlx.paged_kv import PagedKVPool  # noqa: E402


def test_bytes_per_block_by_hand():
    assert PagedKVPool.bytes_per_block(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, itemsize=4) == \
        2 * 3 * 4 * 2 * 8 * 4
    assert PagedKVPool.bytes_per_block(28, 16, 8, 128, 2) == 2 * 28 * 16 * 8 * 128 * 2  # Qwen3-8B-like, bf16
