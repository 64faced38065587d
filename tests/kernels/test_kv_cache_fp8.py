"""fp8 KV cache (`kv_cache_dtype="fp8"`): float8_e4m3fn K/V with a unit scale, clamped to +-448.

The writers (store_kv, qk_norm_rope_store) must put the same fp8 bits into the
cache as the torch reference's cast; the readers (decode split / one-pass, prefill / extend) must
attend over the widened fp8 values as the torch references do, and the references themselves
must equal a float64 softmax over the dequantised K/V. (The engine with an fp8 cache:
tests/models/test_fp8_kv_parity.py.) On the CPU the kernels run in fp32 and fp16: the interpreter cannot
run bf16, so bf16 q over an fp8 cache here is checked only with METAINFER_TEST_GPU=1 (runs 25-26); its fp8
tensor-core path also runs on the CPU in tests/kernels/test_attention_decode_fp8.py. tests/conftest.py makes the
interpreter's e4m3 conversions the GPU's (round to nearest even, saturating, NaN kept).
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
    qk_norm_rope_store_ref,
    qk_norm_rope_store_triton,
    store_kv_ref,
    store_kv_triton,
)
from metainfer.kernels._triton import tl
from metainfer.kernels._triton import triton as triton_jit
from metainfer.kernels.attention_decode import decode_block_n
from metainfer.kernels.kv_cache import (
    FP8_KV_DTYPE,
    FP8_MAX,
    block_major_copy,
    block_major_k_cache,
    cast_to_cache,
    check_cache_dtype,
    check_v_cache_layout,
    fp8_cache_copy,
    is_token_major,
    to_cache_dtype,
    token_major_v_cache,
)
from tests.helpers.attention_cases import (
    DECODE_CONTEXTS,
    PREFILL_SEQS,
    make_paged_batch,
    naive_attention,
    prefill_inputs,
)
from tests.helpers.attention_cases import clone_args as _clone
from tests.helpers.attention_cases import close as _close
from tests.helpers.attention_cases import decode_step_case as _case
from tests.helpers.attention_cases import randn as _randn
from tests.helpers.attention_cases import store_kv_inputs as _store_kv_inputs
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, REF_DTYPES

triton = pytest.importorskip("triton")


def _to_fp8(batch):
    """The paged batch with fp8 caches in the engine's layouts (K block-major, V token-major); dense K/V replaced by
    the fp8 values they now hold."""
    batch.k_cache, batch.v_cache = fp8_cache_copy(to_cache_dtype(batch.k_cache, FP8_KV_DTYPE),
                                                  to_cache_dtype(batch.v_cache, FP8_KV_DTYPE))
    n, s, hk, d = batch.k_cache.shape
    assert batch.k_cache.stride() == (hk * s * d, d, s * d, 1) and (s == 1 or is_token_major(batch.v_cache))
    batch.dense_k = [to_cache_dtype(k, FP8_KV_DTYPE).double() for k in batch.dense_k]
    batch.dense_v = [to_cache_dtype(v, FP8_KV_DTYPE).double() for v in batch.dense_v]
    return batch


def test_to_cache_dtype_saturates_and_rounds_to_nearest():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.3, -0.0, 1e-4, float("nan")])
    out = to_cache_dtype(x, FP8_KV_DTYPE).float()
    assert out[:3].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX], "out-of-range values saturate, not NaN"
    assert out[3].item() == 0.3125, "0.3 rounds to the nearest e4m3 value"
    assert torch.isnan(out[-1]), "NaN stays NaN"
    assert out[5].item() == 0 and torch.signbit(out[4]) and not torch.signbit(out[5]), "1e-4 -> +0, -0.0 kept"
    assert to_cache_dtype(x, torch.float16).dtype == torch.float16  # other dtypes: a plain cast


@triton_jit.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(y_ptr + i, cast_to_cache(tl.load(x_ptr + i), y_ptr))


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_triton_cast_to_fp8_bits_equal_torch(dtype):
    """Every finite fp8 value, every midpoint between neighbours (ties to even) and its fp32
    neighbours, random values at two scales, out-of-range values and signed zeros: the kernels'
    cast must give torch's bits (compiled: the hardware's; interpreted: no reliance on the
    interpreter's rounding, which drops carries)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([grid, mids, mids.nextafter(up), mids.nextafter(down), torch.randn(2048, generator=gen) * 50,
                   torch.randn(2048, generator=gen) * 0.01, torch.tensor([500.0, -470.0, 449.0, 1e-9, -0.0, 0.0])])
    x = torch.cat([x, torch.zeros(-x.numel() % 256)]).to(dtype).to(DEVICE)
    y = torch.empty(x.numel(), dtype=FP8_KV_DTYPE, device=DEVICE)
    _cast_kernel[(x.numel() // 256,)](x, y, N=256)
    expected = to_cache_dtype(x.cpu(), FP8_KV_DTYPE)
    bad = y.cpu().view(torch.uint8) != expected.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} casts differ, e.g. {x.cpu()[bad][:4].tolist()}"


def test_check_cache_dtype_names_the_mismatch():
    q16 = torch.float16
    check_cache_dtype(q16, torch.empty(0, dtype=q16), torch.empty(0, dtype=q16), "q")
    check_cache_dtype(q16, torch.empty(0, dtype=FP8_KV_DTYPE), torch.empty(0, dtype=FP8_KV_DTYPE), "q")
    with pytest.raises(ValueError, match="KV cache"):
        check_cache_dtype(q16, torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.float32), "q")
    with pytest.raises(ValueError, match="both caches"):
        check_cache_dtype(q16, torch.empty(0, dtype=FP8_KV_DTYPE), torch.empty(0, dtype=q16), "q")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_kv_fp8_bits_equal_reference(dtype, block_size):
    k, v, k_cache, v_cache, slots = _store_kv_inputs(dtype, block_size, DEVICE)
    k = k * 300  # some values beyond 448: they must saturate in both
    v = v * 300
    k_cache, v_cache = fp8_cache_copy(to_cache_dtype(k_cache, FP8_KV_DTYPE), to_cache_dtype(v_cache, FP8_KV_DTYPE))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    assert (k_ref.float().abs() == FP8_MAX).any(), "the case must exercise saturation"
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_decode_ref_fp8_matches_naive_over_dequantised_kv():
    batch = _to_fp8(make_paged_batch(DECODE_CONTEXTS, 16, 2, 64, torch.float32, device="cpu"))
    q = _randn(len(DECODE_CONTEXTS), 8, 64, seed=5)
    out = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    for b, length in enumerate(DECODE_CONTEXTS):
        if length:
            expected = naive_attention(q[b : b + 1], batch.dense_k[b], batch.dense_v[b], 0.125, length - 1)[0]
            torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("launch", [(1, 16), pytest.param((3, 16), marks=pytest.mark.slow), (32, 16)],
                         ids=["one-pass", "split3", "split32"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("group,hk,head_dim,block_size", [(1, 2, 64, 16), (4, 2, 128, 16), (8, 1, 64, 32)])
def test_decode_triton_fp8_matches_ref(group, hk, head_dim, block_size, dtype, launch):
    max_num_splits, block_n = launch
    contexts = DECODE_CONTEXTS + [300]
    batch = _to_fp8(make_paged_batch(contexts, block_size, hk, head_dim, dtype))
    q = _randn(len(contexts), group * hk, head_dim, dtype=dtype, seed=5, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
    expected = paged_decode_attention_ref(*args)
    out = paged_decode_attention_triton(*args, max_num_splits=max_num_splits, block_n=block_n, min_split_tokens=16)
    assert out.dtype == dtype
    _close(out, expected, dtype)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "model-dtype"])
@pytest.mark.parametrize("launch", [(1, 128, None), (1, 128, 16), (1, 16, None), (3, 32, None)],
                         ids=["one-pass-128", "one-pass-128-tail16", "one-pass-16", "split3"])
def test_decode_forced_splits_and_wide_tiles_match_ref(fp8, launch):
    """A forced split count and the 128-token tiles of fp8 launches: ragged contexts, a context of one
    tile plus one token, block boundaries (block 16); over fp8's token-major V, tails of one to eight
    masked tiles (tail_block_n 16; the default, 64, takes one or two)."""
    num_splits, block_n, tail_block_n = launch
    dtype = KERNEL_DTYPES[0]
    contexts = DECODE_CONTEXTS + [block_n + 1, 255, 300]
    batch = make_paged_batch(contexts, 16, 2, 64, dtype)
    if fp8:
        batch = _to_fp8(batch)
    q = _randn(len(contexts), 8, 64, dtype=dtype, seed=7, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    out = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, min_split_tokens=16,
                                        tail_block_n=tail_block_n)
    _close(out, paged_decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("launch", [(1, 128), (3, 64)], ids=["one-pass-128", "split3-64"])
@pytest.mark.parametrize("group,block_size", [(1, 16), (4, 32)], ids=["gqa1-block16", "gqa4-block32"])
def test_decode_token_major_tails_of_16_token_tiles(group, block_size, launch):
    """Token-major V with 16-token tail tiles: the GQA-1 (no tl.dot) path, 32-token blocks (a tail
    tile inside one block), split launches (each split's own tail)."""
    num_splits, block_n = launch
    dtype = KERNEL_DTYPES[0]
    contexts = [1, 17, 70, 255, 300]
    batch = _to_fp8(make_paged_batch(contexts, block_size, 2, 64, dtype))
    q = _randn(len(contexts), 2 * group, 64, dtype=dtype, seed=9, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    out = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, min_split_tokens=16,
                                        tail_block_n=16)
    _close(out, paged_decode_attention_ref(*args), dtype)


def test_decode_tail_block_n_is_checked():
    batch = _to_fp8(make_paged_batch([5, 40], 16, 2, 64, KERNEL_DTYPES[0]))
    q = _randn(2, 8, 64, dtype=KERNEL_DTYPES[0], seed=1, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    for bad in (8, 48, 128):  # below 16, not a power of two, above block_n
        with pytest.raises(ValueError, match="tail_block_n"):
            paged_decode_attention_triton(*args, block_n=64, tail_block_n=bad)


def test_v_cache_layouts():
    memory = torch.zeros(3, 16, 2, 64, dtype=FP8_KV_DTYPE)
    v = token_major_v_cache(memory)
    assert v.shape == memory.shape and v.stride() == (2 * 64 * 16, 1, 64 * 16, 16)
    assert is_token_major(v) and not is_token_major(memory)
    check_v_cache_layout(v)
    with pytest.raises(ValueError, match="token-major"):  # fp8 V head-major: the layout that lost, refused
        check_v_cache_layout(memory)
    check_v_cache_layout(memory.to(torch.float16))  # a 16-bit cache is head-major
    with pytest.raises(ValueError, match="head-major"):
        check_v_cache_layout(token_major_v_cache(memory.to(torch.float16)))
    check_v_cache_layout(torch.zeros(3, 1, 2, 64, dtype=FP8_KV_DTYPE))  # one token a block: both layouts
    v[1, 5, 1, 7] = 2.0  # token 5 of block 1, kv head 1, dim 7: memory [block, head, dim, token]
    assert memory.view(3, 2, 64, 16)[1, 1, 7, 5].item() == 2.0


def test_launchers_reject_a_head_major_fp8_v_cache():
    batch = _to_fp8(make_paged_batch([5, 40], 16, 2, 64, KERNEL_DTYPES[0]))
    bad_v = batch.v_cache.contiguous()  # head-major fp8
    q = _randn(2, 8, 64, dtype=KERNEL_DTYPES[0], seed=1, device=DEVICE)
    with pytest.raises(ValueError, match="token-major"):
        paged_decode_attention_triton(q, batch.k_cache, bad_v, batch.block_tables, batch.context_lens, 0.125)
    k = torch.zeros(3, 2, 64, dtype=KERNEL_DTYPES[0], device=DEVICE)
    with pytest.raises(ValueError, match="token-major"):
        store_kv_triton(k, k, batch.k_cache, bad_v, torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_decode_block_n_rule():
    """128-token tiles for one-pass launches over fp8 (token-major V, run 35), 64 over 16-bit, 32 split."""
    assert decode_block_n(1, FP8_KV_DTYPE) == 128
    assert decode_block_n(3, FP8_KV_DTYPE) == 32
    assert decode_block_n(1, torch.bfloat16) == 64
    assert decode_block_n(4, torch.bfloat16) == 32


def test_decode_launcher_takes_the_tile_from_the_cache_dtype(monkeypatch):
    """The launcher hands decode_block_n the cache dtype: one-pass programs over an fp8 cache take
    128-token tiles."""
    import metainfer.kernels.attention_decode as attention

    chosen = []
    monkeypatch.setattr(attention, "decode_block_n", lambda *a, **kw: chosen.append(decode_block_n(*a, **kw))
                        or chosen[-1])
    batch = _to_fp8(make_paged_batch([5, 40], 16, 8, 64, KERNEL_DTYPES[0]))
    q = _randn(2, 32, 64, dtype=KERNEL_DTYPES[0], seed=1, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    out = paged_decode_attention_triton(*args, max_num_splits=1)
    assert chosen == [128]
    _close(out, paged_decode_attention_ref(*args), KERNEL_DTYPES[0])


def _stale_slots(batch) -> torch.Tensor:
    """[N, S] True where no sequence of the batch has a token (unused blocks, slots past an end)."""
    stale = torch.ones(batch.k_cache.shape[:2], dtype=torch.bool)
    block_size = batch.k_cache.shape[1]
    for b, length in enumerate(batch.context_lens.tolist()):
        for pos in range(length):
            stale[int(batch.block_tables[b, pos // block_size]), pos % block_size] = False
    return stale


@pytest.mark.parametrize("launch", [(1, 128), (3, 32)], ids=["one-pass-128", "split3"])
def test_decode_ignores_nan_in_stale_slots(launch):
    """A freed block keeps what its last owner wrote, NaN included (fp8 0x7f): slots past a row's end
    must add nothing, in the reference (the CPU engine's path) and in the kernel (the token-major tails read
    those slots unmasked and zero them). tests/conftest.py makes the interpreter widen 0x7f to NaN, as the GPU
    does."""
    num_splits, block_n = launch
    dtype = KERNEL_DTYPES[0]
    contexts = [1, 17, 70, 129, 300]
    batch = _to_fp8(make_paged_batch(contexts, 16, 2, 64, dtype))
    stale = _stale_slots(batch).to(batch.k_cache.device)[:, :, None, None]
    q = _randn(len(contexts), 8, 64, dtype=dtype, seed=3, device=DEVICE)
    clean = [c.clone() for c in (batch.k_cache, batch.v_cache)]  # clone keeps V's layout
    for cache in clean:
        cache.view(torch.uint8).masked_fill_(stale, 0)
    expected = paged_decode_attention_ref(q, *clean, batch.block_tables, batch.context_lens, 0.125)
    for cache in (batch.k_cache, batch.v_cache):
        cache.view(torch.uint8).masked_fill_(stale, 0x7F)  # e4m3fn NaN
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    assert batch.v_cache.float().isnan().any()
    torch.testing.assert_close(paged_decode_attention_ref(*args), expected, rtol=0, atol=0)
    out = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, min_split_tokens=16)
    assert not out.float().isnan().any()
    _close(out, expected, dtype)


def test_decode_num_splits_override_is_bounded():
    batch = make_paged_batch([5, 40], 16, 2, 64, KERNEL_DTYPES[0])
    q = _randn(2, 8, 64, dtype=KERNEL_DTYPES[0], seed=1, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    for bad in (0, 33):
        with pytest.raises(ValueError, match="num_splits"):
            paged_decode_attention_triton(*args, num_splits=bad)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("group,hk,head_dim,block_size", [(1, 2, 64, 16), (4, 1, 128, 32), (8, 1, 64, 1)])
def test_prefill_triton_fp8_matches_ref_and_naive(group, hk, head_dim, block_size, dtype):
    """Plain prefill, prefix-cache hits / chunked prefill (q_len < context) and a one-token extend."""
    batch, q, cu, max_q = prefill_inputs(PREFILL_SEQS, group, hk, head_dim, block_size, dtype)
    batch = _to_fp8(batch)
    args = (q, batch.k_cache, batch.v_cache, cu, batch.context_lens, batch.block_tables, max_q, head_dim**-0.5)
    expected = paged_prefill_attention_ref(*args)
    out = paged_prefill_attention_triton(*args, block_m=16, block_n=16)
    _close(out, expected, dtype)
    for b, (q_len, length) in enumerate(PREFILL_SEQS):
        s, e = int(cu[b]), int(cu[b + 1])
        naive = naive_attention(q[s:e].cpu(), batch.dense_k[b], batch.dense_v[b], head_dim**-0.5, length - q_len)
        _close(expected[s:e], naive, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_qk_norm_rope_store_fp8_bits_equal_reference(dtype):
    a = _case([5, 17, 40], 4, 2, 64, 64, True, 16, dtype)
    a["k_cache"], a["v_cache"] = fp8_cache_copy(to_cache_dtype(a["k_cache"], FP8_KV_DTYPE),
                                                to_cache_dtype(a["v_cache"], FP8_KV_DTYPE))
    names = ("qkv", "positions", "cos_sin", "q_norm_w", "k_norm_w", "eps", "k_cache", "v_cache", "slot_mapping",
             "num_q_heads", "num_kv_heads", "head_dim")
    ref, tri = _clone(a), _clone(a)
    qk_norm_rope_store_ref(*(ref[n] for n in names))
    qk_norm_rope_store_triton(*(tri[n] for n in names))
    for name in ("k_cache", "v_cache"):
        same = tri[name].view(torch.uint8) == ref[name].view(torch.uint8)
        assert same.float().mean().item() >= 0.999, name  # rare 1-ulp flips of the normed k before the cast
    assert torch.equal(tri["v_cache"].view(torch.uint8), ref["v_cache"].view(torch.uint8)), "v is cast as projected"


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "model-dtype"])
@pytest.mark.parametrize("launch", [(1, 128), (3, 32)], ids=["one-pass-128", "split3"])
def test_decode_takes_either_k_layout(fp8, launch):
    """The decode kernel addresses K through its strides only: over a head-major K and a block-major one (the
    engine's fp8 layout, kernels/kv_cache.block_major_k_cache) it gives the reference's output."""
    max_num_splits, block_n = launch
    contexts, dtype = DECODE_CONTEXTS + [300], torch.float16
    batch = make_paged_batch(contexts, 16, 2, 64, dtype)
    if fp8:
        batch = _to_fp8(batch)
    q = _randn(len(contexts), 8, 64, dtype=dtype, seed=7, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    expected = paged_decode_attention_ref(*args)
    head_major, block_major = batch.k_cache.contiguous(), block_major_copy(batch.k_cache)
    assert block_major.stride() == (2 * 16 * 64, 64, 16 * 64, 1)
    for k_cache in (head_major, block_major):
        assert torch.equal(k_cache.float(), batch.k_cache.float())
        out = paged_decode_attention_triton(q, k_cache, *args[2:], max_num_splits=max_num_splits, block_n=block_n,
                                            min_split_tokens=16)
        _close(out, expected, dtype)


def test_k_cache_block_major_layout():
    """K[b, t, h, x] of the block-major view is element b*Hk*S*D + h*S*D + t*D + x of its memory (written out here)."""
    n, s, hk, d = 3, 16, 2, 64
    memory = to_cache_dtype(torch.randn(n, s, hk, d) * 4, FP8_KV_DTYPE)
    flat = memory.clone().flatten()
    k = block_major_k_cache(memory)
    assert k.shape == memory.shape and k.stride() == (hk * s * d, d, s * d, 1)
    index = torch.arange(n * s * hk * d).view(n, s, hk, d)
    b, t, h, x = (index // (s * hk * d)), (index // (hk * d)) % s, (index // d) % hk, index % d
    assert torch.equal(k.float(), flat[b * hk * s * d + h * s * d + t * d + x].float())


def test_fp8_cache_copy_keeps_the_values_in_the_engine_layouts():
    k_src = to_cache_dtype(torch.randn(4, 16, 2, 32) * 4, FP8_KV_DTYPE)
    v_src = to_cache_dtype(torch.randn(4, 16, 2, 32) * 4, FP8_KV_DTYPE)
    k, v = fp8_cache_copy(k_src, v_src)
    assert k.stride() == (2 * 16 * 32, 32, 16 * 32, 1) and v.stride() == (2 * 32 * 16, 1, 32 * 16, 16)
    assert torch.equal(k.float(), k_src.float()) and torch.equal(v.float(), v_src.float())
