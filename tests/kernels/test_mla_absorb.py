"""MLA's per-head K-up / V-up (kernels/mla_absorb.py): the torch references against a direct einsum, the
Triton kernels against the references (interpreted on the CPU in fp32/fp16, compiled in bf16 on the GPU) over
the strided views the backend passes (q_nope a slice of q, w_uk / w_uv slices of kv_b_proj's weight), sizes
off the tiles, and the row limit that sends larger batches to the reference. The sm_90 compile check:
tests/kernels/test_mla_attention.py."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels.mla_absorb import (
    MAX_ROWS,
    mla_absorb_ref,
    mla_absorb_triton,
    mla_value_up_ref,
    mla_value_up_triton,
)
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, ON_GPU, REF_DTYPES

pytest.importorskip("triton")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(tokens, heads, dn, dv, lat, rope, dtype, device, seed=0):
    """q [T, H, Dn + R] (q_nope is its first Dn columns), kv_b [H * (Dn + Dv), L] viewed per head, o_lat."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dn + rope, generator=g).to(device=device, dtype=dtype)
    kv_b = (torch.randn(heads * (dn + dv), lat, generator=g) / lat ** 0.5).to(device=device, dtype=dtype)
    per_head = kv_b.view(heads, dn + dv, lat)
    o_lat = torch.randn(tokens, heads, lat, generator=g).to(device=device, dtype=dtype)
    return q[..., :dn], per_head[:, :dn], per_head[:, dn:], o_lat


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.double() - ref.double()).abs().max().item() / max(ref.double().abs().max().item(), 1e-6)
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_references_match_a_direct_computation(dtype):
    q_nope, w_uk, w_uv, o_lat = _inputs(5, 4, 24, 20, 48, 8, dtype, "cpu")
    _close(mla_absorb_ref(q_nope, w_uk), torch.einsum("thd,hdl->thl", q_nope.double(), w_uk.double()).to(dtype),
           dtype)
    direct = torch.einsum("thl,hvl->thv", o_lat.double(), w_uv.double()).reshape(5, -1).to(dtype)
    _close(mla_value_up_ref(o_lat, w_uv), direct, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("dims", [(4, 32, 32, 64, 16), (3, 24, 20, 80, 8)])  # (H, Dn, Dv, L, R); 2nd off the tiles
def test_triton_matches_reference(dtype, tokens, dims):
    heads, dn, dv, lat, rope = dims
    q_nope, w_uk, w_uv, o_lat = _inputs(tokens, heads, dn, dv, lat, rope, dtype, DEVICE, seed=tokens)
    q_lat = mla_absorb_triton(q_nope, w_uk, max_rows=MAX_ROWS)
    assert q_lat.is_contiguous()
    _close(q_lat, mla_absorb_ref(q_nope, w_uk), dtype)
    _close(mla_value_up_triton(o_lat, w_uv, max_rows=MAX_ROWS), mla_value_up_ref(o_lat, w_uv), dtype)


def test_rows_over_the_limit_take_the_reference():
    q_nope, w_uk, w_uv, o_lat = _inputs(MAX_ROWS + 1, 2, 16, 16, 32, 8, torch.float32, DEVICE)
    # max_rows 0 and a batch over the limit (also over the default MAX_ROWS): exactly the batched GEMM
    assert torch.equal(mla_absorb_triton(q_nope, w_uk), mla_absorb_ref(q_nope, w_uk))
    assert torch.equal(mla_value_up_triton(o_lat, w_uv), mla_value_up_ref(o_lat, w_uv))
    for rows in (0, 5):
        assert torch.equal(mla_absorb_triton(q_nope, w_uk, max_rows=rows), mla_absorb_ref(q_nope, w_uk))
        assert torch.equal(mla_value_up_triton(o_lat, w_uv, max_rows=rows), mla_value_up_ref(o_lat, w_uv))
    assert mla_absorb_triton(q_nope[:0], w_uk, max_rows=MAX_ROWS).shape == (0, 2, 32)


def test_bad_shapes_raise():
    q_nope, w_uk, w_uv, o_lat = _inputs(2, 2, 16, 16, 32, 8, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="mla_absorb_triton"):
        mla_absorb_triton(q_nope, w_uk[:1], max_rows=MAX_ROWS)  # heads differ
    with pytest.raises(ValueError, match="mla_value_up_triton"):
        mla_value_up_triton(o_lat, w_uv.half(), max_rows=MAX_ROWS)  # dtypes differ


@pytest.mark.skipif(not ON_GPU, reason="PDL and graph capture need CUDA (METAINFER_TEST_GPU=1)")
@pytest.mark.parametrize("heads", [16, 8])  # DeepSeek-V2-Lite at tp 1 and 2
@pytest.mark.parametrize("tokens", [1, 4, MAX_ROWS])
def test_real_shapes_under_pdl_and_graphs_gpu(heads, tokens):
    q_nope, w_uk, w_uv, o_lat = _inputs(tokens, heads, 128, 128, 512, 64, torch.bfloat16, DEVICE, seed=heads)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    _close(mla_absorb_triton(q_nope, w_uk, max_rows=MAX_ROWS, pdl=pdl), mla_absorb_ref(q_nope, w_uk), torch.bfloat16)
    expected = mla_value_up_triton(o_lat, w_uv, max_rows=MAX_ROWS, pdl=pdl)
    _close(expected, mla_value_up_ref(o_lat, w_uv), torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mla_value_up_triton(o_lat, w_uv, max_rows=MAX_ROWS, pdl=pdl)
    graph.replay()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [3, MAX_ROWS + 2])  # the Triton kernel, and the reference past its row limit
def test_value_up_writes_into_out_rows(rows):
    """`out=` (the piecewise graphs' static output): the first T rows of a larger buffer, written in place with
    the same values as a fresh output; the rows after them untouched."""
    q_nope, w_uk, w_uv, o_lat = _inputs(rows, 3, 16, 24, 32, 8, torch.float32, DEVICE, seed=rows)
    buffer = torch.full((rows + 4, 3 * 24), 7.0, device=DEVICE)
    got = mla_value_up_triton(o_lat, w_uv, buffer[:rows], max_rows=MAX_ROWS)
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:rows], mla_value_up_triton(o_lat, w_uv, max_rows=MAX_ROWS))
    assert torch.equal(buffer[rows:], torch.full_like(buffer[rows:], 7.0))
    ref_buffer = torch.zeros(rows, 3 * 24, device=DEVICE)
    assert mla_value_up_ref(o_lat, w_uv, ref_buffer).data_ptr() == ref_buffer.data_ptr()
    assert torch.equal(ref_buffer, mla_value_up_ref(o_lat, w_uv))
    with pytest.raises(ValueError, match="mla_value_up_triton"):
        mla_value_up_triton(o_lat[:2], w_uv, buffer[:3], max_rows=MAX_ROWS)  # out's rows differ
    with pytest.raises(ValueError, match="mla_value_up_triton"):  # the reference's path checks it too
        mla_value_up_triton(o_lat, w_uv, buffer[:rows].half(), max_rows=0)


