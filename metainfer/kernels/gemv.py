"""Skinny GEMM (decode with very few rows): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).

Why own it: at batch 1 a decode step is a stream of weight reads, and a plain Triton GEMV
(a few weight rows by a long K slice a program, fp32 accumulate) measured faster than
cuBLAS on the H200 here (DESIGN.md, performance protocol). `linear_triton` uses the kernel
for M <= MAX_ROWS and cuBLAS otherwise; M is a shape, so under a CUDA graph the choice is
made once per captured batch size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import cdiv, require_triton, tl, triton

MAX_ROWS = 4


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, M_PAD)
    row_mask = rows < N
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + ms[:, None] * stride_xm + cols[None, :],
                    mask=(ms[:, None] < M) & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(ms[:, None] < M) & row_mask[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int = 8, block_k: int = 1024) -> torch.Tensor:
    """x[M<=MAX_ROWS, K] (unit last stride), weight[N, K] contiguous."""
    require_triton()
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv_triton needs x[<= {MAX_ROWS}, K] and weight[N, K] rows, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    m_pad = 1 if m == 1 else (2 if m == 2 else 4)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k // m_pad,
        num_warps=8,
    )
    return y


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton GEMV for a handful of rows, cuBLAS for the rest (decided by shape only)."""
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1:
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)
