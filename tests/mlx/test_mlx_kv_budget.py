"""The MLX backend's KV budget and dummy weights by hand: a KV block holds K and V of every layer,
block_size tokens, the KV heads' head dims, at the cache dtype's item size (what MLXModelRunner divides its
memory budget by); load_format="dummy" follows the torch path's rule."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")

from metainfer.mlx.paged_kv import PagedKVPool  # noqa: E402


def test_bytes_per_block_by_hand():
    assert PagedKVPool.bytes_per_block(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, itemsize=4) == \
        2 * 3 * 4 * 2 * 8 * 4
    assert PagedKVPool.bytes_per_block(28, 16, 8, 128, 2) == 2 * 28 * 16 * 8 * 128 * 2  # Qwen3-8B-like, bf16


def test_dummy_weights_follow_the_torch_paths_rule():
    """load_format="dummy" on MLX: every tensor of the checkpoint at its shape, norms exactly 1, the rest uniform
    in [-0.02, 0.02] and not all equal, the same for the same seed (the torch path's rule, loader/dummy.py)."""
    import numpy as np

    from metainfer.config import ModelSpec
    from metainfer.mlx.weights import dense_shapes, dummy_tensors

    spec = ModelSpec.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 8})
    tensors = dummy_tensors(spec, seed=3)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(s) for k, s in dense_shapes(spec).items()}
    for name, value in tensors.items():
        value = np.array(value)
        if "norm" in name:
            assert (value == 1).all(), name
        else:
            assert np.abs(value).max() <= 0.02 and value.std() > 0.005, name
    again = dummy_tensors(spec, seed=3)
    assert all(np.array_equal(np.array(tensors[k]), np.array(again[k])) for k in tensors)
