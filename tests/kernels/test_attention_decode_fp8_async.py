"""The fp8 decode kernel with async copies (kernels/attention_decode_fp8_async.py, Gluon, sm_90 only): one-pass
launches over the engine's fp8 layouts against the float64 reference over the same fp8 values. Gluon has no CPU
interpreter, so the numerical tests run compiled (METAINFER_TEST_GPU=1 on an sm_90 GPU); on the CPU the kernel is
compiled for sm_90 ahead of time (no spills, shared memory within the H200's) and the planner's choice is checked.

The tolerance is test_attention_decode_fp8.py's (1e-2): the same numerics (two e4m3 terms for q and for the
probabilities)."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import paged_decode_attention_ref, paged_decode_attention_triton
from metainfer.kernels.attention_decode import _decode_split_kernel
from metainfer.kernels.attention_decode_fp8_async import HAS_GLUON, fp8_async_applies, plan_fp8_async
from metainfer.kernels.kv_cache import (
    FP8_KV_DTYPE,
    block_major_k_cache,
    fp8_cache_copy,
    to_cache_dtype,
    token_major_v_cache,
)
from tests.helpers.aot import aot_main, run_aot_main
from tests.helpers.attention_cases import make_paged_batch, randn
from tests.helpers.kernel_devices import DEVICE, ON_GPU

pytest.importorskip("triton")

TOL = 1e-2
gpu_only = pytest.mark.skipif(not (ON_GPU and HAS_GLUON and torch.cuda.is_available()
                                   and torch.cuda.get_device_capability() >= (9, 0)),
                              reason="Gluon kernel: an sm_90 GPU with METAINFER_TEST_GPU=1")


def _fp8_batch(contexts, block_size, hk, head_dim):
    batch = make_paged_batch(contexts, block_size, hk, head_dim, torch.float32)
    k, v = fp8_cache_copy(to_cache_dtype(batch.k_cache, FP8_KV_DTYPE), to_cache_dtype(batch.v_cache, FP8_KV_DTYPE))
    return k, v, batch.block_tables, batch.context_lens


def _attend(q, k, v, tables, lens, scale, stages, **launch):
    """The launcher with async stages; asserts the plan took the Gluon kernel."""
    plans = {}
    out = paged_decode_attention_triton(q, k, v, tables, lens, scale, num_splits=1, async_stages=stages,
                                        plans=plans, **launch)
    (plan,) = plans.values()
    assert plan.kernel is not _decode_split_kernel and plan.kernel.fn.__name__ == "_decode_fp8_async_kernel"
    return out


def _check(q, k, v, tables, lens, scale, stages=3, **launch):
    out = _attend(q, k, v, tables, lens, scale, stages, **launch)
    expected = paged_decode_attention_ref(q.double(), k, v, tables, lens, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=TOL, rtol=TOL)


@gpu_only
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("group,hk,head_dim,block_size", [(4, 2, 128, 16), (1, 2, 64, 32), (8, 1, 64, 16),
                                                          (4, 8, 128, 16), (2, 2, 256, 16), (16, 1, 128, 64)],
                         ids=["gqa4-d128", "mha-d64-block32", "gqa8-d64", "qwen3-8b", "gqa2-d256", "gqa16-block64"])
def test_async_decode_matches_reference(group, hk, head_dim, block_size, stages):
    """Ragged contexts: empty, one token, a tail inside a block and across blocks, exactly one and two tiles, a
    tail after full tiles, fewer tiles than stages and many more."""
    contexts = [0, 1, 17, 64, 70, 128, 129, 300, 1000]
    k, v, tables, lens = _fp8_batch(contexts, block_size, hk, head_dim)
    q = randn(len(contexts), group * hk, head_dim, dtype=torch.float32, seed=5, device=DEVICE).to(torch.bfloat16)
    _check(q, k, v, tables, lens, head_dim**-0.5, stages)


@gpu_only
def test_async_decode_keeps_q_exact_over_its_range():
    """q values spanning 2^-12 .. 2^6 and a zero row (test_attention_decode_fp8.py's case)."""
    k, v, tables, lens = _fp8_batch([40, 200], 16, 2, 128)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 128, generator=gen) * torch.exp2(torch.randint(-12, 7, (2, 8, 128), generator=gen).float())
    q[1, 3] = 0.0
    _check(q.to(torch.bfloat16).to(DEVICE), k, v, tables, lens, 1.0 / 64)


