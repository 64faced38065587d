"""Triton skinny GEMM (interpreted on CPU) against torch's F.linear."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels.gemv import gemv_triton, linear_ref, linear_triton


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(24, 64), (13, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gemv_triton(x, w, b, block_n=8, block_k=32)
    torch.testing.assert_close(got, linear_ref(x, w, b), rtol=1e-4, atol=1e-4)


def test_linear_dispatch_by_rows():
    x, w = torch.randn(6, 16), torch.randn(8, 16)
    torch.testing.assert_close(linear_triton(x, w), linear_ref(x, w))  # cuBLAS/ATen path for M > 4
    with pytest.raises(ValueError, match="gemv_triton needs"):
        gemv_triton(x, w)
