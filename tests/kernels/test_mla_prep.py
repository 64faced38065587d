"""MLA's fused per-token prep (kernels/mla_prep.py): kv_a_layernorm + interleaved rope + latent store in one
launch, against the reference (itself against a direct computation: HF's RMSNorm and a complex-number
rotation), interpreted on the CPU in fp32/fp16 (compiled in bf16 on the GPU), strided inputs, skipped
slots and an fp8 cache. The sm_90 compile check: tests/kernels/test_mla_attention.py."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import FP8_KV_DTYPE, build_cos_sin_cache
from metainfer.kernels.kv_cache import to_cache_dtype
from metainfer.kernels.mla_prep import mla_latent_prep_ref, mla_latent_prep_triton
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES

pytest.importorskip("triton")

L, R, H, BLOCK, BLOCKS = 64, 16, 4, 16, 8


def _inputs(dtype, device, cache_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = 7
    fused = torch.randn(tokens, 40 + L + R, generator=g).to(device=device, dtype=dtype)  # a wider projection
    latent = fused[:, 40:]
    q = torch.randn(tokens, H, 24 + R, generator=g).to(device=device, dtype=dtype)
    q_pe = q[..., 24:]
    weight = (1 + 0.3 * torch.randn(L, generator=g)).to(device=device, dtype=dtype)
    positions = torch.tensor([0, 5, 17, 3, 99, 64, 250], device=device)
    cos_sin = build_cos_sin_cache(R, 256, 1e4, {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64}).to(device)
    cache = torch.randn(BLOCKS, BLOCK, L + R, generator=g).to(device=device, dtype=dtype)
    cache = to_cache_dtype(cache, cache_dtype or dtype)
    slots = torch.tensor([3, -1, 40, 127, 16, -1, 90], dtype=torch.int32, device=device)
    return latent, weight, positions, q, q_pe, cos_sin, cache, slots


def test_reference_matches_a_direct_computation():
    latent, weight, positions, q, q_pe, cos_sin, cache, slots = _inputs(torch.float32, "cpu")
    before, q_before, latent_before = cache.clone(), q_pe.clone(), latent.clone()
    mla_latent_prep_ref(latent, weight, 1e-6, positions, q_pe, cos_sin, cache, slots)
    c = latent_before[:, :L]
    normed = weight * (c * torch.rsqrt(c.square().mean(-1, keepdim=True) + 1e-6))
    angle = cos_sin[positions, : R // 2], cos_sin[positions, R // 2:]
    rotor = torch.complex(angle[0], angle[1])

    def rotate(x, rot):
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) * rot).flatten(-2)

    expected = before.clone().view(-1, L + R)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot] = torch.cat([normed[t], rotate(latent_before[t, L:], rotor[t])])
    torch.testing.assert_close(cache.view(-1, L + R), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_pe, rotate(q_before, rotor[:, None]), rtol=1e-5, atol=1e-5)
    assert torch.equal(latent, latent_before)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_matches_reference(dtype, fp8):
    args = _inputs(dtype, DEVICE, FP8_KV_DTYPE if fp8 else None)
    latent, weight, positions, q, q_pe, cos_sin, cache, slots = args
    ref_q, ref_cache = q.clone(), cache.clone()
    mla_latent_prep_ref(latent, weight, 1e-6, positions, ref_q[..., 24:], cos_sin, ref_cache, slots)
    mla_latent_prep_triton(latent, weight, 1e-6, positions, q_pe, cos_sin, cache, slots)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 and not fp8 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cache.float(), ref_cache.float(), **tol)
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=1e-6, atol=1e-6)



@pytest.mark.skipif(DEVICE != "cuda", reason="real dims in bf16 run compiled on the GPU (METAINFER_TEST_GPU=1)")
def test_triton_matches_reference_at_deepseek_dims_gpu():
    g = torch.Generator().manual_seed(3)
    lat, rot, heads, tokens = 512, 64, 16, 37
    fused = torch.randn(tokens, 3072 + lat + rot, generator=g).to("cuda", torch.bfloat16)
    latent = fused[:, 3072:]
    q = torch.randn(tokens, heads, 128 + rot, generator=g).to("cuda", torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(lat, generator=g)).to("cuda", torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to("cuda")
    cos_sin = build_cos_sin_cache(rot, 4096, 1e4, {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                                   "mscale_all_dim": 0.707,
                                                   "original_max_position_embeddings": 4096}).to("cuda")
    cache = torch.randn(64, 16, lat + rot, generator=g).to("cuda", torch.bfloat16)
    slots = torch.randperm(64 * 16, generator=g)[:tokens].to("cuda", torch.int32)
    slots[::5] = -1
    ref_q, ref_cache = q.clone(), cache.clone()
    mla_latent_prep_ref(latent, weight, 1e-6, positions, ref_q[..., 128:], cos_sin, ref_cache, slots)
    mla_latent_prep_triton(latent, weight, 1e-6, positions, q[..., 128:], cos_sin, cache, slots)
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(q, ref_q)  # the rope's rounding is the reference's (fp32 math, one rounding)
