"""Attention kernels: KV store, paged decode (split-KV), paged prefill/extend.

References are checked against a naive float64 attention over dense per-sequence K/V with a
materialised causal mask; Triton kernels (interpreted on CPU, fp32/fp16) against the references.
Every case scatters the sequences into shuffled cache blocks full of garbage, so a wrong
block-table lookup or an unmasked read shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import (
    alloc_decode_workspace,
    decode_num_splits,
    decode_workspace_numel,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
    store_kv_ref,
    store_kv_triton,
)
from metainfer.kernels.attention_decode import alloc_decode_counters
from tests.helpers.aot import run_aot_check
from tests.helpers.attention_cases import (
    DECODE_CONTEXTS,
    PREFILL_SEQS,
    assert_relaunchable,
    make_paged_batch,
    naive_attention,
    prefill_inputs,
)
from tests.helpers.attention_cases import close as _close
from tests.helpers.attention_cases import randn as _randn
from tests.helpers.attention_cases import store_kv_inputs as _store_kv_inputs
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_store_kv_ref_matches_loop(block_size):
    k, v, k_cache, v_cache, slots = _store_kv_inputs(torch.float32, block_size, "cpu")
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_exp[slot // block_size, slot % block_size] = k[t]
            v_exp[slot // block_size, slot % block_size] = v[t]
    store_kv_ref(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_exp, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_exp, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_store_kv_triton_matches_ref(dtype, block_size):
    k, v, k_cache, v_cache, slots = _store_kv_inputs(dtype, block_size, DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------



@pytest.mark.parametrize("group,hk,head_dim,block_size", [
    (1, 2, 64, 16), (4, 2, 128, 1), (8, 1, 64, 32), (4, 1, 128, 16),
])
def test_decode_ref_matches_naive(group, hk, head_dim, block_size):
    batch = make_paged_batch(DECODE_CONTEXTS, block_size, hk, head_dim, torch.float32, device="cpu")
    hq, scale = group * hk, head_dim**-0.5
    q = _randn(len(DECODE_CONTEXTS), hq, head_dim, seed=5)
    out = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    for b, length in enumerate(DECODE_CONTEXTS):
        if length == 0:
            assert torch.count_nonzero(out[b]) == 0, "context_len 0 must give zeros"
            continue
        expected = naive_attention(q[b : b + 1], batch.dense_k[b], batch.dense_v[b], scale, length - 1)[0]
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


DECODE_KERNEL_CASES = [  # (group, hk, head_dim, block_size, dtype)
    (1, 2, 64, 16, torch.float32),
    (4, 2, 128, 16, torch.float32),
    (8, 1, 64, 32, torch.float32),
    (4, 1, 64, 32, torch.float16),
    (8, 1, 128, 16, torch.float16),
    (1, 2, 128, 32, torch.float16),
    (4, 1, 64, 1, torch.float32),
    (8, 1, 64, 4, torch.float16),
]


def _decode_case_id(case):
    group, hk, head_dim, block_size, dtype = case
    return f"g{group}-hk{hk}-d{head_dim}-s{block_size}-{str(dtype).split('.')[-1]}"


@pytest.mark.parametrize("max_num_splits", [1, 3], ids=["one-pass", "split3"])
@pytest.mark.parametrize("case", DECODE_KERNEL_CASES, ids=_decode_case_id)
def test_decode_triton_matches_ref(case, max_num_splits):
    group, hk, head_dim, block_size, dtype = case
    batch = make_paged_batch(DECODE_CONTEXTS, block_size, hk, head_dim, dtype)
    q = _randn(len(DECODE_CONTEXTS), group * hk, head_dim, dtype=dtype, seed=5, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
    expected = paged_decode_attention_ref(*args)
    out = paged_decode_attention_triton(*args, max_num_splits=max_num_splits, block_n=16, min_split_tokens=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.count_nonzero(out[0]) == 0
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_decode_triton_workspace_out_and_strided_q(dtype):
    """Caller-owned workspace/out (CUDA-graph style) and q as a view of the fused qkv output."""
    hq, hk, head_dim, contexts = 8, 2, 64, [40, 0, 5]
    batch = make_paged_batch(contexts, 16, hk, head_dim, dtype)
    qkv = _randn(len(contexts), (hq + 2 * hk) * head_dim, dtype=dtype, device=DEVICE)
    q = qkv[:, : hq * head_dim].view(len(contexts), hq, head_dim)
    workspace = alloc_decode_workspace(8, hq, head_dim, max_num_splits=4, device=DEVICE)
    out = torch.full((len(contexts), hq, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.1)
    result = paged_decode_attention_triton(*args, max_num_splits=4, workspace=workspace, out=out, block_n=16,
                                           min_split_tokens=16)
    assert result is out
    _close(out, paged_decode_attention_ref(*args), dtype)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention_triton(*args, max_num_splits=4, workspace=workspace[:10], block_n=16,
                                      min_split_tokens=16)


# Many splits: the block table padded to a graph-style width (4096 tokens) so the split count
# comes from shapes, not from the contexts, and most splits of the short rows are empty.
# Contexts: empty, single token, exactly one split (direct write, no merge), just over one
# split, a few splits, many splits, every split live (merge tiles looped over).
SPLIT_CONTEXTS = [0, 1, 16, 17, 100, 300, 1000]
MANY_SPLIT_CASES = [  # (group, hk, head_dim, block_size, dtype)
    (1, 2, 64, 16, torch.float32),
    (4, 1, 128, 16, torch.float32),
    (8, 1, 64, 32, torch.float32),
    (3, 1, 64, 16, torch.float32),  # non-power-of-two group: padded merge rows
    (1, 1, 128, 32, torch.float16),
    (4, 2, 64, 32, torch.float16),
    (8, 1, 128, 16, torch.float16),
]


def _pad_table(block_tables, width_tokens, block_size):
    """Pad a block table with -1 columns to `width_tokens` tokens (as the CUDA-graph buffers are)."""
    width = width_tokens // block_size
    padded = torch.full((block_tables.shape[0], width), -1, dtype=torch.int32, device=block_tables.device)
    padded[:, : block_tables.shape[1]] = block_tables
    return padded


def _live_splits(ctx, num_splits, block_n):
    """Non-empty splits of a context (the kernel's formula)."""
    def cdiv(a, b):
        return -(-a // b)

    return 0 if ctx == 0 else cdiv(ctx, cdiv(cdiv(ctx, num_splits), block_n) * block_n)


@pytest.mark.parametrize("max_num_splits", [32, pytest.param(24, marks=pytest.mark.slow)], ids=["splits32", "splits24"])
@pytest.mark.parametrize("case", MANY_SPLIT_CASES, ids=_decode_case_id)
def test_decode_triton_many_splits_ragged(case, max_num_splits):
    group, hk, head_dim, block_size, dtype = case
    contexts = SPLIT_CONTEXTS[::-1] if hk == 2 else SPLIT_CONTEXTS  # empty row last / first
    batch = make_paged_batch(contexts, block_size, hk, head_dim, dtype, seed=11)
    tables = _pad_table(batch.block_tables, 4096, block_size)
    q = _randn(len(contexts), group * hk, head_dim, dtype=dtype, seed=6, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, tables, batch.context_lens, head_dim**-0.5)
    num_splits = decode_num_splits(len(contexts), hk, tables.shape[1] * block_size, max_num_splits, 16)
    assert num_splits == max_num_splits
    assert [_live_splits(c, num_splits, 16) for c in SPLIT_CONTEXTS] == (
        [0, 1, 1, 2, 7, 19, 32] if num_splits == 32 else [0, 1, 1, 2, 7, 19, 21])
    out = torch.full_like(q, float("nan"))
    counters = alloc_decode_counters(len(contexts), hk, device=DEVICE)
    paged_decode_attention_triton(*args, max_num_splits=max_num_splits, block_n=16,
                                  min_split_tokens=16, out=out, counters=counters)
    assert torch.count_nonzero(out[contexts.index(0)]) == 0, "context_len 0 must give zeros"
    _close(out, paged_decode_attention_ref(*args), dtype)
    assert torch.count_nonzero(counters) == 0, "the merging split must reset its counter"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_decode_default_min_split_keeps_short_contexts_in_one_split(dtype):
    """With the default minimum split (32 tokens) a context up to 32 tokens is one split, which
    writes the output directly: the split workspace stays untouched (NaN) although the table's width
    (4096 tokens) gives 32 splits. One token more (33) splits and merges (the earlier 256-token
    minimum would not), as do longer contexts in the same batch."""
    hq, hk, head_dim, block_size = 8, 2, 64, 16
    for contexts, splits_used in (([0, 1, 20, 32], False), ([0, 1, 20, 33], True), ([0, 100, 700, 2000], True)):
        batch = make_paged_batch(contexts, block_size, hk, head_dim, dtype, seed=5)
        tables = _pad_table(batch.block_tables, 4096, block_size)
        q = _randn(len(contexts), hq, head_dim, dtype=dtype, seed=2, device=DEVICE)
        args = (q, batch.k_cache, batch.v_cache, tables, batch.context_lens, head_dim**-0.5)
        assert decode_num_splits(len(contexts), hk, 4096) == 32
        workspace = torch.full((decode_workspace_numel(len(contexts), hq, head_dim, 32),), float("nan"),
                               device=DEVICE)
        out = paged_decode_attention_triton(*args, workspace=workspace)
        _close(out, paged_decode_attention_ref(*args), dtype)
        assert bool(torch.isnan(workspace).all()) is not splits_used


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:1] + [pytest.param(d, marks=pytest.mark.slow)
                                                       for d in KERNEL_DTYPES[1:]])
