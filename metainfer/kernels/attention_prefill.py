"""Paged prefill / extend attention: varlen causal flash attention of the new tokens over the paged cache.

Contract (docs/CONTRACTS.md): `paged_prefill_attention(q[T,Hq,D], k_cache, v_cache, cu_seqlens_q i32[B+1],
context_lens i32[B], block_tables, max_seqlen_q: int, scale) -> o[T,Hq,D]`: the q_len new tokens of
sequence b are the last of its context_lens[b] stored tokens; query i sits at position
context_len - q_len + i and attends causally. One kernel covers plain prefill, prefix-cache hits and
chunked prefill. The tile helpers (K/V widening, pages, token-major V) are the decode kernel's
(attention_decode.py); the torch reference is attention_ref.py.
"""

from __future__ import annotations

import torch

from ._triton import PlannedLaunch, cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .attention_decode import (
    LOG2E,
    _check_attention_inputs,
    _dot_precision,
    _in_kv_dtype,
    _load_v_token_major,
    _tile_pages,
)
from .kv_cache import is_token_major


@triton.jit
def _prefill_tile(
    acc, m_i, l_i, q, q_pos, n0, ctx, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
    kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
    scale_log2e, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr,
):
    """Online-softmax update with keys n0..n0+BLOCK_N; CAUSAL_MASK only on diagonal tiles."""
    if V_TOKEN_MAJOR:  # n0 is a multiple of BLOCK_N (both loops): lets V's loads vectorise along tokens
        n0 = tl.multiple_of(n0, BLOCK_N)
    tok = n0 + tl.arange(0, BLOCK_N)
    t_mask = tok < ctx
    page = _tile_pages(bt_row, tok, t_mask, ctx, BLOCK_SIZE, True, V_TOKEN_MAJOR)
    in_page = tok % BLOCK_SIZE
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k_rows = page * kc_stride_b + in_page * kc_stride_s + kv_head * kc_stride_h
    k = _in_kv_dtype(tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), k_cache_ptr, q)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    if CAUSAL_MASK:
        s = tl.where((tok[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_rows = page * vc_stride_b + in_page * vc_stride_s + kv_head * vc_stride_h
    if V_TOKEN_MAJOR:  # tiles before the diagonal are full: only the diagonal ones zero tokens past the end
        v = _load_v_token_major(v_cache_ptr, v_rows, d, d_mask, t_mask, vc_stride_d, q, CAUSAL_MASK)
    else:
        v = _in_kv_dtype(tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), v_cache_ptr,
                         q)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# the block-table width changes per batch; the per-sequence pointers of a mixed step's prefill part start
# at its first prefill row (any alignment): one variant for both
@triton.jit(do_not_specialize=["bt_stride_b"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    scale_log2e,
    q_stride_t, q_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h,
    vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
    bt_stride_b, out_stride_t, out_stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = (BLOCK_M queries of one sequence, one q head)."""
    pdl_enter(USE_PDL)
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return

    ctx = tl.load(context_lens_ptr + seq)
    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    q_pos = ctx - q_len + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_tokens = (q_start + rows).to(tl.int64)
    q_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_tokens[:, None] * q_stride_t + head * q_stride_h + d[None, :], mask=q_mask, other=0.0)

    q = _in_kv_dtype(q, k_cache_ptr, q)  # the tiles widen K/V to this q's dtype
    kv_head = head // GROUP
    bt_row = block_tables_ptr + seq * bt_stride_b
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys below the first query of this tile are visible to every row: no causal mask there.
    # The first masked tile contains key (ctx - q_len + m0) <= every row's position, so each
    # row sees a finite score before any fully masked tile (no NaN from -inf - -inf).
    diag_start = (ctx - q_len + m0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)
    for n0 in range(0, diag_start, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, q_pos, n0, ctx, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
            kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
            scale_log2e, d, d_mask, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, V_TOKEN_MAJOR,
        )
    for n0 in range(diag_start, hi, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, q_pos, n0, ctx, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
            kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
            scale_log2e, d, d_mask, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, V_TOKEN_MAJOR,
        )
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


_MAX_SHARED_BYTES = 232448  # H100/H200 opt-in shared memory per block


def _prefill_config(max_seqlen_q: int, block_d: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Measured on H200 (bf16, Hq=32, Hk=8, D=128,
    4K causal prefill): 128/128/8 warps/3 stages 438 us, 64/64/4/3 457 us, 128/64/8/2 516 us.
    Shared memory holds Q plus `stages` K and V tiles; shrink until it fits."""
    block_m = min(128 if elem_bytes == 2 and block_d <= 128 else 64, max(16, next_pow2(max_seqlen_q)))
    block_n = 128 if block_m >= 128 else 64
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 3 if elem_bytes == 2 else 2  # fp32 (3xTF32) needs extra operand buffers

    def shared_bytes(n, stages):
        return (block_m * block_d + stages * 2 * n * block_d) * elem_bytes

    while shared_bytes(block_n, num_stages) > _MAX_SHARED_BYTES:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return block_m, block_n, num_warps, num_stages


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    plans: dict | None = None,
) -> torch.Tensor:
    """Varlen causal attention of the new tokens over the paged cache. `max_seqlen_q` is a host
    int (>= every q_len) that sizes the grid; no GPU value is read on the host. block_m/block_n/
    num_warps/num_stages are tuning knobs (defaults chosen for H200, bf16, D=128). `plans`: as
    paged_decode_attention_triton's (the step's first layer plans the launch, the others replay it)."""
    key = ("paged_prefill", q.shape[0], q.stride(0), q.stride(1), q.dtype, k_cache.dtype, k_cache.stride(),
           v_cache.stride(), scale, max_seqlen_q, id(block_tables), id(cu_seqlens_q), id(context_lens),
           None if out is None else (out.stride(0), out.stride(1)))
    launch = plans.get(key) if plans is not None else None
    if launch is None:
        launch = _plan_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale,
                               out, block_m, block_n, num_warps, num_stages, pdl)
        if plans is not None:
            plans[key] = launch
    return launch(q, k_cache, v_cache, out)


def _plan_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, out, block_m,
                  block_n, num_warps, num_stages, pdl) -> PlannedLaunch:
    """One _prefill_kernel launch, planned: the argument checks and choices made here, once."""
    require_triton()
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hk={num_kv_heads}")
    _check_attention_inputs(q, k_cache, v_cache)
    if out is None:  # the strides a fresh output has (each call allocates its own)
        out = torch.empty(q.shape, dtype=q.dtype, device="meta")
    batch = context_lens.shape[0]
    max_seqlen_q = int(max_seqlen_q)
    if num_tokens == 0 or batch == 0 or max_seqlen_q <= 0:
        return PlannedLaunch(None, None, (), (), {}, q.shape, q.dtype)
    block_d = max(16, next_pow2(head_dim))
    default_m, default_n, default_warps, default_stages = _prefill_config(max_seqlen_q, block_d, q.element_size())
    block_m, block_n = block_m or default_m, block_n or default_n
    if min(block_m, block_n) < 16 or (block_m & (block_m - 1)) or (block_n & (block_n - 1)):
        raise ValueError(f"block_m/block_n must be powers of two >= 16, got {block_m}/{block_n}")
    return PlannedLaunch(
        _prefill_kernel, (cdiv(max_seqlen_q, block_m), num_q_heads, batch),
        (block_tables, cu_seqlens_q, context_lens),
        (float(scale) * LOG2E,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
         block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
             BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
             V_TOKEN_MAJOR=is_token_major(v_cache),
             num_warps=num_warps or default_warps, num_stages=num_stages or default_stages, **pdl_args(pdl)),
        q.shape, q.dtype)
