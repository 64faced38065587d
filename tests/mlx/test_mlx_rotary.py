"""The CPU build's rope (`Rotary` with cos/sin tables made once a step and a signed-permutation matmul) against
`mx.fast.rope`, MLX's own kernel (what Metal runs), on the same frequencies: full and partial rotary dims, yarn's
magnitude scale, llama3 scaling, fp32 and bf16, several positions a step."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")

from metainfer.config import ModelSpec  # noqa: E402
from metainfer.mlx.layers import Rotary  # noqa: E402
from tests.helpers.tiny_models import LLAMA3_ROPE, YARN_ROPE  # noqa: E402


def _spec(rope: dict, partial: float = 1.0) -> ModelSpec:
    return ModelSpec.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 32, "partial_rotary_factor": partial,
                                "rope_parameters": rope})


def _reference(x: mx.array, spec: ModelSpec, positions: mx.array, mscale: float, periods: mx.array) -> mx.array:
    """mx.fast.rope as the Metal form calls it, in fp32."""
    x = x.astype(mx.float32) * mscale
    return mx.fast.rope(x, spec.rotary_dim, traditional=False, base=None, scale=1.0, offset=positions, freqs=periods)


@pytest.mark.parametrize("rope, partial", [({"rope_type": "default", "rope_theta": 1e4}, 1.0),
                                           ({"rope_type": "default", "rope_theta": 1e4}, 0.5),
                                           (dict(YARN_ROPE), 1.0), (dict(LLAMA3_ROPE), 1.0)],
                         ids=["default", "partial", "yarn", "llama3"])
def test_tables_rope_equals_mx_fast_rope(rope, partial):
    spec = _spec(rope, partial)
    rng = np.random.default_rng(0)
    positions = mx.array([0, 1, 7, 300, 1023], dtype=mx.int32)
    x = mx.array(rng.standard_normal((5, 4, 1, spec.head_dim)).astype(np.float32))
    fast = Rotary(spec, tables=False)
    expected = _reference(x, spec, positions, fast.mscale, fast.periods)
    assert np.allclose(np.array(fast(x, fast.prepare(positions))), np.array(expected), atol=1e-6)
    tables = Rotary(spec, tables=True)
    got = tables(x, tables.prepare(positions))
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5, rtol=1e-5)
    if partial < 1.0:  # the dims past rotary_dim pass through unchanged
        assert np.array_equal(np.array(got)[..., spec.rotary_dim:], np.array(x)[..., spec.rotary_dim:])
    if fast.mscale != 1.0:
        assert not np.allclose(np.array(got), np.array(_reference(x, spec, positions, 1.0, fast.periods)), atol=1e-3)


def test_tables_rope_in_bf16_stays_close():
    spec = _spec({"rope_type": "default", "rope_theta": 1e6})
    positions = mx.array([3, 500], dtype=mx.int32)
    x = mx.array(np.random.default_rng(1).standard_normal((2, 4, 1, 32)).astype(np.float32))
    rotary = Rotary(spec, tables=True, dtype=mx.bfloat16)
    got = rotary(x.astype(mx.bfloat16), rotary.prepare(positions))
    assert got.dtype == mx.bfloat16
    expected = _reference(x, spec, positions, 1.0, rotary.periods)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(expected), atol=5e-2)