def test_decode_triton_repeated_launches_reuse_counters(dtype):
    """Caller-owned workspace and counters reused across launches (as CUDA-graph replays do):
    identical results each time, counters back at zero after every launch, also when a later
    launch uses other context lengths or a smaller batch."""
    hq, hk, head_dim, block_size = 8, 2, 64, 16
    contexts = [300, 0, 17, 64, 129]
    batch = make_paged_batch(contexts, block_size, hk, head_dim, dtype, seed=4)
    tables = _pad_table(batch.block_tables, 2048, block_size)
    q = _randn(len(contexts), hq, head_dim, dtype=dtype, seed=9, device=DEVICE)
    workspace = alloc_decode_workspace(len(contexts), hq, head_dim, max_num_splits=16, device=DEVICE)
    counters = alloc_decode_counters(len(contexts), hk, device=DEVICE)
    assert counters.dtype == torch.int32 and counters.shape == (len(contexts) * hk,)
    assert torch.count_nonzero(counters) == 0
    kw = dict(max_num_splits=16, block_n=16, min_split_tokens=16, workspace=workspace, counters=counters)
    assert decode_num_splits(len(contexts), hk, tables.shape[1] * block_size, 16, 16) == 16

    def run(lens, rows=len(contexts)):
        args = (q[:rows], batch.k_cache, batch.v_cache, tables[:rows], lens[:rows], head_dim**-0.5)
        out = paged_decode_attention_triton(*args, **kw)
        assert torch.count_nonzero(counters) == 0, "counters must be left zeroed"
        return out, paged_decode_attention_ref(*args)

    first, expected = run(batch.context_lens)
    _close(first, expected, dtype)
    for _ in range(2):  # second and third launch: bit-identical
        again, _ = run(batch.context_lens)
        torch.testing.assert_close(again, first, atol=0, rtol=0)
    shorter = torch.tensor([250, 0, 0, 33, 100], dtype=torch.int32, device=DEVICE)  # "replay", new lens
    out, expected = run(shorter)
    _close(out, expected, dtype)
    out, expected = run(batch.context_lens, rows=3)  # smaller batch, same buffers
    _close(out, expected, dtype)
    again, _ = run(batch.context_lens)
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_decode_triton_default_counters_are_shared_and_left_zeroed(monkeypatch):
    """Without counters= the launcher uses one zeroed buffer per device (grown when too small,
    the outgrown one kept alive for graphs that may point at it)."""
    from metainfer.kernels import attention_decode as attention

    tiny = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    monkeypatch.setitem(attention._SHARED_COUNTERS, torch.empty(0, device=DEVICE).device, tiny)  # cuda:0, not cuda
    monkeypatch.setattr(attention, "_OUTGROWN_COUNTERS", [])
    hq, hk, head_dim = 4, 1, 64
    for contexts in ([90, 0, 40], [33, 1, 70, 200, 0, 17]):
        batch = make_paged_batch(contexts, 16, hk, head_dim, torch.float32, seed=len(contexts))
        tables = _pad_table(batch.block_tables, 1024, 16)
        q = _randn(len(contexts), hq, head_dim, seed=3, device=DEVICE)
        args = (q, batch.k_cache, batch.v_cache, tables, batch.context_lens, 0.125)
        first = paged_decode_attention_triton(*args, max_num_splits=8, block_n=16, min_split_tokens=16)
        _close(first, paged_decode_attention_ref(*args), torch.float32)
        shared = attention._SHARED_COUNTERS[q.device]
        assert shared.numel() >= len(contexts) * hk and torch.count_nonzero(shared) == 0
        torch.testing.assert_close(paged_decode_attention_triton(*args, max_num_splits=8, block_n=16,
                                                                 min_split_tokens=16), first,
                                   atol=0, rtol=0)
        assert torch.count_nonzero(shared) == 0
    assert attention._OUTGROWN_COUNTERS == [tiny]


