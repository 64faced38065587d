"""The fp8 tensor-core decode kernel (kernels/attention_decode_fp8.py): bf16 q over an fp8 cache in the engine's
layouts, against the float64 reference over the same fp8 values. The interpreter runs it on the CPU (the kernel
widens q to fp32 as it loads it and writes bf16 only at its store; tests/conftest.py makes the interpreter's e4m3
conversions the GPU's: round to nearest even, saturating, NaN kept); compiled with METAINFER_TEST_GPU=1.

The tolerance (1e-2) is a third of the bf16 attention tests': the kernel's error is the bf16 output's rounding
plus probabilities kept to ~8 bits. Dropping either low e4m3 term (q's or the probabilities') gives 0.05-0.16."""

from __future__ import annotations

import types

import pytest
import torch

from metainfer.kernels import paged_decode_attention_ref, paged_decode_attention_triton
from metainfer.kernels.attention_decode import _has_wgmma, decode_block_n, uses_fp8_mma
from metainfer.kernels.kv_cache import (
    FP8_KV_DTYPE,
    block_major_k_cache,
    fp8_cache_copy,
    to_cache_dtype,
    token_major_v_cache,
)
from tests.helpers.attention_cases import make_paged_batch, randn
from tests.helpers.kernel_devices import DEVICE

pytest.importorskip("triton")

TOL = 1e-2


def _fp8_batch(contexts, block_size, hk, head_dim):
    batch = make_paged_batch(contexts, block_size, hk, head_dim, torch.float32)
    k, v = fp8_cache_copy(to_cache_dtype(batch.k_cache, FP8_KV_DTYPE), to_cache_dtype(batch.v_cache, FP8_KV_DTYPE))
    return k, v, batch.block_tables, batch.context_lens


def _check(q, k, v, tables, lens, scale, **launch):
    assert uses_fp8_mma(q.dtype, k, v)
    out = paged_decode_attention_triton(q, k, v, tables, lens, scale, **launch)
    expected = paged_decode_attention_ref(q.double(), k, v, tables, lens, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split3"])
@pytest.mark.parametrize("group,hk,head_dim,block_size", [(4, 2, 128, 16), (1, 2, 64, 32), (8, 1, 64, 16)],
                         ids=["gqa4-d128", "mha-d64-block32", "gqa8-d64"])
def test_fp8_mma_decode_matches_reference(group, hk, head_dim, block_size, num_splits):
    """Ragged contexts: empty, one token, tails inside a block and across blocks, full 64-token tiles then a
    tail (300); split launches' own tails."""
    contexts = [0, 1, 17, 70, 129, 300]
    k, v, tables, lens = _fp8_batch(contexts, block_size, hk, head_dim)
    q = randn(len(contexts), group * hk, head_dim, dtype=torch.float32, seed=5, device=DEVICE).to(torch.bfloat16)
    _check(q, k, v, tables, lens, head_dim**-0.5, num_splits=num_splits, min_split_tokens=16)


def test_fp8_mma_decode_keeps_q_exact_over_its_range():
    """q rows spanning 2^-12 .. 2^6 around a few large values, and a zero row: the per-row power-of-two scale and
    the two e4m3 terms must hold every value that matters; a peaked softmax (scale 1) on top."""
    contexts = [40, 200]
    k, v, tables, lens = _fp8_batch(contexts, 16, 2, 128)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 128, generator=gen) * torch.exp2(torch.randint(-12, 7, (2, 8, 128), generator=gen).float())
    q[1, 3] = 0.0
    _check(q.to(torch.bfloat16).to(DEVICE), k, v, tables, lens, 1.0 / 64)


