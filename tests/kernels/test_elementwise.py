"""Elementwise kernels: RMSNorm, fused add+RMSNorm, rotary (+ cos/sin cache), SiLU-and-mul.

Each torch reference is checked against an independent formula (float64 math, complex-number
rotation, transformers' rope init functions) and, bit for bit in fp32/fp16/bf16, against HF
transformers' own Qwen3 modules (the references round where HF does); each Triton kernel is
checked against its reference, including that it rounds at the same points.
On CPU the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), in
fp32 and fp16 only (the interpreter mishandles bf16). METAINFER_TEST_GPU=1 runs them compiled on
CUDA and adds bf16.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from metainfer.kernels import (
    KernelOps,
    build_cos_sin_cache,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
    rope_mscale,
    rotary_neox_ref,
    rotary_neox_triton,
    select_ops,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from tests.helpers.aot import run_aot_check
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, ON_GPU, REF_DTYPES

triton = pytest.importorskip("triton")

# Triton vs reference: the same fp32 math and rounding points; they differ by at most ~1 ulp where
# the fp32 reduction order or exp/rsqrt differ.
KERNEL_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Reference vs float64 formula: one rounding of the output.
REF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def _close(actual, expected, dtype, table=KERNEL_TOL):
    atol, rtol = table[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------


def _rms_formula(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_rms_norm_ref_matches_formula(dtype):
    x, w = _randn(6, 40, dtype=dtype), _randn(40, dtype=dtype, seed=1)
    y = rms_norm_ref(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, _rms_formula(x, w, 1e-6), dtype, REF_TOL)
    # any leading shape
    x3 = _randn(2, 3, 40, dtype=dtype, seed=2)
    _close(rms_norm_ref(x3, w, 1e-5), _rms_formula(x3, w, 1e-5), dtype, REF_TOL)


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_fused_add_rms_norm_ref_matches_formula(dtype):
    x, res, w = _randn(5, 64, dtype=dtype), _randn(5, 64, dtype=dtype, seed=1), _randn(64, dtype=dtype, seed=2)
    summed = (x.double() + res.double()).to(dtype)
    res_in = res.clone()
    y, res_out = fused_add_rms_norm_ref(x, res_in, w, 1e-6)
    assert res_out.data_ptr() == res_in.data_ptr(), "residual must be updated in place"
    torch.testing.assert_close(res_in, summed, atol=0, rtol=0)
    _close(y, _rms_formula(summed, w, 1e-6), dtype, REF_TOL)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (3, 1000), (1, 4096), (2, 3, 4, 32)])
def test_rms_norm_triton_matches_ref(dtype, shape):
    x = _randn(*shape, dtype=dtype, device=DEVICE)
    w = _randn(shape[-1], dtype=dtype, seed=1, device=DEVICE)
    y = rms_norm_triton(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_rms_norm_triton_strided_head_view(dtype):
    """Qwen3 q_norm: [T, Hq, D] view into the fused qkv output, no copy."""
    tokens, hq, hk, head_dim = 5, 3, 1, 32
    qkv = _randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype, device=DEVICE)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    w = _randn(head_dim, dtype=dtype, seed=1, device=DEVICE)
    _close(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("hidden", [48, 256])
def test_fused_add_rms_norm_triton_matches_ref(dtype, hidden):
    x = _randn(7, hidden, dtype=dtype, device=DEVICE)
    res = _randn(7, hidden, dtype=dtype, seed=1, device=DEVICE)
    w = _randn(hidden, dtype=dtype, seed=2, device=DEVICE)
    res_ref, res_tri = res.clone(), res.clone()
    y_ref, _ = fused_add_rms_norm_ref(x, res_ref, w, 1e-5)
    y_tri, out_res = fused_add_rms_norm_triton(x, res_tri, w, 1e-5)
    assert out_res.data_ptr() == res_tri.data_ptr()
    torch.testing.assert_close(res_tri, res_ref, atol=0, rtol=0)
    _close(y_tri, y_ref, dtype)


# ----------------------------------------------------------------------------------------------
# SiLU-and-mul
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_silu_and_mul_ref_matches_formula(dtype):
    x = _randn(4, 2 * 24, dtype=dtype) * 4
    gate, up = x[:, :24].double(), x[:, 24:].double()
    expected = gate / (1 + torch.exp(-gate)) * up
    y = silu_and_mul_ref(x)
    assert y.shape == (4, 24) and y.dtype == dtype
    _close(y, expected, dtype, REF_TOL)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 40), (2, 2 * 1500), (2, 2, 2 * 64)])
def test_silu_and_mul_triton_matches_ref(dtype, shape):
    x = _randn(*shape, dtype=dtype, device=DEVICE) * 4
    y = silu_and_mul_triton(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2)
    _close(y, silu_and_mul_ref(x), dtype)


# ----------------------------------------------------------------------------------------------
# Rotary
# ----------------------------------------------------------------------------------------------


def _complex_rotation(positions, x, head_dim, rot_dim, base):
    """Neox rotary as complex multiplication: (x[j] + i x[j+half]) * exp(i pos base^(-2j/rot))."""
    half = rot_dim // 2
    x3 = x.reshape(x.shape[0], -1, head_dim).double()
    theta = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rot_dim)
    angle = positions.double()[:, None] * theta
    z = torch.complex(x3[..., :half], x3[..., half:rot_dim]) * torch.polar(torch.ones_like(angle), angle)[:, None]
    out = x3.clone()
    out[..., :half], out[..., half:rot_dim] = z.real, z.imag
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype", REF_DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_ref_matches_complex_rotation(dtype, head_dim, rot_dim):
    tokens, hq, hk, base = 6, 4, 2, 10000.0
    positions = torch.tensor([0, 1, 7, 100, 255, 3])
    cache = build_cos_sin_cache(rot_dim, 256, base)
    q, k = _randn(tokens, hq * head_dim, dtype=dtype), _randn(tokens, hk * head_dim, dtype=dtype, seed=1)
    q_exp = _complex_rotation(positions, q, head_dim, rot_dim, base)
    k_exp = _complex_rotation(positions, k, head_dim, rot_dim, base)
    q_out, k_out = rotary_neox_ref(positions, q, k, cache, head_dim)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "in place"
    atol = 1e-4 if dtype == torch.float32 else REF_TOL[dtype][0] * 4
    torch.testing.assert_close(q.double(), q_exp, atol=atol, rtol=REF_TOL[dtype][1])
    torch.testing.assert_close(k.double(), k_exp, atol=atol, rtol=REF_TOL[dtype][1])


def test_rotary_ref_writes_through_qkv_views():
    tokens, hq, hk, head_dim = 3, 2, 1, 16
    qkv = _randn(tokens, (hq + 2 * hk) * head_dim)
    original = qkv.clone()
    q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim : (hq + hk) * head_dim]
    positions = torch.tensor([5, 0, 9])
    rotary_neox_ref(positions, q, k, build_cos_sin_cache(head_dim, 16, 10000.0), head_dim)
    expected_q = _complex_rotation(positions, original[:, : hq * head_dim], head_dim, head_dim, 10000.0)
    torch.testing.assert_close(qkv[:, : hq * head_dim].double(), expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, (hq + hk) * head_dim :], original[:, (hq + hk) * head_dim :])  # v untouched


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("hq,hk,head_dim,rot_dim", [(4, 1, 64, 64), (6, 2, 128, 128), (2, 2, 64, 32)])
def test_rotary_triton_matches_ref(dtype, hq, hk, head_dim, rot_dim):
    tokens = 5
    cache = build_cos_sin_cache(rot_dim, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 3, 63, 17, 1], device=DEVICE)
    qkv = _randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype, device=DEVICE)
    qkv_ref = qkv.clone()
    split = (hq * head_dim, hk * head_dim, hk * head_dim)
    q, k, _ = qkv.split(split, dim=-1)
    q_ref, k_ref, _ = qkv_ref.split(split, dim=-1)
    rotary_neox_ref(positions, q_ref, k_ref, cache, head_dim)
    q_out, k_out = rotary_neox_triton(positions, q, k, cache, head_dim)
    assert q_out is q and k_out is k
    _close(qkv, qkv_ref, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_rotary_triton_accepts_3d_views(dtype):
    tokens, hq, hk, head_dim = 4, 2, 1, 64
    cache = build_cos_sin_cache(head_dim, 32, 1e6).to(DEVICE)
    positions = torch.tensor([31, 0, 2, 8], device=DEVICE)
    q = _randn(tokens, hq, head_dim, dtype=dtype, device=DEVICE)
    k = _randn(tokens, hk, head_dim, dtype=dtype, seed=1, device=DEVICE)
    q_ref, k_ref = rotary_neox_ref(positions, q.clone(), k.clone(), cache, head_dim)
    rotary_neox_triton(positions, q, k, cache, head_dim)
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)


# ----------------------------------------------------------------------------------------------
# cos/sin cache
# ----------------------------------------------------------------------------------------------


def test_cos_sin_cache_default_and_linear():
    rot_dim, base = 32, 10000.0
    table = build_cos_sin_cache(rot_dim, 50, base)
    assert table.shape == (50, rot_dim) and table.dtype == torch.float32
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(50, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], -1), atol=1e-5, rtol=0)
    linear = build_cos_sin_cache(rot_dim, 50, base, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear.double(), torch.cat([(angles / 4).cos(), (angles / 4).sin()], -1),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="dynamic"):
        build_cos_sin_cache(rot_dim, 50, base, {"type": "dynamic", "factor": 2.0})


ROPE_SCALINGS = [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    # DeepSeek-V2-Lite's config (legacy "type" key); mscale == mscale_all_dim -> attention factor 1
    {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096},
    {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096},
    {"rope_type": "linear", "factor": 2.0},
]


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=lambda s: f"{s.get('rope_type', s.get('type'))}")
def test_cos_sin_cache_matches_transformers(scaling):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    rot_dim, base, max_pos = 64, 10000.0 if "yarn" in str(scaling) else 500000.0, 163840
    kind = scaling.get("rope_type", scaling.get("type"))
    params = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind, "rope_theta": base}
    config = LlamaConfig(hidden_size=4 * rot_dim, num_attention_heads=4, head_dim=rot_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)
    inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    positions = torch.tensor([0, 1, 17, 4095, 4096, 100000, max_pos - 1])
    angles = torch.outer(positions.float(), inv_freq.float())
    expected = torch.cat([angles.cos(), angles.sin()], -1) * attention_factor
    table, mscale = build_cos_sin_cache(rot_dim, max_pos, base, scaling, return_mscale=True)
    assert mscale == pytest.approx(attention_factor, rel=1e-12)
    assert rope_mscale(scaling) == pytest.approx(attention_factor, rel=1e-12)
    torch.testing.assert_close(table[positions], expected, atol=1e-6, rtol=1e-6)


def test_yarn_mscale_is_applied_to_cos_sin():
    scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024}
    table, mscale = build_cos_sin_cache(32, 8, 10000.0, scaling, return_mscale=True)
    assert mscale == pytest.approx(0.1 * math.log(16.0) + 1.0)
    norms = table[:, :16].square() + table[:, 16:].square()  # cos^2 + sin^2 = mscale^2
    torch.testing.assert_close(norms, torch.full_like(norms, mscale**2))


# ----------------------------------------------------------------------------------------------
# HF transformers' rounding points: the references equal HF's Qwen3 modules bit for bit
# ----------------------------------------------------------------------------------------------


def _bits_equal(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual != expected).sum().item()
    assert torch.equal(actual, expected), f"{diff} of {actual.numel()} elements differ from HF"


@pytest.mark.parametrize("dtype", REF_DTYPES)
@pytest.mark.parametrize("hidden", [128, 4096])
def test_rms_norm_ref_equals_hf_qwen3_rmsnorm(dtype, hidden):
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    norm = qwen3.Qwen3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * _randn(hidden, seed=1))
    norm = norm.to(dtype)
    x, res = _randn(9, hidden, dtype=dtype) * 3, _randn(9, hidden, dtype=dtype, seed=2)
    with torch.no_grad():
        _bits_equal(rms_norm_ref(x, norm.weight, 1e-6), norm(x))
        summed = res + x  # HF decoder layer: hidden_states = residual + hidden_states
        res_ours = res.clone()
        y, _ = fused_add_rms_norm_ref(x, res_ours, norm.weight, 1e-6)
        _bits_equal(res_ours, summed)
        _bits_equal(y, norm(summed))


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_rotary_ref_equals_hf_apply_rotary_pos_emb(dtype):
    transformers = pytest.importorskip("transformers")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    tokens, hq, hk, head_dim, theta, max_pos = 7, 4, 2, 128, 1e6, 40960
    config = transformers.Qwen3Config(hidden_size=hq * head_dim, num_attention_heads=hq, num_key_value_heads=hk,
                                      head_dim=head_dim, rope_theta=theta, max_position_embeddings=max_pos)
    positions = torch.tensor([0, 1, 7, 100, 4095, 30000, max_pos - 1])
    q, k = _randn(tokens, hq * head_dim, dtype=dtype), _randn(tokens, hk * head_dim, dtype=dtype, seed=1)
    # HF layout [B, heads, T, D]; cos/sin from HF's rotary embedding, cast to q's dtype
    q_hf, k_hf = (t.view(1, tokens, -1, head_dim).transpose(1, 2) for t in (q, k))
    cos, sin = qwen3.Qwen3RotaryEmbedding(config)(q_hf, positions[None])
    assert cos.dtype == dtype
    q_exp, k_exp = qwen3.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    q_exp, k_exp = (t.transpose(1, 2).reshape(tokens, -1) for t in (q_exp, k_exp))
    rotary_neox_ref(positions, q, k, build_cos_sin_cache(head_dim, max_pos, theta), head_dim)
    _bits_equal(q, q_exp)
    _bits_equal(k, k_exp)


def test_rotary_module_equals_hf_apply_rotary_pos_emb():
    """layers.rotary.RotaryEmbedding, the module a model holds (its cache is what the backends' fused rope
    reads; its forward rotates q and k for standalone use), equals HF's rotation at every position."""
    transformers = pytest.importorskip("transformers")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from metainfer.layers.rotary import RotaryEmbedding

    tokens, hq, hk, head_dim, theta, max_pos = 5, 2, 1, 64, 1e4, 4096
    config = transformers.Qwen3Config(hidden_size=hq * head_dim, num_attention_heads=hq, num_key_value_heads=hk,
                                      head_dim=head_dim, rope_theta=theta, max_position_embeddings=max_pos)
    positions = torch.tensor([0, 3, 17, 1000, max_pos - 1])
    q, k = _randn(tokens, hq * head_dim, seed=4), _randn(tokens, hk * head_dim, seed=5)
    q_hf, k_hf = (t.view(1, tokens, -1, head_dim).transpose(1, 2) for t in (q, k))
    cos, sin = qwen3.Qwen3RotaryEmbedding(config)(q_hf, positions[None])
    q_exp, k_exp = (t.transpose(1, 2).reshape(tokens, -1) for t in qwen3.apply_rotary_pos_emb(q_hf, k_hf, cos, sin))
    rotary = RotaryEmbedding(head_dim, head_dim, max_pos, theta, None, select_ops("cpu"))
    out = rotary(positions, q, k)
    q_got, k_got = (q, k) if out is None else out
    torch.testing.assert_close(q_got, q_exp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_got, k_exp, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_silu_and_mul_ref_equals_hf_qwen3_mlp(dtype):
    transformers = pytest.importorskip("transformers")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, hidden_act="silu")
    torch.manual_seed(0)
    mlp = qwen3.Qwen3MLP(config).to(dtype)
    mlp.down_proj = torch.nn.Identity()  # what remains is act_fn(gate_proj(x)) * up_proj(x)
    x = _randn(11, 64, dtype=dtype, seed=3) * 8
    with torch.no_grad():
        expected = mlp(x)
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    _bits_equal(silu_and_mul_ref(gate_up), expected)
    g = _randn(5, 300, dtype=dtype, seed=4) * 6
    _bits_equal(silu_and_mul_ref(g), torch.nn.functional.silu(g[:, :150]) * g[:, 150:])