def test_decode_triton_rejects_bad_counters():
    batch = make_paged_batch([40, 3], 16, 2, 64, torch.float32)
    q = _randn(2, 4, 64, device=DEVICE)
    args = (q, batch.k_cache, batch.v_cache, _pad_table(batch.block_tables, 512, 16), batch.context_lens, 0.1)
    for bad in (torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.zeros(4, dtype=torch.float32, device=DEVICE)):
        with pytest.raises(ValueError, match="counters"):
            paged_decode_attention_triton(*args, max_num_splits=4, block_n=16, min_split_tokens=16, counters=bad)


def test_decode_num_splits_is_shape_only():
    assert decode_num_splits(1, 8, 32768) == 32  # batch 1: split to fill the GPU, capped at the default
    assert decode_num_splits(256, 8, 32768) == 1  # big batches already fill it
    assert decode_num_splits(1, 8, 100, block_n=64) == 2  # never more splits than BLOCK_N chunks
    assert decode_num_splits(4, 8, 4096, max_num_splits=4) == 4
    assert decode_workspace_numel(2, 4, 64, 3) == 2 * 4 * 3 * 65


def test_triton_launchers_do_not_sync_the_host(monkeypatch):
    """No .item()/.tolist()/int()/bool() on tensors in the launchers (CUDA-graph capturable).
    The interpreter itself runs the kernels, so only the launcher bodies are checked: the kernel
    launch is stubbed out."""
    from metainfer.kernels import attention_decode, attention_prefill

    batch = make_paged_batch([5, 20], 16, 1, 64, torch.float32)
    q = _randn(2, 4, 64, device=DEVICE)
    launched = []

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, grid))

    monkeypatch.setattr(attention_decode, "_decode_split_kernel", FakeKernel("split"))
    monkeypatch.setattr(attention_prefill, "_prefill_kernel", FakeKernel("prefill"))

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync in a launcher")

    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    paged_decode_attention_triton(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.1,
                                  max_num_splits=4, block_n=16, min_split_tokens=16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    paged_prefill_attention_triton(_randn(5, 4, 64), batch.k_cache, batch.v_cache, cu, batch.context_lens,
                                   batch.block_tables, 3, 0.1)
    monkeypatch.undo()
    assert [name for name, _ in launched] == ["split", "prefill"]  # split-KV decode is one launch


# ----------------------------------------------------------------------------------------------
# prefill / extend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group,hk,head_dim,block_size", [
    (1, 2, 64, 16), (4, 1, 128, 1), (8, 1, 64, 32),
])
def test_prefill_ref_matches_naive(group, hk, head_dim, block_size):
    batch, q, cu, max_q = prefill_inputs(PREFILL_SEQS, group, hk, head_dim, block_size, torch.float32, "cpu")
    scale = head_dim**-0.5
    out = paged_prefill_attention_ref(q, batch.k_cache, batch.v_cache, cu, batch.context_lens,
                                      batch.block_tables, max_q, scale)
    for b, (q_len, length) in enumerate(PREFILL_SEQS):
        s, e = cu[b].item(), cu[b + 1].item()
        expected = naive_attention(q[s:e], batch.dense_k[b], batch.dense_v[b], scale, length - q_len)
        torch.testing.assert_close(out[s:e].double(), expected, atol=1e-5, rtol=1e-5)


