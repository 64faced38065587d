"""Expanded (non-absorbed) MLA prefill attention: varlen causal flash attention over the step's context K/V.

Contract: kernels/mla_ref.py (`mla_expanded_attention`). The backend (attention/mla.py) gathers the step's
context latents once, up-projects them by kv_b_proj into per-head [k_nope, v] with one GEMM a layer, and calls
this with the rotated k_pe shared by every head: per (query, key) pair and head 2 x (Dn + R + Dv) FLOPs against
the absorbed form's 2 x (2L + R), with a [rows, Dv] accumulator instead of [rows, L], so 64-query tiles fit.
"""

from __future__ import annotations

import torch

from ._triton import PlannedLaunch, cdiv, pdl_args, pdl_enter, require_triton, tl, triton
from .attention_decode import LOG2E, _dot_precision


@triton.jit
def _expanded_tile(q_nope, q_pe, m_i, l_i, acc, n0, ctx, k_start, q_pos, h, kv_ptr, kpe_ptr, kv_stride_s,
                   kv_stride_h, kpe_stride_s, scale_log2e,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update with keys n0..n0+BLOCK_N of one head: scores over [k_nope, k_pe], values v."""
    tok = n0 + tl.arange(0, BLOCK_N)
    t_mask = tok < ctx
    rows = (k_start + tok).to(tl.int64)
    kv_row = kv_ptr + rows[:, None] * kv_stride_s + h * kv_stride_h
    k_nope = tl.load(kv_row + tl.arange(0, NOPE)[None, :], mask=t_mask[:, None], other=0.0)
    k_pe = tl.load(kpe_ptr + rows[:, None] * kpe_stride_s + tl.arange(0, ROPE)[None, :], mask=t_mask[:, None],
                   other=0.0).to(q_pe.dtype)
    v = tl.load(kv_row + NOPE + tl.arange(0, V_DIM)[None, :], mask=t_mask[:, None], other=0.0)
    s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
    s = s * scale_log2e
    if MASKED:
        s = tl.where((tok[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# the per-sequence offsets of a mixed step's prefill part start at its first prefill row (any alignment)
@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "cu_seqlens_k_ptr"])
def _mla_expanded_kernel(
    q_ptr, kv_ptr, kpe_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, out_ptr, scale_log2e,
    q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, kpe_stride_s, out_stride_t, out_stride_h,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program = (BLOCK_M query tokens of a sequence, one head). Keys before the tile's first query
    are visible to every row (no mask); the tiles from there to the last query's position are masked."""
    pdl_enter(USE_PDL)
    m_block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    ctx = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    q_pos = ctx - q_len + m
    q_row = q_ptr + (q_start + m).to(tl.int64)[:, None] * q_stride_t + h * q_stride_h
    q_nope = tl.load(q_row + tl.arange(0, NOPE)[None, :], mask=m_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + NOPE + tl.arange(0, ROPE)[None, :], mask=m_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], tl.float32)
    first_pos = ctx - q_len + m0
    diag_start = first_pos // BLOCK_N * BLOCK_N
    hi = tl.minimum(ctx, first_pos + BLOCK_M)
    for n0 in range(0, diag_start, BLOCK_N):
        m_i, l_i, acc = _expanded_tile(q_nope, q_pe, m_i, l_i, acc, n0, ctx, k_start, q_pos, h, kv_ptr, kpe_ptr,
                                       kv_stride_s, kv_stride_h, kpe_stride_s, scale_log2e,
                                       NOPE, ROPE, V_DIM, BLOCK_N, False, DOT_PRECISION)
    for n0 in range(diag_start, hi, BLOCK_N):
        m_i, l_i, acc = _expanded_tile(q_nope, q_pe, m_i, l_i, acc, n0, ctx, k_start, q_pos, h, kv_ptr, kpe_ptr,
                                       kv_stride_s, kv_stride_h, kpe_stride_s, scale_log2e,
                                       NOPE, ROPE, V_DIM, BLOCK_N, True, DOT_PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_row = out_ptr + (q_start + m).to(tl.int64)[:, None] * out_stride_t + h * out_stride_h
    tl.store(out_row + tl.arange(0, V_DIM)[None, :], out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def mla_expanded_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """Varlen causal attention of the expanded MLA prefill -> o [T, H, Dv] (kernels/mla_ref.py's contract):
    q [T, H, Dn + R] (k_nope's and k_pe's halves of the scores), kv [S, H, Dn + Dv] (the context's up-projected
    k_nope and v a head), k_pe [S, R] shared by the heads; strided views allowed where the last dim is dense.
    Tiles: block_m queries of one head (default 64) x block_n keys a step (default 64), 4 warps, 2 stages.
    `plans`: as the absorbed prefill's."""
    key = ("mla_expanded", q.shape, q.stride(), kv.shape, kv.stride(), k_pe.stride(), q.dtype, kv.dtype,
           k_pe.dtype, float(scale), int(max_seqlen_q), id(cu_seqlens_q), id(cu_seqlens_k),
           None if out is None else out.stride(), pdl, block_m, block_n, num_warps, num_stages)
    launch = plans.get(key) if plans is not None else None
    if launch is None:
        launch = _plan_mla_expanded(q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, out=out, pdl=pdl,
                                    block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        if plans is not None:
            plans[key] = launch
    return launch(q, kv, k_pe, out)


def _plan_mla_expanded(q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, *, out, pdl, block_m, block_n,
                       num_warps, num_stages) -> PlannedLaunch:
    """One _mla_expanded_kernel launch, planned: the checks, the tiles and the arguments, once."""
    require_triton()
    num_tokens, num_heads, qk_dim = q.shape
    rope = k_pe.shape[-1]
    nope = qk_dim - rope
    if kv.dim() != 3 or kv.shape[1] != num_heads or kv.shape[2] <= nope or k_pe.shape[0] != kv.shape[0]:
        raise ValueError(f"kv {tuple(kv.shape)} must be [S, {num_heads}, {nope} + Dv] and k_pe {tuple(k_pe.shape)} "
                         f"[S, {rope}]")
    v_dim = kv.shape[2] - nope
    for name, value in (("Dn", nope), ("R", rope), ("Dv", v_dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= 16 (tl.dot)")
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("q, kv and k_pe need a dense last dim")
    if q.dtype != kv.dtype:
        raise ValueError(f"q {q.dtype} and kv {kv.dtype} must share a dtype")
    out_shape = (num_tokens, num_heads, v_dim)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device="meta")
    batch = cu_seqlens_q.shape[0] - 1
    max_seqlen_q = int(max_seqlen_q)
    if num_tokens == 0 or batch <= 0 or max_seqlen_q <= 0:
        return PlannedLaunch(None, None, (), (), {}, out_shape, q.dtype)
    block_m = block_m or 64
    block_n = block_n or 64
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return PlannedLaunch(
        _mla_expanded_kernel, (cdiv(max_seqlen_q, block_m), num_heads, batch), (cu_seqlens_q, cu_seqlens_k),
        (float(scale) * LOG2E, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), k_pe.stride(0),
         out.stride(0), out.stride(1)),
        dict(NOPE=nope, ROPE=rope, V_DIM=v_dim, BLOCK_M=block_m, BLOCK_N=block_n,
             DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps or 4, num_stages=num_stages or 2,
             **pdl_args(pdl)),
        out_shape, q.dtype)


__all__ = ["mla_expanded_attention_triton"]
