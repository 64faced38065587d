"""tools/gpu_suite/families._bs1_variants: the in-engine A/B's kernel sets on the Triton ops (the CPU interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

from metainfer.kernels import select_ops
from metainfer.kernels.mla_ref import mla_decode_attention_ref
from tests.kernels.test_mla_attention import LatentBatch, strided_queries
from tools.gpu_suite.families import _bs1_variants


def test_long_splits_variant_runs_64_token_splits_where_the_default_runs_32():
    """default / long_splits / default_again: the default set twice around one whose MLA decode keeps 64-token splits
    at a 100-token context (2 split rows against the default's 4), both equal to the reference."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton ops need the interpreter or a GPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = select_ops(device, use_triton=True)
    variants = _bs1_variants(ops)
    assert list(variants) == ["default", "long_splits", "default_again"]
    assert variants["default"] is ops and variants["default_again"] is ops
    lat, rope, heads = 64, 16, 4
    batch = LatentBatch([100, 40], 16, lat, rope, torch.float32, seed=1, device=device)
    tables = torch.full((2, 4096 // 16), -1, dtype=torch.int32, device=device)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    q_lat, q_pe = strided_queries(2, heads, lat, rope, torch.float32, seed=2, device=device)
    args = (q_lat, q_pe, batch.cache, tables, batch.context_lens, 0.1)
    expected = mla_decode_attention_ref(*args)
    splits = {}
    for name in ("default", "long_splits"):
        rows = 2 * heads * 64  # batch 2 over a 4,096-token table: 64 splits
        workspace = torch.full((rows * (lat + 1),), float("nan"), device=device)
        out = variants[name].mla_decode_attention(*args, workspace=workspace)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        splits[name] = int((~torch.isnan(workspace[rows * lat:].view(2, heads, 64)[0, 0])).sum())
    assert splits == {"default": 4, "long_splits": 2}
