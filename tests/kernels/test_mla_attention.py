"""MLA kernels (kernels/mla_attention.py): latent store, interleaved rope, split-KV decode, causal prefill.

The references (mla_ref.py) are checked against independent computations: the store against a Python
loop, the rope against transformers' complex-number form, the attention against a naive float64 dense
attention over the expanded per-head K = [c, k_pe], V = c with a materialised causal mask. The Triton
kernels (interpreted on the CPU in fp32/fp16 at small dims; bf16 at DeepSeek-V2-Lite's dims on the GPU)
are checked against the references. Every case scatters the sequences into shuffled cache blocks whose
other slots hold garbage, so a wrong block-table lookup or an unmasked read shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import build_cos_sin_cache
from metainfer.kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype
from metainfer.kernels.mla_attention import (
    mla_decode_attention_triton,
    mla_decode_num_splits,
    mla_decode_workspace_numel,
    mla_prefill_attention_triton,
)
from metainfer.kernels.mla_expanded import mla_expanded_attention_triton
from metainfer.kernels.mla_ref import (
    mla_decode_attention_ref,
    mla_expanded_attention_ref,
    mla_prefill_attention_ref,
    rotary_interleaved_ref,
    store_latent_ref,
)
from tests.helpers.aot import aot_main, run_aot_main
from tests.helpers.attention_cases import assert_relaunchable, close, naive_attention
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, ON_GPU
from tests.helpers.tensors import randn

triton = pytest.importorskip("triton")

# small dims for the interpreter: L = kv_lora_rank, R = rope dim, H heads
L, R, H = 64, 16, 4


class LatentBatch:
    """Per-sequence latents [len, L+R] scattered into shuffled blocks of a garbage-filled cache."""

    def __init__(self, context_lens, block_size, lat, rope, dtype, cache_dtype=None, seed=0, device=DEVICE):
        gen = torch.Generator().manual_seed(seed)
        cache_dtype = cache_dtype or dtype
        needed = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        cache = to_cache_dtype(torch.randn(num_blocks, block_size, lat + rope, generator=gen) * 100, cache_dtype)
        tables = torch.full((len(context_lens), max(needed) + 2), -1, dtype=torch.int32)
        self.dense = []
        for b, length in enumerate(context_lens):
            x = to_cache_dtype(torch.randn(length, lat + rope, generator=gen).to(dtype), cache_dtype)
            blocks = [order.pop() for _ in range(needed[b])]
            tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for pos in range(length):
                cache[blocks[pos // block_size], pos % block_size] = x[pos]
            self.dense.append(x.double())
        self.cache = cache.to(device)
        self.block_tables = tables.to(device)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
        self.lat = lat


def naive_mla(q_lat, q_pe, dense, lat, scale, first_pos):
    """float64 attention of queries [Lq, H, *] over the expanded per-head K = [c, k_pe], V = c."""
    q = torch.cat([q_lat.double().cpu(), q_pe.double().cpu()], dim=-1)
    return naive_attention(q, dense[:, None, :], dense[:, None, :lat], scale, first_pos)


def strided_queries(tokens, heads, lat, rope, dtype, seed=0, device=DEVICE):
    """q_lat as the transpose of a bmm output [H, T, L] and q_pe a column slice of a wider projection."""
    q_lat = randn(heads, tokens, lat, dtype=dtype, seed=seed, device=device).transpose(0, 1)
    proj = randn(tokens, heads, 32 + rope, dtype=dtype, seed=seed + 1, device=device)
    q_pe = proj[..., 32:]
    assert not q_lat.is_contiguous() and not q_pe.is_contiguous()
    return q_lat, q_pe


# ----------------------------------------------------------------------------------------------
# store
# ----------------------------------------------------------------------------------------------


def _store_inputs(dtype, cache_dtype, block_size, num_tokens=9, device=DEVICE):
    wide = randn(num_tokens, L + R + 24, dtype=dtype, seed=3, device=device) * 3
    latent = wide[:, 8: 8 + L + R]  # a row-strided view
    num_blocks = max(4, -(-num_tokens * 3 // block_size))
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:num_tokens]
    slots[2] = slots[6] = -1
    cache = to_cache_dtype(randn(num_blocks, block_size, L + R, seed=4) * 50, cache_dtype).to(device)
    return latent, cache, slots.to(torch.int32).to(device)


@pytest.mark.parametrize("cache_dtype", [None, FP8_KV_DTYPE], ids=["same", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_latent_ref_matches_loop(block_size, cache_dtype):
    latent, cache, slots = _store_inputs(torch.float32, cache_dtype or torch.float32, block_size, device="cpu")
    expected = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, slot % block_size] = to_cache_dtype(latent[t], cache.dtype)
    store_latent_ref(latent, cache, slots)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# interleaved rope
# ----------------------------------------------------------------------------------------------


def _rope_inputs(dtype, num_tokens=5, heads=3, rope=R, nope=8, device=DEVICE):
    proj = randn(num_tokens, heads * (nope + rope), dtype=dtype, seed=7, device=device)
    q_pe = proj.view(num_tokens, heads, nope + rope)[..., nope:]
    kv = randn(num_tokens, L + rope, dtype=dtype, seed=8, device=device)
    k_pe = kv[:, L:]
    positions = torch.tensor([0, 3, 17, 4, 99][:num_tokens], dtype=torch.int64, device=device)
    return positions, proj, q_pe, kv, k_pe


def test_rotary_interleaved_ref_matches_complex():
    """transformers' DeepSeek rope: x viewed as complex pairs times e^(i pos theta_i)."""
    positions, _, q_pe, _, k_pe = _rope_inputs(torch.float32, device="cpu")
    base = 10000.0
    cos_sin = build_cos_sin_cache(R, 128, base)
    theta = 1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    rot = torch.polar(torch.ones(len(positions), R // 2, dtype=torch.float64), positions.double()[:, None] * theta)
    expect_q = torch.view_as_real(torch.view_as_complex(q_pe.double().reshape(*q_pe.shape[:-1], -1, 2))
                                  * rot[:, None]).flatten(-2)
    expect_k = torch.view_as_real(torch.view_as_complex(k_pe.double().reshape(*k_pe.shape[:-1], -1, 2))
                                  * rot).flatten(-2)
    q_out, k_out = rotary_interleaved_ref(positions, q_pe, k_pe, cos_sin)
    torch.testing.assert_close(q_out.double(), expect_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), expect_k, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expect_q, q_out.double().flip(-1), atol=1e-3)  # the pairing matters


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------

DECODE_CONTEXTS = [0, 1, 16, 37, 64, 150]  # empty, single token, a block multiple, ragged, several splits


@pytest.mark.parametrize("block_size", [1, 16])
def test_mla_decode_ref_matches_naive(block_size):
    batch = LatentBatch(DECODE_CONTEXTS, block_size, L, R, torch.float32, device="cpu")
    q_lat, q_pe = strided_queries(len(DECODE_CONTEXTS), H, L, R, torch.float32, device="cpu")
    scale = (L + R) ** -0.5
    out = mla_decode_attention_ref(q_lat, q_pe, batch.cache, batch.block_tables, batch.context_lens, scale)
    assert torch.count_nonzero(out[0]) == 0
    for b, length in enumerate(DECODE_CONTEXTS[1:], start=1):
        expected = naive_mla(q_lat[b: b + 1], q_pe[b: b + 1], batch.dense[b], L, scale, length - 1)[0]
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


DECODE_CASES = [  # (dtype, cache dtype or None, block size, num_splits)
    *[(dt, None, 16, n) for dt in KERNEL_DTYPES for n in (1, 4)],
    (torch.float32, None, 1, 3),
    (torch.float16, FP8_KV_DTYPE, 16, 1),
    (torch.float32, FP8_KV_DTYPE, 16, 4),
    # bf16 queries over an fp8 cache: the decode's products in fp16 (the interpreter's bf16 arithmetic is not the
    # GPU's: no case with a bf16 widening runs on the CPU)
    (torch.bfloat16, FP8_KV_DTYPE, 16, 4),
    (torch.bfloat16, FP8_KV_DTYPE, 1, 3),
    (torch.bfloat16, FP8_KV_DTYPE, 16, 1),  # one pass over fp8: the latent tile loaded a step ahead
    (torch.bfloat16, FP8_KV_DTYPE, 1, 1),
]


def _case_id(case):
    return "-".join(str(x).split(".")[-1] for x in case)


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_mla_decode_triton_matches_ref(case):
    dtype, cache_dtype, block_size, num_splits = case
    batch = LatentBatch(DECODE_CONTEXTS, block_size, L, R, dtype, cache_dtype, seed=2)
    q_lat, q_pe = strided_queries(len(DECODE_CONTEXTS), H, L, R, dtype, seed=5)
    args = (q_lat, q_pe, batch.cache, batch.block_tables, batch.context_lens, (L + R) ** -0.5)
    expected = mla_decode_attention_ref(*args)
    workspace = torch.full((len(DECODE_CONTEXTS) * H * num_splits * (L + 1),), float("nan"), device=DEVICE)
    out = torch.full_like(expected, float("nan"))
    result = mla_decode_attention_triton(*args, workspace=workspace, num_splits=num_splits, out=out, block_n=16,
                                         min_split_tokens=16)
    assert result is out and out.dtype == dtype and out.shape == (len(DECODE_CONTEXTS), H, L)
    assert torch.count_nonzero(out[0]) == 0, "context 0 gives 0"
    close(out, expected, dtype)
    # the 150-token row used all splits (37 tokens: 3 of 4), the <= 16-token rows none
    assert bool(torch.isnan(workspace).all()) is (num_splits == 1)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mla_decode_default_splits_and_engine_workspace(dtype):
    """Default launch: splits from (batch, heads, table width) only; one workspace sized by
    mla_decode_workspace_numel serves every batch size; a smaller one is refused."""
    contexts = [130, 0, 1, 70]
    batch = LatentBatch(contexts, 16, L, R, dtype, seed=3)
    tables = torch.full((len(contexts), 4096 // 16), -1, dtype=torch.int32, device=DEVICE)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    q_lat, q_pe = strided_queries(len(contexts), H, L, R, dtype, seed=9)
    numel = mla_decode_workspace_numel(8, H, L, 4096)
    splits = mla_decode_num_splits(len(contexts), H, 4096)
    assert splits > 1 and numel >= len(contexts) * H * splits * (L + 1)
    workspace = torch.empty(numel, device=DEVICE)
    for rows in (len(contexts), 1):
        args = (q_lat[:rows], q_pe[:rows], batch.cache, tables[:rows], batch.context_lens[:rows], 0.1)
        close(mla_decode_attention_triton(*args, workspace=workspace), mla_decode_attention_ref(*args), dtype)
    args = (q_lat, q_pe, batch.cache, tables, batch.context_lens, 0.1)
    with pytest.raises(ValueError, match="workspace"):
        mla_decode_attention_triton(*args, workspace=workspace[: len(contexts) * H * splits * (L + 1) - 1])


def test_mla_decode_short_contexts_run_short_splits():
    """Default knobs over the engine's 4,096-token table at batch 1-8 (64 / 33 splits): a context of at most one
    64-token split runs one pass; 65-256 tokens run 32-token splits (4 at 100, 8 at 256); longer contexts keep
    64-token splits (5 at 257, 8 at 512). The split rows each sequence wrote are counted in the workspace."""
    dtype = KERNEL_DTYPES[0]
    contexts = [40, 100, 256, 257, 512]
    batch = LatentBatch(contexts, 16, L, R, dtype, seed=4)
    tables = torch.full((len(contexts), 4096 // 16), -1, dtype=torch.int32, device=DEVICE)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    q_lat, q_pe = strided_queries(len(contexts), H, L, R, dtype, seed=6)
    args = (q_lat, q_pe, batch.cache, tables, batch.context_lens, (L + R) ** -0.5)
    splits = mla_decode_num_splits(len(contexts), H, 4096)
    rows = len(contexts) * H * splits
    workspace = torch.full((rows * (L + 1),), float("nan"), device=DEVICE)
    close(mla_decode_attention_triton(*args, workspace=workspace), mla_decode_attention_ref(*args), dtype)
    lse = workspace[rows * L:].view(len(contexts), H, splits)
    assert (~torch.isnan(lse[:, 0])).sum(dim=1).tolist() == [0, 4, 8, 5, 8]
    # the knob restores the one rule: 64-token splits throughout
    workspace.fill_(float("nan"))
    close(mla_decode_attention_triton(*args, workspace=workspace, short_split_tokens=64),
          mla_decode_attention_ref(*args), dtype)
    assert (~torch.isnan(lse[:, 0])).sum(dim=1).tolist() == [0, 2, 4, 5, 8]


def test_mla_decode_split_rule_and_workspace_formula():
    # small batches split up to fill the GPU, large ones do not; short tables do not split
    assert mla_decode_num_splits(1, 16, 8192) == 64
    assert mla_decode_num_splits(8, 16, 8192) == 33
    assert mla_decode_num_splits(128, 16, 8192) == 2
    assert mla_decode_num_splits(256, 16, 8192) == 1
    assert mla_decode_num_splits(1, 16, 64) == 1
    assert mla_decode_num_splits(1, 16, 512) == 8
    numel = mla_decode_workspace_numel(256, 16, 512, 8192)
    needs = [b * 16 * s * 513 for b in range(1, 257) if (s := mla_decode_num_splits(b, 16, 8192)) > 1]
    assert numel == max(needs)
    assert mla_decode_workspace_numel(256, 16, 512, 64) == 0


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------

# (q_len, context_len): plain prefill, prefix hit, chunked prefill crossing blocks, a one-token extend
PREFILL_SEQS = [(17, 17), (5, 37), (1, 16), (20, 50)]


def _prefill_inputs(seqs, dtype, block_size=16, cache_dtype=None, seed=0, device=DEVICE):
    batch = LatentBatch([c for _, c in seqs], block_size, L, R, dtype, cache_dtype, seed=seed, device=device)
    q_lens = [q for q, _ in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q_lat, q_pe = strided_queries(sum(q_lens), H, L, R, dtype, seed=seed + 7, device=device)
    return batch, q_lat, q_pe, cu, max(q_lens)


def test_mla_prefill_ref_matches_naive():
    batch, q_lat, q_pe, cu, max_q = _prefill_inputs(PREFILL_SEQS, torch.float32, device="cpu")
    scale = 0.2
    out = mla_prefill_attention_ref(q_lat, q_pe, batch.cache, cu, batch.context_lens, batch.block_tables, max_q,
                                    scale)
    for b, (q_len, length) in enumerate(PREFILL_SEQS):
        s, e = int(cu[b]), int(cu[b + 1])
        expected = naive_mla(q_lat[s:e], q_pe[s:e], batch.dense[b], L, scale, length - q_len)
        torch.testing.assert_close(out[s:e].double(), expected, atol=1e-5, rtol=1e-5)


PREFILL_CASES = [  # (dtype, cache dtype or None, block size, (block_m, block_h, block_n) or None)
    *[(dt, None, 16, (4, 4, 16)) for dt in KERNEL_DTYPES],
    (torch.float32, None, 1, (8, 2, 16)),  # head blocks: 2 programs per query tile
    (torch.float16, None, 16, None),  # the launcher's tiles
    (torch.float16, FP8_KV_DTYPE, 16, (4, 4, 32)),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_mla_prefill_triton_matches_ref(case):
    dtype, cache_dtype, block_size, tiles = case
    batch, q_lat, q_pe, cu, max_q = _prefill_inputs(PREFILL_SEQS, dtype, block_size, cache_dtype, seed=1)
    args = (q_lat, q_pe, batch.cache, cu, batch.context_lens, batch.block_tables, max_q, (L + R) ** -0.5)
    expected = mla_prefill_attention_ref(*args)
    kw = dict(zip(("block_m", "block_h", "block_n"), tiles)) if tiles else {}
    out = mla_prefill_attention_triton(*args, **kw)
    assert out.dtype == dtype and out.shape == expected.shape
    close(out, expected, dtype)


def test_mla_prefill_triton_chunked_equals_whole():
    """A 40-token prompt prefilled in chunks 16 + 24 (the second a prefix hit over the first) gives the
    rows of the whole-prompt prefill; and a sequence with no new tokens is left alone."""
    dtype = torch.float32
    batch = LatentBatch([40, 9], 16, L, R, dtype, seed=4)
    q_lat, q_pe = strided_queries(40, H, L, R, dtype, seed=2)
    scale = 0.15

    def run(start, end, ctx):
        cu = torch.tensor([0, end - start, end - start], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([ctx, 9], dtype=torch.int32, device=DEVICE)
        return mla_prefill_attention_triton(q_lat[start:end], q_pe[start:end], batch.cache, cu, lens,
                                            batch.block_tables, end - start, scale, block_m=4, block_n=16)

    whole = run(0, 40, 40)
    chunked = torch.cat([run(0, 16, 16), run(16, 40, 40)])
    close(chunked, whole, dtype)
    expected = naive_mla(q_lat, q_pe, batch.dense[0], L, scale, 0)
    torch.testing.assert_close(whole.double().cpu(), expected, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------------------
# expanded prefill: varlen causal attention over the up-projected context K/V
# ----------------------------------------------------------------------------------------------

DN, DV = 32, 32  # small nope / value head dims for the interpreter (R as above)
EXPANDED_SEQS = [(17, 17), (5, 37), (0, 9), (1, 16), (40, 70)]  # (new tokens, context): a continuation, none


def _expanded_inputs(seqs, dtype, heads=H, nope=DN, rope=R, v_dim=DV, seed=0, device=DEVICE):
    """q [T, H, Dn+R] (a view of a wider projection, as q_proj's), kv [S, H, Dn+Dv], k_pe [S, R] a column
    slice of the gathered latents [S, L+R] (as the backend passes it), cu_seqlens_q / _k."""
    total_q, total_k = sum(q for q, _ in seqs), sum(c for _, c in seqs)
    wide = randn(total_q, heads, 8 + nope + rope, dtype=dtype, seed=seed, device=device)
    q = wide[..., 8:]
    kv = randn(total_k, heads, nope + v_dim, dtype=dtype, seed=seed + 1, device=device)
    latent = randn(total_k, L + rope, dtype=dtype, seed=seed + 2, device=device)
    k_pe = latent[:, L:]
    cu_q = torch.tensor([0] + torch.tensor([q for q, _ in seqs]).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor([c for _, c in seqs]).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, kv, k_pe, cu_q, cu_k, max(q for q, _ in seqs)


def test_mla_expanded_ref_matches_naive():
    """Each sequence's queries, the last q_len of its context, against a float64 attention with an explicit
    causal mask over K = [k_nope_h, k_pe] and V = v_h per head."""
    q, kv, k_pe, cu_q, cu_k, max_q = _expanded_inputs(EXPANDED_SEQS, torch.float32, device="cpu")
    scale = 0.2
    out = mla_expanded_attention_ref(q, kv, k_pe, cu_q, cu_k, max_q, scale)
    assert out.shape == (q.shape[0], H, DV)
    for b, (q_len, ctx) in enumerate(EXPANDED_SEQS):
        qs, ks = int(cu_q[b]), int(cu_k[b])
        k = torch.cat([kv[ks:ks + ctx, :, :DN], k_pe[ks:ks + ctx, None].expand(-1, H, -1)], dim=-1)
        expected = naive_attention(q[qs:qs + q_len], k, kv[ks:ks + ctx, :, DN:], scale, ctx - q_len)
        torch.testing.assert_close(out[qs:qs + q_len].double(), expected, atol=1e-5, rtol=1e-5)


EXPANDED_CASES = [  # (dtype, (block_m, block_n) or None)
    *[(dt, (16, 16)) for dt in KERNEL_DTYPES],
    (torch.float32, (32, 16)),  # a query tile wider than the key tile: two diagonal tiles
    (torch.float16, None),  # the launcher's tiles
]


@pytest.mark.parametrize("case", EXPANDED_CASES, ids=_case_id)
def test_mla_expanded_triton_matches_ref(case):
    dtype, tiles = case
    q, kv, k_pe, cu_q, cu_k, max_q = _expanded_inputs(EXPANDED_SEQS, dtype, seed=3)
    args = (q, kv, k_pe, cu_q, cu_k, max_q, (DN + R) ** -0.5)
    expected = mla_expanded_attention_ref(*args)
    out = mla_expanded_attention_triton(*args, **dict(zip(("block_m", "block_n"), tiles or ())))
    assert out.dtype == dtype and out.shape == expected.shape
    close(out, expected, dtype)
    plans, other = {}, torch.randn_like(kv)
    for kv_layer in (kv, other):  # planned once, replayed over another layer's K/V
        into = torch.full_like(expected, float("nan"))
        mla_expanded_attention_triton(q, kv_layer, k_pe, cu_q, cu_k, max_q, args[-1], out=into, plans=plans,
                                      **dict(zip(("block_m", "block_n"), tiles or ())))
        close(into, mla_expanded_attention_ref(q, kv_layer, *args[2:]), dtype)
    assert len(plans) == 1
    assert_relaunchable(next(iter(plans.values())))


def test_mla_expanded_triton_mixed_step_offsets():
    """A mixed step's prefill part: cu_seqlens_q starts at its first prefill row (rows before it are the
    decode rows', left untouched)."""
    dtype = torch.float32
    q, kv, k_pe, cu_q, cu_k, max_q = _expanded_inputs([(3, 3), (6, 20)], dtype, seed=5)
    pad = 4
    q_all = torch.cat([randn(pad, H, DN + R, dtype=dtype, seed=9, device=DEVICE), q])
    out = torch.full((q_all.shape[0], H, DV), 7.0, dtype=dtype, device=DEVICE)
    mla_expanded_attention_triton(q_all, kv, k_pe, cu_q + pad, cu_k, max_q, 0.3, out=out)
    assert bool((out[:pad] == 7.0).all())
    close(out[pad:], mla_expanded_attention_ref(q, kv, k_pe, cu_q, cu_k, max_q, 0.3), dtype)


def test_mla_expanded_triton_rejects_bad_shapes():
    q, kv, k_pe, cu_q, cu_k, max_q = _expanded_inputs([(4, 4)], torch.float32, seed=1)
    with pytest.raises(ValueError, match="kv"):
        mla_expanded_attention_triton(q, kv[:, :2], k_pe, cu_q, cu_k, max_q, 0.1)
    with pytest.raises(ValueError, match="Dv"):
        mla_expanded_attention_triton(q, kv[..., :DN + 24], k_pe, cu_q, cu_k, max_q, 0.1)


# ----------------------------------------------------------------------------------------------
# DeepSeek-V2-Lite dims (GPU only) and the sm_90 compile check
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="bf16 at L=512 runs on the GPU (METAINFER_TEST_GPU=1)")
def test_mla_real_dims_bf16_gpu():
    lat, rope, heads, dtype = 512, 64, 16, torch.bfloat16
    contexts = [1, 300, 2048, 17, 0, 1000]
    batch = LatentBatch(contexts, 16, lat, rope, dtype, seed=5)
    q_lat = randn(heads, len(contexts), lat, dtype=dtype, device=DEVICE).transpose(0, 1)
    q_pe = randn(len(contexts), heads, rope, dtype=dtype, seed=1, device=DEVICE)
    args = (q_lat, q_pe, batch.cache, batch.block_tables, batch.context_lens, 0.1)
    close(mla_decode_attention_triton(*args), mla_decode_attention_ref(*args), dtype)
    close(mla_decode_attention_triton(*args, num_splits=1), mla_decode_attention_ref(*args), dtype)
    seqs = [(300, 300), (64, 1000), (1, 17)]
    pbatch = LatentBatch([c for _, c in seqs], 16, lat, rope, dtype, seed=6)
    cu = torch.tensor([0, 300, 364, 365], dtype=torch.int32, device=DEVICE)
    pq_lat = randn(heads, 365, lat, dtype=dtype, seed=2, device=DEVICE).transpose(0, 1)
    pq_pe = randn(365, heads, rope, dtype=dtype, seed=3, device=DEVICE)
    pargs = (pq_lat, pq_pe, pbatch.cache, cu, pbatch.context_lens, pbatch.block_tables, 300, 0.1)
    close(mla_prefill_attention_triton(*pargs), mla_prefill_attention_ref(*pargs), dtype)
    eq, ekv, ek_pe, ecu_q, ecu_k, emax = _expanded_inputs([(300, 300), (64, 1000), (1, 17), (1024, 1024)], dtype,
                                                          heads=heads, nope=128, rope=rope, v_dim=128, seed=7)
    eargs = (eq, ekv, ek_pe, ecu_q, ecu_k, emax, 192 ** -0.5)
    close(mla_expanded_attention_triton(*eargs), mla_expanded_attention_ref(*eargs), dtype)


def aot_compile_mla() -> int:
    """Compile the MLA launches at DeepSeek-V2-Lite dims for sm_90 (run in a process without
    TRITON_INTERPRET) through tests.helpers.aot's aot_main; shared memory over the H200's and register spills
    fail. Returns the exit status (2: cannot compile)."""
    from metainfer.kernels import mla_absorb, mla_expanded, mla_prep
    from metainfer.kernels import mla_attention as mla

    bf16, fp8 = torch.bfloat16, FP8_KV_DTYPE

    def launch():
        for heads in (16, 8):
            for cache_dtype in (bf16, fp8):
                cache = torch.zeros(4, 16, 576, dtype=cache_dtype)
                tables = torch.zeros(3, 512, dtype=torch.int32)
                lens = torch.zeros(3, dtype=torch.int32)
                q_lat = torch.zeros(heads, 3, 512, dtype=bf16).transpose(0, 1)
                q_pe = torch.zeros(3, heads, 64, dtype=bf16)
                for splits in (1, 8, 64):
                    mla.mla_decode_attention_triton(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=splits,
                                                    pdl=splits == 8)
                cu = torch.zeros(4, dtype=torch.int32)
                mla.mla_prefill_attention_triton(q_lat, q_pe, cache, cu, lens, tables, 4096, 0.1,
                                                 pdl=cache_dtype == bf16)
                mla_expanded.mla_expanded_attention_triton(torch.zeros(3, heads, 192, dtype=bf16),
                                                  torch.zeros(5, heads, 256, dtype=bf16),
                                                  torch.zeros(5, 576, dtype=bf16)[:, 512:],
                                                  torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                                                  4096, 0.1, pdl=cache_dtype == bf16)
                mla_prep.mla_latent_prep_triton(torch.zeros(3, 576, dtype=bf16), torch.ones(512, dtype=bf16), 1e-6,
                                                torch.zeros(3, dtype=torch.int64),
                                                torch.zeros(3, heads, 192, dtype=bf16)[..., 128:],
                                                torch.zeros(8, 64), cache, lens, pdl=True)
            kv_b = torch.zeros(heads, 256, 512, dtype=bf16)  # kv_b_proj's weight per head: [Dn + Dv, L]
            for rows, pdl in ((1, True), (mla_absorb.MAX_ROWS, False), (256, True)):  # 256: the tensor-core form
                q = torch.zeros(rows, heads, 192, dtype=bf16)
                mla_absorb.mla_absorb_triton(q[..., :128], kv_b[:, :128], pdl=pdl, max_rows=mla_absorb.MAX_ROWS,
                                             mma_rows=256)
                mla_absorb.mla_value_up_triton(torch.zeros(rows, heads, 512, dtype=bf16), kv_b[:, 128:], pdl=pdl,
                                               max_rows=mla_absorb.MAX_ROWS, mma_rows=256)

    return aot_main([mla._mla_decode_kernel, mla._mla_prefill_kernel, mla_expanded._mla_expanded_kernel,
                     mla_prep._mla_latent_prep_kernel, mla_absorb._mla_absorb_kernel, mla_absorb._mla_value_up_kernel,
                     mla_absorb._mla_absorb_mma_kernel, mla_absorb._mla_value_up_mma_kernel], launch,
                    fail_on_spills=True)


def test_aot_compile_sm90_mla_kernels():
    assert "0 failures" in run_aot_main("tests.kernels.test_mla_attention", "aot_compile_mla", timeout=600)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_planned_mla_launches_replay_over_other_layers_caches(dtype):
    """`plans` (a step's AttentionMetadata.launch_plans): the first call plans the decode and the prefill launch,
    the next through the same dict replay them over another layer's cache (same layout, other contents), each
    result the reference's for its own cache; a q of other strides under the same plans is planned anew."""
    scale = (L + R) ** -0.5
    decode = LatentBatch(DECODE_CONTEXTS, 16, L, R, dtype, seed=2)
    other = torch.randn_like(decode.cache.float()).to(decode.cache.dtype)
    q_lat, q_pe = strided_queries(len(DECODE_CONTEXTS), H, L, R, dtype, seed=5)
    plans = {}
    for cache in (decode.cache, other):
        args = (q_lat, q_pe, cache, decode.block_tables, decode.context_lens, scale)
        close(mla_decode_attention_triton(*args, num_splits=4, block_n=16, min_split_tokens=16, plans=plans),
              mla_decode_attention_ref(*args), dtype)
    assert len(plans) == 1
    assert_relaunchable(next(iter(plans.values())))
    args = (q_lat.contiguous(), q_pe, decode.cache, decode.block_tables, decode.context_lens, scale)
    close(mla_decode_attention_triton(*args, num_splits=4, block_n=16, min_split_tokens=16, plans=plans),
          mla_decode_attention_ref(*args), dtype)
    assert len(plans) == 2
    batch, p_lat, p_pe, cu, max_q = _prefill_inputs(PREFILL_SEQS, dtype, 16, None, seed=1)
    other = torch.randn_like(batch.cache.float()).to(batch.cache.dtype)
    plans = {}
    for cache in (batch.cache, other):
        args = (p_lat, p_pe, cache, cu, batch.context_lens, batch.block_tables, max_q, scale)
        close(mla_prefill_attention_triton(*args, plans=plans), mla_prefill_attention_ref(*args), dtype)
    assert [key[0] for key in plans] == ["mla_prefill"]
    assert_relaunchable(next(iter(plans.values())))