@pytest.mark.parametrize("context,sink,rest", [(4096, 13.0, 0.25), (4096, 12.0, 0.5625), (8192, 8.0, 0.5)])
def test_fp8_mma_decode_adds_up_the_small_probabilities_of_a_long_context(context, sink, rest):
    """One token dominates (an attention sink) and thousands of others each get p ~ 2^-11 .. 2^-18 of it, together
    1-10% of the weight: the output is their V. Probabilities split into terms that underflow e4m3 drop them
    (0.0 against 0.0117 in the first case) while the row sum still counts them."""
    d, block = 64, 16
    k = torch.zeros(context // block, block, 1, d)
    v = torch.ones(context // block, block, 1, d)
    k[..., 0] = rest
    k[0, 0, 0, 0], v[0, 0, 0] = sink, 0.0
    kc, vc = fp8_cache_copy(to_cache_dtype(k, FP8_KV_DTYPE), to_cache_dtype(v, FP8_KV_DTYPE))
    q = torch.zeros(1, 4, d, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    tables = torch.arange(context // block, dtype=torch.int32)[None, :]
    lens = torch.tensor([context], dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, kc, vc, tables, lens)]
    out = paged_decode_attention_triton(*args, 1.0, num_splits=1)
    expected = paged_decode_attention_ref(args[0].double(), *args[1:], 1.0)
    assert 0.01 < expected[0, 0, 0] < 0.99  # the small probabilities carry a visible share
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), rtol=2e-2, atol=1e-4)


def test_fp8_mma_decode_ignores_stale_slots():
    """Slots past a row's end hold fp8 NaN (0x7f) from a block's last owner: the tail tiles read them (clamped pages,
    unmasked loads), leave their scores out and zero their V before P @ V (0 x NaN would be NaN)."""
    contexts = [3, 70, 150]
    k, v, tables, lens = _fp8_batch(contexts, 16, 2, 64)
    q = randn(len(contexts), 8, 64, dtype=torch.float32, seed=2, device=DEVICE).to(torch.bfloat16)
    valid = torch.zeros(k.shape[:2], dtype=torch.bool)
    for b, length in enumerate(lens.tolist()):
        for pos in range(length):
            valid[int(tables[b, pos // 16]), pos % 16] = True
    stale = (~valid).to(k.device)[:, :, None, None]
    for cache in (k, v):
        cache.view(torch.uint8).masked_fill_(stale, 0x7F)
    assert paged_decode_attention_triton(q, k, v, tables, lens, 0.125).isfinite().all()
    _check(q, k, v, tables, lens, 0.125)  # the reference skips stale slots (test_kv_cache_fp8.py)


def test_fp8_mma_is_chosen_for_bf16_q_over_the_engine_fp8_layouts_only(monkeypatch):
    k = block_major_k_cache(torch.empty(4, 16, 2, 128, dtype=FP8_KV_DTYPE))
    v = token_major_v_cache(torch.empty(4, 16, 2, 128, dtype=FP8_KV_DTYPE))
    assert uses_fp8_mma(torch.bfloat16, k, v)
    assert not uses_fp8_mma(torch.float16, k, v)  # fp16 q keeps its 11 bits: the widening kernel
    assert not uses_fp8_mma(torch.float32, k, v)
    odd = token_major_v_cache(torch.empty(4, 16, 2, 96, dtype=FP8_KV_DTYPE))
    assert not uses_fp8_mma(torch.bfloat16, block_major_k_cache(torch.empty(4, 16, 2, 96, dtype=FP8_KV_DTYPE)), odd)
    one = torch.empty(4, 1, 2, 128, dtype=FP8_KV_DTYPE)  # a block of one token: no token-major V
    assert not uses_fp8_mma(torch.bfloat16, one, one)
    bf16 = torch.empty(4, 16, 2, 128, dtype=torch.bfloat16)
    assert not uses_fp8_mma(torch.bfloat16, bf16, bf16)
    # on CUDA only from compute capability 9.0 (sm_90's wgmma); an sm_89 GPU keeps the widening kernel
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=k.dtype, shape=k.shape)
    for capability, chosen in (((8, 9), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        _has_wgmma.cache_clear()
        assert uses_fp8_mma(torch.bfloat16, on_gpu, v) is chosen
    _has_wgmma.cache_clear()
    # its tiles' tokens are a wgmma's M: at least 64, split launches included
    assert decode_block_n(3, FP8_KV_DTYPE, fp8_mma=True) == 64
    assert decode_block_n(1, FP8_KV_DTYPE, fp8_mma=True) == 64