class _Spy:
    """Stands in for a Triton kernel: records each launch's grid, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens", [MAX_ROWS + 1, 70])  # one row tile, and two with a ragged last one
@pytest.mark.parametrize("dims", [(2, 32, 32, 64, 16), (3, 24, 20, 80, 8)])  # (H, Dn, Dv, L, R); 2nd off the tiles
def test_tensor_core_form_matches_reference(monkeypatch, dtype, tokens, dims):
    """max_rows < T <= mma_rows: the tensor-core kernels (one launch each, a program per (head, column block, row
    tile)), against the references, into a fresh output and into `out` rows of a larger buffer."""
    import metainfer.kernels.mla_absorb as ma

    heads, dn, dv, lat, rope = dims
    absorb, value_up = _Spy(ma._mla_absorb_mma_kernel), _Spy(ma._mla_value_up_mma_kernel)
    monkeypatch.setattr(ma, "_mla_absorb_mma_kernel", absorb)
    monkeypatch.setattr(ma, "_mla_value_up_mma_kernel", value_up)
    q_nope, w_uk, w_uv, o_lat = _inputs(tokens, heads, dn, dv, lat, rope, dtype, DEVICE, seed=tokens + heads)
    q_lat = mla_absorb_triton(q_nope, w_uk, mma_rows=256)
    assert q_lat.is_contiguous()
    _close(q_lat, mla_absorb_ref(q_nope, w_uk), dtype)
    _close(mla_value_up_triton(o_lat, w_uv, mma_rows=256), mla_value_up_ref(o_lat, w_uv), dtype)
    buffer = torch.full((tokens + 3, heads * dv), 7.0, device=DEVICE, dtype=dtype)
    mla_value_up_triton(o_lat, w_uv, buffer[:tokens], mma_rows=256)
    _close(buffer[:tokens], mla_value_up_ref(o_lat, w_uv), dtype)
    assert torch.equal(buffer[tokens:], torch.full_like(buffer[tokens:], 7.0))
    row_tiles = -(-tokens // 64)
    assert absorb.grids == [(heads, -(-lat // 64), row_tiles)]
    assert value_up.grids == [(heads, -(-dv // 64), row_tiles)] * 2


def test_tensor_core_form_bounds():
    """mma_rows bounds the tensor-core form: above it (and with it 0, the default) the reference, bit for bit;
    at or below max_rows the row-loop kernel is kept."""
    q_nope, w_uk, w_uv, o_lat = _inputs(40, 2, 16, 16, 32, 8, torch.float32, DEVICE)
    for mma_rows in (0, 39):
        assert torch.equal(mla_absorb_triton(q_nope, w_uk, mma_rows=mma_rows), mla_absorb_ref(q_nope, w_uk))
        assert torch.equal(mla_value_up_triton(o_lat, w_uv, mma_rows=mma_rows), mla_value_up_ref(o_lat, w_uv))
    small = q_nope[:MAX_ROWS]
    assert torch.equal(mla_absorb_triton(small, w_uk, mma_rows=256), mla_absorb_triton(small, w_uk))
    with pytest.raises(ValueError, match="mla_absorb_triton"):
        mla_absorb_triton(q_nope, w_uk[:1], mma_rows=256)  # the tensor-core form checks its inputs too
    wide_q, wide_w, _, _ = _inputs(40, 2, 264, 16, 32, 8, torch.float32, DEVICE)  # Dn over one K-up tile
    assert torch.equal(mla_absorb_triton(wide_q, wide_w, mma_rows=256), mla_absorb_ref(wide_q, wide_w))


@pytest.mark.skipif(not ON_GPU, reason="PDL and graph capture need CUDA (METAINFER_TEST_GPU=1)")
@pytest.mark.parametrize("heads", [16, 8])  # DeepSeek-V2-Lite at tp 1 and 2
@pytest.mark.parametrize("tokens", [17, 100, 256])
def test_tensor_core_form_real_shapes_under_pdl_and_graphs_gpu(heads, tokens):
    q_nope, w_uk, w_uv, o_lat = _inputs(tokens, heads, 128, 128, 512, 64, torch.bfloat16, DEVICE, seed=heads)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    expected = mla_absorb_triton(q_nope, w_uk, mma_rows=256, pdl=pdl)
    _close(expected, mla_absorb_ref(q_nope, w_uk), torch.bfloat16)
    _close(mla_value_up_triton(o_lat, w_uv, mma_rows=256, pdl=pdl), mla_value_up_ref(o_lat, w_uv), torch.bfloat16)
    expected_o = mla_value_up_triton(o_lat, w_uv, mma_rows=256, pdl=pdl)
    buffer = torch.full((tokens + 3, heads * 128), 7.0, device=DEVICE, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mla_absorb_triton(q_nope, w_uk, mma_rows=256, pdl=pdl)
        mla_value_up_triton(o_lat, w_uv, buffer[:tokens], mma_rows=256, pdl=pdl)
    graph.replay()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)
    torch.testing.assert_close(buffer[:tokens], expected_o, rtol=0, atol=0)
    assert torch.equal(buffer[tokens:], torch.full_like(buffer[tokens:], 7.0))