@gpu_only
def test_async_decode_adds_up_the_small_probabilities_of_a_long_context():
    """A sink token and 4,095 others at p ~ 2^-11 of it, together a visible share of the output: the
    probabilities' lo term must carry them."""
    context, d, block = 4096, 64, 16
    k = torch.zeros(context // block, block, 1, d)
    v = torch.ones(context // block, block, 1, d)
    k[..., 0] = 0.25
    k[0, 0, 0, 0], v[0, 0, 0] = 13.0, 0.0
    kc, vc = fp8_cache_copy(to_cache_dtype(k, FP8_KV_DTYPE), to_cache_dtype(v, FP8_KV_DTYPE))
    q = torch.zeros(1, 4, d, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    tables = torch.arange(context // block, dtype=torch.int32)[None, :]
    args = [t.to(DEVICE) for t in (q, kc, vc, tables, torch.tensor([context], dtype=torch.int32))]
    out = _attend(*args, 1.0, 3)
    expected = paged_decode_attention_ref(args[0].double(), *args[1:], 1.0)
    assert 0.01 < expected[0, 0, 0] < 0.99
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), rtol=2e-2, atol=1e-4)


@gpu_only
def test_async_decode_ignores_stale_slots():
    """Slots past a row's end hold fp8 NaN (0x7f): whole blocks are copied, so the last block's stale tokens reach
    shared memory and must be zeroed there before P @ V."""
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
    assert _attend(q, k, v, tables, lens, 0.125, 3).isfinite().all()
    _check(q, k, v, tables, lens, 0.125)


@gpu_only
def test_async_decode_in_a_cuda_graph_with_pdl_equals_eager():
    """Captured with PDL (the engine's decode graphs) and replayed over new contexts: equal to the eager launch."""
    k, v, tables, lens = _fp8_batch([100, 700, 33, 64], 16, 8, 128)
    q = randn(4, 32, 128, dtype=torch.float32, seed=7, device=DEVICE).to(torch.bfloat16)
    out = torch.empty_like(q)
    plans = {}

    def step():
        paged_decode_attention_triton(q, k, v, tables, lens, 0.088, num_splits=1, async_stages=3, pdl=True, out=out,
                                      plans=plans)

    step()  # compiles and plans outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor([90, 650, 1, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    eager = paged_decode_attention_triton(q, k, v, tables, lens, 0.088, num_splits=1, async_stages=3)
    assert torch.equal(out, eager)


def test_async_kernel_applies_to_the_engine_fp8_layouts_on_a_gpu_only():
    """The plan takes it only for CUDA caches in the engine's layouts; the CPU (the interpreter) keeps the Triton
    kernel even when async stages are asked for."""
    k = block_major_k_cache(torch.empty(4, 16, 2, 128, dtype=FP8_KV_DTYPE))
    v = token_major_v_cache(torch.empty(4, 16, 2, 128, dtype=FP8_KV_DTYPE))
    assert not fp8_async_applies(k, v, 4)  # a CPU cache
    plans = {}
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    if DEVICE == "cpu":
        paged_decode_attention_triton(q, k, v, tables, lens, 0.1, num_splits=1, async_stages=3, plans=plans)
        assert next(iter(plans.values())).kernel is _decode_split_kernel

    class _OnGpu:  # the layout checks on a cache that reports CUDA
        def __init__(self, t):
            self.t, self.shape, self.is_cuda = t, t.shape, True

        def stride(self, dim):
            return self.t.stride(dim)

    assert HAS_GLUON is fp8_async_applies(_OnGpu(k), _OnGpu(v), 4)
    head_major = torch.empty(4, 16, 2, 128, dtype=FP8_KV_DTYPE)
    assert not fp8_async_applies(_OnGpu(head_major), _OnGpu(v), 4)  # K not block-major
    assert not fp8_async_applies(_OnGpu(k), _OnGpu(head_major), 4)  # V not token-major
    k8 = block_major_k_cache(torch.empty(4, 8, 2, 128, dtype=FP8_KV_DTYPE))
    v8 = token_major_v_cache(torch.empty(4, 8, 2, 128, dtype=FP8_KV_DTYPE))
    assert not fp8_async_applies(_OnGpu(k8), _OnGpu(v8), 4)  # an 8-byte V block row: no 16-byte copies
    assert not fp8_async_applies(_OnGpu(k), _OnGpu(v), 128)
    with pytest.raises(ValueError, match="stages"):
        plan_fp8_async(q, k, v, tables, lens, 0.1, torch.empty_like(q), 5, False)


def _aot_launches():
    """The kernel's launches at the engine's shapes (Qwen3-8B: 32 q over 8 kv heads, D 128) with 2-4 stages and
    PDL, and at head_dim 64 / 256 and a group of 1."""
    from metainfer.kernels.attention_decode_fp8_async import _decode_fp8_async_kernel

    def launch():
        for hq, hk, d, block, stages, pdl in ((32, 8, 128, 16, 2, False), (32, 8, 128, 16, 3, True),
                                              (32, 8, 128, 16, 4, False), (16, 2, 64, 32, 3, False),
                                              (4, 2, 256, 16, 3, False), (8, 8, 128, 64, 3, False)):
            k = block_major_k_cache(torch.zeros(4, block, hk, d, dtype=FP8_KV_DTYPE))
            v = token_major_v_cache(torch.zeros(4, block, hk, d, dtype=FP8_KV_DTYPE))
            q = torch.zeros(3, hq, d, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            plan = plan_fp8_async(q, k, v, torch.zeros(3, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                                  0.1, out, stages, pdl)
            plan(q, k, v, out)

    # 16-byte copies only (cp.async.cg); a 4-byte or narrower one (cp.async.ca) would mean the layouts lost the
    # copies' contiguity
    return aot_main([_decode_fp8_async_kernel], launch, fail_on_spills=True,
                    ptx_must_contain=("cp.async.cg.shared.global", "wgmma.mma_async"),
                    ptx_must_not_contain=("cp.async.ca",))


@pytest.mark.skipif(not HAS_GLUON, reason="Triton without Gluon")
def test_aot_compile_sm90_async_decode_kernel():
    """Every launch compiles for sm_90 without register spills, within the H200's shared memory; the copies are
    16-byte cp.async and the products wgmma (checked in the PTX)."""
    out = run_aot_main("tests.kernels.test_attention_decode_fp8_async", "_aot_launches")
    assert "6 distinct kernels compiled for sm_90, 0 failures" in out, out