PREFILL_KERNEL_CASES = [  # (group, hk, head_dim, block_size, dtype)
    (1, 2, 64, 16, torch.float32),
    (4, 1, 128, 32, torch.float32),
    (8, 1, 64, 16, torch.float16),
    (4, 1, 64, 1, torch.float16),
    (1, 1, 128, 16, torch.float16),
]


@pytest.mark.parametrize("case", PREFILL_KERNEL_CASES, ids=_decode_case_id)
def test_prefill_triton_matches_ref(case):
    group, hk, head_dim, block_size, dtype = case
    batch, q, cu, max_q = prefill_inputs(PREFILL_SEQS, group, hk, head_dim, block_size, dtype)
    args = (q, batch.k_cache, batch.v_cache, cu, batch.context_lens, batch.block_tables, max_q, head_dim**-0.5)
    expected = paged_prefill_attention_ref(*args)
    out = paged_prefill_attention_triton(*args, block_m=16, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_prefill_triton_default_tiles_and_empty_sequence(dtype):
    """Launcher-chosen tiles (BLOCK_M from max_seqlen_q) and a sequence with no new tokens."""
    seqs = [(3, 40), (0, 9), (33, 33)]
    batch, q, cu, max_q = prefill_inputs(seqs, 4, 1, 64, 16, dtype, seed=3)
    args = (q, batch.k_cache, batch.v_cache, cu, batch.context_lens, batch.block_tables, max_q, 0.125)
    _close(paged_prefill_attention_triton(*args), paged_prefill_attention_ref(*args), dtype)


@pytest.mark.slow
def test_aot_compile_sm90_attention_kernels():

    run_aot_check(["store_kv", "decode", "prefill", "qk_prep"])


def test_decode_workspace_for_covers_every_split_launch_and_no_more():
    """The engine's one decode scratch (model_runner._bind_decode_workspace): for every batch up to
    the maximum, a default launch's split scratch fits; and it is the largest of those needs (so a
    256-sequence engine holds ~1 MB, not max_batch x 32 splits)."""
    from metainfer.kernels.attention_decode import decode_workspace_numel_for

    hq, hk, d, table = 32, 8, 128, 4096
    numel = decode_workspace_numel_for(256, hq, hk, d, table)
    needs = [decode_workspace_numel(b, hq, d, decode_num_splits(b, hk, table)) for b in range(1, 257)
             if decode_num_splits(b, hk, table) > 1]
    assert needs and numel == max(needs) and numel < decode_workspace_numel(256, hq, d, 32) // 50
    assert decode_workspace_numel_for(256, hq, hk, d, 64) == 0  # 64-token tables: one tile, never a split


@pytest.mark.slow
def test_decode_workspace_for_serves_every_batch_launch():
    """Every batch up to the maximum launches against the one buffer (the launcher refuses a
    workspace that is too small), with a long context in each batch so the launches split."""
    from metainfer.kernels.attention_decode import decode_workspace_numel_for

    hq, hk, head_dim, block_size, max_batch, width = 4, 2, 16, 16, 12, 1024
    workspace = torch.empty(decode_workspace_numel_for(max_batch, hq, hk, head_dim, width), device=DEVICE)
    refused = []
    for b in range(1, max_batch + 1):
        batch = make_paged_batch([500] + [3] * (b - 1), block_size, hk, head_dim, torch.float32, seed=b)
        tables = _pad_table(batch.block_tables, width, block_size)
        q = _randn(b, hq, head_dim, seed=b, device=DEVICE)
        args = (q, batch.k_cache, batch.v_cache, tables, batch.context_lens, head_dim**-0.5)
        out = paged_decode_attention_triton(*args, workspace=workspace)
        _close(out, paged_decode_attention_ref(*args), torch.float32)
        try:  # teeth: one element less fails the batch that needs the most
            paged_decode_attention_triton(*args, workspace=workspace[:-1])
        except ValueError:
            refused.append(b)
    assert refused  # the size is tight


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_a_planned_launch_replays_over_other_layers_caches(dtype):
    """`plans` (a step's AttentionMetadata.launch_plans): the first call plans each launch, the next calls through
    the same dict replay it over their own cache views (the layers of one step: a second cache of the same layout
    and other contents here), into a given output or a fresh one: each result is the reference's for its cache."""
    def layer_caches(k_cache, v_cache):
        return [(k_cache, v_cache), (_randn(*k_cache.shape, dtype=dtype, seed=11, device=DEVICE),
                                     _randn(*v_cache.shape, dtype=dtype, seed=12, device=DEVICE))]

    hq, hk, head_dim = 8, 2, 64
    batch = make_paged_batch(DECODE_CONTEXTS, 16, hk, head_dim, dtype)
    q = _randn(len(DECODE_CONTEXTS), hq, head_dim, dtype=dtype, seed=5, device=DEVICE)
    plans = {}
    for i, (k_cache, v_cache) in enumerate(layer_caches(batch.k_cache, batch.v_cache)):
        args = (q, k_cache, v_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
        out = torch.full_like(q, float("nan")) if i else None
        got = paged_decode_attention_triton(*args, max_num_splits=3, block_n=16, min_split_tokens=16, plans=plans,
                                            out=out)
        assert len(plans) == i + 1 and (out is None or got is out)  # a given out is another plan (its strides)
        _close(got, paged_decode_attention_ref(*args), dtype)
    # the piecewise capture's order: q as the packed projection's view, then the same step with a contiguous q
    qkv = _randn(len(DECODE_CONTEXTS), (hq + 2 * hk) * head_dim, dtype=dtype, seed=6, device=DEVICE)
    for q_view in (qkv[:, : hq * head_dim].view(-1, hq, head_dim), qkv[:, : hq * head_dim].reshape(-1, hq, head_dim)):
        args = (q_view, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
        _close(paged_decode_attention_triton(*args, max_num_splits=3, block_n=16, min_split_tokens=16, plans=plans),
               paged_decode_attention_ref(*args), dtype)
    assert len(plans) == 3
    plans = {}
    batch, q, cu, max_q = prefill_inputs(PREFILL_SEQS, 4, 1, 64, 16, dtype)
    for k_cache, v_cache in layer_caches(batch.k_cache, batch.v_cache):
        args = (q, k_cache, v_cache, cu, batch.context_lens, batch.block_tables, max_q, 0.125)
        _close(paged_prefill_attention_triton(*args, block_m=16, block_n=16, plans=plans),
               paged_prefill_attention_ref(*args), dtype)
    assert [key[0] for key in plans] == ["paged_prefill"]
    assert_relaunchable(next(iter(plans.values())))
    empty = {}  # an empty batch plans no kernel: each call hands back its output
    got = paged_decode_attention_triton(q[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0],
                                        batch.context_lens[:0], 0.1, plans=empty)
    assert got.shape == (0, 4, 64) and next(iter(empty.values())).kernel is None


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_a_planned_launch_relaunches_its_compiled_kernel_directly(dtype, monkeypatch):
    """PlannedLaunch: the first call goes through Triton's JITFunction; on a GPU the next ones launch the compiled
    kernel it returned (no binding or specialization a call), which must give each layer's reference result; a
    call whose q is not 16-byte aligned (another specialization) goes through JITFunction again and is right too.
    Counted: on a GPU 4 of the 12 calls go through JITFunction (the plan's first, the three unaligned ones); in the
    interpreter (CPU) there is no compiled kernel and all 12 do."""
    from metainfer.kernels import attention_decode

    kernel = attention_decode._decode_split_kernel
    through_jit = []
    jit_run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: through_jit.append(1) or jit_run(*a, **kw), raising=False)
    hq, hk, head_dim = 8, 2, 64
    batch = make_paged_batch(DECODE_CONTEXTS, 16, hk, head_dim, dtype)
    q = _randn(len(DECODE_CONTEXTS), hq, head_dim, dtype=dtype, seed=5, device=DEVICE)
    plans = {}
    caches = [(batch.k_cache, batch.v_cache)] + [
        (_randn(*batch.k_cache.shape, dtype=dtype, seed=20 + i, device=DEVICE),
         _randn(*batch.v_cache.shape, dtype=dtype, seed=30 + i, device=DEVICE)) for i in range(2)]
    flat = torch.empty(q.numel() + 8, dtype=dtype, device=DEVICE)
    unaligned = flat[1:1 + q.numel()].view(q.shape)  # q's shape and strides, 2-4 bytes off alignment
    unaligned.copy_(q)
    assert unaligned.data_ptr() % 16 and unaligned.stride() == q.stride()
    for query in (q, q, unaligned, q):
        for k_cache, v_cache in caches:
            args = (query, k_cache, v_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
            got = paged_decode_attention_triton(*args, max_num_splits=3, block_n=16, min_split_tokens=16, plans=plans)
            _close(got, paged_decode_attention_ref(*args), dtype)
    (plan,) = plans.values()
    assert_relaunchable(plan)
    assert bool(plan._direct) == (DEVICE == "cuda")
    assert len(through_jit) == (4 if DEVICE == "cuda" else 12)


def test_a_planned_launch_passes_its_arguments_in_signature_order():
    """The direct launch's argument list, with a stand-in kernel (no GPU needed): the four varying tensors and the
    plan's fixed arguments in place, then the constexprs in the kernel's signature order, from the plan's keywords
    or the signature's defaults; launch options (num_warps) are not arguments. A constexpr with neither, or an
    unaligned tensor at the first call, leaves the plan on JITFunction for good."""
    import inspect

    from metainfer.kernels._triton import CompiledKernel, PlannedLaunch

    class Param:
        def __init__(self, name, default=inspect.Parameter.empty):
            self.name, self.default = name, default

    launched = []

    class Compiled(CompiledKernel):
        def __init__(self):  # a stand-in: nothing to load
            pass

        def __getitem__(self, grid):
            return lambda *args: launched.append((grid, args))

    class Kernel:
        params = [Param(n) for n in ("q", "k", "v", "tables", "out", "stride")] + [
            Param("BLOCK"), Param("ONE_PASS", default=True), Param("USE_PDL")]
        jit_calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                Kernel.jit_calls += 1
                return Compiled()
            return run

    tensors = [torch.zeros(4) for _ in range(4)]
    plan = PlannedLaunch(Kernel(), (3, 2), ("tables",), (7,), {"BLOCK": 32, "USE_PDL": False, "num_warps": 4},
                         (4,), torch.float32)
    q, k, v, out = tensors
    for _ in range(3):
        plan(q, k, v, out)
    assert Kernel.jit_calls == 1
    assert launched == [((3, 2, 1), (q, k, v, "tables", out, 7, 32, True, False))] * 2
    Kernel.params = Kernel.params[:-1] + [Param("NO_VALUE")]  # a constexpr the plan cannot fill
    plan = PlannedLaunch(Kernel(), (3,), ("tables",), (7,), {"BLOCK": 32}, (4,), torch.float32)
    plan(q, k, v, out)
    plan(q, k, v, out)
    assert plan._direct is False and Kernel.jit_calls == 3