def _mismatch(a, b) -> float:
    return (a != b).float().mean().item()


@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float32])
def test_triton_kernels_round_where_the_refs_do(dtype):
    """In half precision the kernels agree with the references' rounding points element for element
    (but for rare 1-ulp ties from exp/rsqrt/reduction order), while rounding only once differs
    from them on a large fraction of elements (so the check has teeth)."""
    x = _randn(8, 1000, dtype=dtype, device=DEVICE)
    w = _randn(1000, dtype=dtype, seed=1, device=DEVICE)
    xf = x.float()
    once = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    ref = rms_norm_ref(x, w, 1e-6)
    assert _mismatch(rms_norm_triton(x, w, 1e-6), ref) < 0.01 and _mismatch(once, ref) > 0.05

    g = _randn(4, 2 * 1000, dtype=dtype, seed=2, device=DEVICE) * 4
    once = (torch.nn.functional.silu(g[:, :1000].float()) * g[:, 1000:].float()).to(dtype)
    ref = silu_and_mul_ref(g)
    assert _mismatch(silu_and_mul_triton(g), ref) < 0.01 and _mismatch(once, ref) > 0.05

    tokens, heads, head_dim = 5, 4, 128
    cache = build_cos_sin_cache(head_dim, 64, 1e6).to(DEVICE)
    positions = torch.tensor([0, 3, 63, 17, 1], device=DEVICE)
    q = _randn(tokens, heads * head_dim, dtype=dtype, seed=3, device=DEVICE)
    qf, cs = q.float().view(tokens, heads, head_dim), cache[positions][:, None]
    half = head_dim // 2
    x1, x2, cos, sin = qf[..., :half], qf[..., half:], cs[..., :half], cs[..., half:]
    once = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(dtype).view(tokens, -1)
    ref, tri = q.clone(), q.clone()
    rotary_neox_ref(positions, ref, None, cache, head_dim)
    rotary_neox_triton(positions, tri, None, cache, head_dim)
    assert _mismatch(once, ref) > 0.05
    if ON_GPU:  # FMA contraction and approximate exp may flip a rare last bit
        assert _mismatch(tri, ref) < 0.01
    else:  # elementwise fp32 math on the same rounded operands: bit for bit in the interpreter
        _bits_equal(tri, ref)


