"""Both forms of `Rotary` against an independent reference: HF transformers' rope init (`ROPE_INIT_FUNCTIONS`,
`attention_scaling`) and its `apply_rotary_pos_emb` on the rotary dims. The `mx.fast.rope` form is what Metal
runs; the CPU build's form (cos/sin tables made once a step and a signed-permutation matmul) is what runs here.
Full and partial rotary dims, yarn's magnitude scale, llama3 scaling, fp32 and bf16, several positions a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")

from metainfer.config import ModelSpec  # noqa: E402
from metainfer.mlx.layers import Rotary  # noqa: E402
from tests.helpers.tiny_models import LLAMA3_ROPE, YARN_ROPE  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402


def _spec(rope: dict, partial: float = 1.0) -> ModelSpec:
    return ModelSpec.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 32, "partial_rotary_factor": partial,
                                "rope_parameters": rope})


def _hf_reference(x: mx.array, rope: dict, partial: float, positions: mx.array) -> np.ndarray:
    """HF's rope on x [T, heads, 1, d] at `positions` [T], in fp32: inv_freq and the magnitude scale from HF's
    init for the scaled types (the textbook 1 / theta^(2i/rd) for default), cos/sin as HF's rotary embedding
    makes them, `apply_rotary_pos_emb` on the first rotary dims, the rest passed through."""
    head_dim = x.shape[-1]
    rotary_dim = int(head_dim * partial)
    if rope["rope_type"] == "default":
        inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        scale = 1.0
    else:
        config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=head_dim,
                                          max_position_embeddings=4096, partial_rotary_factor=partial,
                                          rope_parameters=dict(rope))
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    angles = torch.tensor(np.array(positions), dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, rd]: HF's [batch, seq, dim], batch = token
    cos, sin = angles.cos() * scale, angles.sin() * scale
    q = torch.tensor(np.array(x.astype(mx.float32)))  # [T, heads, 1, d]: HF's [batch, heads, seq, dim]
    rotated, _ = apply_rotary_pos_emb(q[..., :rotary_dim], q[..., :rotary_dim], cos, sin, unsqueeze_dim=1)
    return torch.cat([rotated, q[..., rotary_dim:]], dim=-1).numpy()


@pytest.mark.parametrize("rope, partial", [({"rope_type": "default", "rope_theta": 1e4}, 1.0),
                                           ({"rope_type": "default", "rope_theta": 1e4}, 0.5),
                                           (dict(YARN_ROPE), 1.0), (dict(LLAMA3_ROPE), 1.0)],
                         ids=["default", "partial", "yarn", "llama3"])
def test_tables_rope_equals_mx_fast_rope(rope, partial):
    spec = _spec(rope, partial)
    rng = np.random.default_rng(0)
    positions = mx.array([0, 1, 7, 300, 1023], dtype=mx.int32)
    x = mx.array(rng.standard_normal((5, 4, 1, spec.head_dim)).astype(np.float32))
    expected = _hf_reference(x, rope, partial, positions)
    fast = Rotary(spec, tables=False)  # the Metal form: mx.fast.rope
    np.testing.assert_allclose(np.array(fast(x, fast.prepare(positions))), expected, atol=2e-5, rtol=1e-5)
    tables = Rotary(spec, tables=True)
    got = tables(x, tables.prepare(positions))
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), expected, atol=2e-5, rtol=1e-5)
    if partial < 1.0:  # the dims past rotary_dim pass through unchanged
        assert np.array_equal(np.array(got)[..., spec.rotary_dim:], np.array(x)[..., spec.rotary_dim:])


def test_tables_rope_in_bf16_stays_close():
    spec = _spec({"rope_type": "default", "rope_theta": 1e6})
    positions = mx.array([3, 500], dtype=mx.int32)
    x = mx.array(np.random.default_rng(1).standard_normal((2, 4, 1, 32)).astype(np.float32))
    rotary = Rotary(spec, tables=True, dtype=mx.bfloat16)
    got = rotary(x.astype(mx.bfloat16), rotary.prepare(positions))
    assert got.dtype == mx.bfloat16
    expected = _hf_reference(x, {"rope_type": "default", "rope_theta": 1e6}, 1.0, positions)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected, atol=5e-2)