# ----------------------------------------------------------------------------------------------
# op selection, import hygiene, AOT compile for sm_90
# ----------------------------------------------------------------------------------------------


def test_select_ops():
    cpu_ops = select_ops("cpu")
    assert isinstance(cpu_ops, KernelOps) and cpu_ops.rms_norm is rms_norm_ref
    assert cpu_ops.backend == "torch" and cpu_ops.pdl is False  # the references, nothing bound to PDL
    assert cpu_ops.paged_prefill_attention.__name__ == "paged_prefill_attention_ref"
    cuda_ops = select_ops(torch.device("cuda"))  # selection only: no CUDA call is made
    assert cuda_ops.rms_norm is rms_norm_triton and cuda_ops.silu_and_mul is silu_and_mul_triton
    assert select_ops("cuda", use_triton=False) is cpu_ops
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu_ops.rms_norm = None


def test_import_without_triton_and_without_cuda_init():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('triton blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, metainfer.kernels as K\n"
        "assert not K.HAS_TRITON\n"
        "assert not torch.cuda.is_initialized()\n"
        "x = torch.randn(2, 8)\n"
        "K.select_ops('cpu').rms_norm(x, torch.ones(8), 1e-6)\n"
        "try:\n"
        "    K.select_ops('cuda')\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('expected RuntimeError')\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_aot_compile_sm90_elementwise_kernels():
    run_aot_check(["rms_norm", "silu_and_mul", "rotary", "gemv"])


def test_select_ops_gemm_by_gpu_name():
    from metainfer.kernels import gemv
    from metainfer.kernels.tuned_configs import load_tuned_configs

    previous = gemv.get_gemv_configs()
    assert select_ops("cuda", gpu_name="A GPU without a tuned table").linear is gemv.linear_ref
    chosen = select_ops("cuda", gpu_name="NVIDIA H200").linear.keywords["base"]  # under the skinny GEMM's wrapper
    assert chosen.func is gemv.linear_engine
    tuned = load_tuned_configs("NVIDIA H200")
    shipped = gemv.parse_gemv_table(tuned["gemv"])
    assert any(cfg.preload for cfg in shipped.values())
    # without PDL: the no-PDL table (plain loop, no preload: nothing to hide it behind), Qwen3-8B's shapes (the
    # MoE families' batch-1 shapes were tuned under PDL only: cuBLAS without it)
    no_pdl_table = gemv.parse_gemv_table(tuned["gemv_no_pdl"])
    assert not any(cfg.preload for cfg in no_pdl_table.values()) and set(no_pdl_table) < set(shipped)
    assert chosen.keywords == {"table": no_pdl_table, "pdl": False}
    no_pdl = select_ops("cuda", gpu_name="NVIDIA H200")
    assert no_pdl.silu_mul_linear.keywords["table"] is no_pdl.linear.keywords["base"].keywords["table"]
    with_pdl = select_ops("cuda", gpu_name="NVIDIA H200", pdl=True).linear.keywords["base"]
    assert with_pdl.keywords == {"table": shipped, "pdl": True}
    assert select_ops("cuda").linear is gemv.linear_ref  # no name: cuBLAS, and no CUDA call
    assert gemv.get_gemv_configs() == previous  # selection installs nothing process-wide
