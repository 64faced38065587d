"""Attention over the paged KV cache: decode (one query per sequence) and prefill/extend.

Contracts (docs/CONTRACTS.md):
- `paged_decode_attention(q[B,Hq,D], k_cache[N,S,Hk,D], v_cache, block_tables i32[B,M],
  context_lens i32[B], scale) -> o[B,Hq,D]`: the query of sequence b attends to its
  `context_lens[b]` cached tokens (the new token is already stored); rows with context 0 give 0.
- `paged_prefill_attention(q[T,Hq,D], k_cache, v_cache, cu_seqlens_q i32[B+1], context_lens i32[B],
  block_tables, max_seqlen_q: int, scale) -> o[T,Hq,D]`: the q_len new tokens of sequence b are the
  last of its context_lens[b] stored tokens; query i sits at position context_len - q_len + i and
  attends causally. One kernel covers plain prefill, prefix-cache hits and chunked prefill.
GQA: q head h reads kv head h // (Hq / Hk). Math in fp32; the output has q's dtype. The cache holds
q's dtype or fp8 (kernels/kv_cache.py): fp8 K/V are widened exactly as they are loaded, to q's
dtype, or to fp16 for bf16 q (whose products then run in fp16: `_in_kv_dtype`).

Both Triton kernels gather K/V token by token through the block table (physical row =
block_tables[b, t // S] * S + t % S), so every block size works, including 1.
The decode launcher never reads GPU values on the host (no .item()/.tolist()), so it can be
captured in a CUDA graph: the grid depends only on shapes and the host ints given. Split-KV decode
is one launch: the last split of each (sequence, kv head) to finish, found with an int32 arrival
counter that it resets to 0, merges the partial results (no separate reduce kernel).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._triton import cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .kv_cache import FP8_KV_DTYPE, cast_to_cache, check_cache_dtype, check_v_cache_layout, is_token_major
from .qkv_prep import _check_prep_inputs, _load_heads, _norm_rope, _rope_lanes, _split_heads, qk_norm_rope_store_ref

LOG2E = 1.4426950408889634
DEFAULT_MAX_NUM_SPLITS = 32
# ~4 resident programs per SM on an H200 (132 SMs): split the KV range until the grid reaches it.
_TARGET_DECODE_PROGRAMS = 512
# Tokens a program step: 64 for one-pass launches (large batches), 32 for split launches (small
# batches). A split covers at least _DECODE_MIN_SPLIT_TOKENS: a context shorter than that is one
# split that writes its output directly (no partials, no arrival counter, no merge). Chosen on the
# H200 (docs/PERFORMANCE.md, run 13: attn_sweep at batch 1 with the engine's table width): (32, 32)
# gave 2.58 / 4.37 / 4.33 us a launch at contexts 32 / 96 / 160 against 3.26 / 4.80 / 6.28 for the
# earlier (64, 256), and 7.26 against 11.00 at 1,024 (where 64-token tiles would give 6.60: the
# launch knows the table width, not the context, so the short-context choice is taken).
_DECODE_BLOCK_N = 64
_DECODE_SPLIT_BLOCK_N = 32
_DECODE_MIN_SPLIT_TOKENS = 32
# fp8 cache, one-pass launches of many programs: 128-token tiles (the same bytes a step as bf16's 64).
# Run 30: 130.4 against 139.4 us at 256 rows x context 600 (2,048 programs), but 67.8 against 63.0 at
# 64 rows (512 programs, one wave), so only from this many programs.
_FP8_WIDE_TILE_PROGRAMS = 1024
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's y dimension

# ----------------------------------------------------------------------------------------------
# torch references (the CPU path)
# ----------------------------------------------------------------------------------------------


def _gather_context(k_cache, v_cache, block_table_row, length):
    """The first `length` cached tokens of one sequence as dense [length, Hk, D] K and V."""
    block_size = k_cache.shape[1]
    blocks = block_table_row[: cdiv(length, block_size)].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:length]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:length]
    return k, v


def _attend(q, k, v, scale, first_pos):
    """fp32 attention of q[Lq,Hq,D] over k/v[L,Hk,D]; query i sits at position first_pos + i."""
    num_q, num_heads = q.shape[:2]
    length, num_kv_heads = k.shape[:2]
    if num_q == 1:  # decode: two small grouped matmuls beat SDPA's per-call cost on the CPU by ~50x
        group = num_heads // num_kv_heads
        qg = q.float().view(num_kv_heads, group, -1)  # [Hk, G, D]
        scores = torch.einsum("hgd,lhd->hgl", qg, k.float()) * scale
        out = torch.einsum("hgl,lhd->hgd", scores.softmax(dim=-1), v.float())
        return out.reshape(1, num_heads, -1)
    qh = q.float().transpose(0, 1).unsqueeze(0)
    kh = k.float().transpose(0, 1).unsqueeze(0)
    vh = v.float().transpose(0, 1).unsqueeze(0)
    mask = None
    if num_q > 1:  # a single query is the last position and sees every key
        key_pos = torch.arange(length, device=q.device)
        q_pos = first_pos + torch.arange(num_q, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
    )
    return out[0].transpose(0, 1)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    **_tuning,
) -> torch.Tensor:
    """One batched pass in fp32: every row's blocks gathered up to the longest context, the keys past
    a row's length masked out (a row of length 0 gives zeros). Why batched: the per-row loop it
    replaced cost ~10% of a batch-8 decode step of the CPU engine (docs/PERFORMANCE.md, session 7).
    Tuning kwargs of the Triton launcher (max_num_splits, workspace, ...) are accepted and ignored."""
    out = torch.empty_like(q) if out is None else out
    lens = context_lens.long()
    max_len = int(lens.max()) if lens.numel() else 0
    if max_len == 0:
        return out.zero_()
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    blocks = block_tables[:, : cdiv(max_len, k_cache.shape[1])].long().clamp_min(0)  # -1: unused, masked
    k = k_cache[blocks].flatten(1, 2)[:, :max_len].float()  # [B, L, Hk, D]
    v = v_cache[blocks].flatten(1, 2)[:, :max_len].float()
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    past_end = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]  # [B, L]
    probs = scores.masked_fill(past_end[:, None, None, :], float("-inf")).softmax(dim=-1)
    probs = probs.nan_to_num(nan=0.0)  # a row with no keys: all -inf, softmax NaN -> zeros
    # V past a row's end is another row's data or stale (a freed block's, maybe NaN): zero, not 0 * NaN
    v = v.masked_fill(past_end[:, :, None, None], 0.0)
    out.copy_(torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(batch, num_heads, head_dim))
    return out


def paged_prefill_attention_ref(
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
    **_tuning,
) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(context_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k, v = _gather_context(k_cache, v_cache, block_tables[b], length)
        out[start:end] = _attend(q[start:end], k, v, scale, length - (end - start)).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton: decode with split-KV (one launch: the last split of each (sequence, kv head) merges)
# ----------------------------------------------------------------------------------------------
#
# Memory-ordering argument of the in-kernel merge (the GPU, not the interpreter, which runs the
# programs one after the other and has no races):
# * A program's partial-output and log-sum-exp stores are issued by many threads, while a scalar
#   `tl.atomic_add` is issued by one thread of the program (Triton predicates scalar atomics to a
#   single thread and broadcasts the old value through shared memory). So the writers first run
#   `tl.debug_barrier()` (bar.sync): every thread's stores precede, in causality order, the
#   counting thread's atomic. That atomic is `sem="acq_rel", scope="gpu"`; its release half is
#   cumulative, so it publishes all the stores ordered before it - the other threads' included -
#   at GPU scope (the pattern of CUTLASS's split-K semaphore: __syncthreads, then one thread's
#   red.release.gpu).
# * The counter's modification order is a total order: exactly one program reads the value
#   `live - 1` and it is the last. Its acquire half synchronises with the release of every
#   program that incremented before it, so all live partials are visible to the counting thread.
#   The result broadcast (and an explicit `tl.debug_barrier()`) orders that acquire before the
#   loads of the program's other threads, which read the partials with `.cg` (L2, bypassing the
#   SM's non-coherent L1 - belt and braces: acquire already invalidates it).
# * The last program sets the counter back to 0. Nothing else touches that counter in this
#   launch any more, and the next launch (or CUDA-graph replay) is ordered after this one by the
#   stream, so every launch finds its counters at 0 and leaves them at 0.


@triton.jit
def _in_kv_dtype(x, cache_ptr, q):
    """x in the dtype the products with cached K/V run in: q's, except bf16 q over an fp8 cache,
    which runs in fp16. Why: sm_90 widens e4m3 pairs to f16x2 in one instruction, while bf16 goes
    through fp32 (four times the conversions). fp8 values are exact in fp16. Probabilities are finer
    in fp16 above ~1.5e-5, coarser below 6e-5 (fp16 subnormals) and 0 below ~3e-8 (bf16 reaches
    1e-38): a negligible share of a softmax row. q loses precision below 6e-5 and overflows past 65,504."""
    fp16_products: tl.constexpr = (cache_ptr.dtype.element_ty == tl.float8e4nv) & (q.dtype == tl.bfloat16)
    if fp16_products:
        y = x.to(tl.float16)
    else:
        y = x.to(q.dtype)
    return y


@triton.jit
def _widen_v_tile(v, mask, cache_ptr, q):
    """A loaded V tile in the products' dtype (_in_kv_dtype). fp8: masked again after the widening,
    which keeps Triton from moving the widening past the shared-memory staging of P @ V's V operand:
    it would then read V transposed byte by byte (sm_90 PTX: 64 ld.shared.b8 a tile instead of
    ldmatrix, and 150 registers a thread against 128). V then stays out of the cp.async pipeline that
    stages K (plain ld.global), which still measured faster than letting that pipeline take it (run 30:
    139.4 against 163.1 us at 256 x 600) or than loading V a tile ahead in registers (run 29: 174.7)."""
    v = _in_kv_dtype(v, cache_ptr, q)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        v = tl.where(mask, v, 0.0)
    return v


@triton.jit
def _tile_pages(bt_row, tok, t_mask, end, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CLAMP: tl.constexpr):
    """The cache block of every token of a tile, from the block table. MASKED tiles: tokens from `end`
    on read page 0 (masked load), or with CLAMP the last valid token's page (an unmasked load, so the
    page keeps Triton's per-block constancy and token-major V's loads stay vectorised)."""
    if MASKED:
        if CLAMP:
            page = tl.load(bt_row + tl.minimum(tok // BLOCK_SIZE, (end - 1) // BLOCK_SIZE))
        else:
            page = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_mask, other=0)
    else:
        page = tl.load(bt_row + tok // BLOCK_SIZE)
    return page.to(tl.int64)


@triton.jit
def _load_v_token_major(v_cache_ptr, v_rows, d, d_mask, t_mask, vc_stride_d, q, MASKED: tl.constexpr):
    """A token-major V tile (kv_cache.token_major_v_cache) as [BLOCK_N, BLOCK_D] in the products' dtype:
    loaded as [BLOCK_D, BLOCK_N] along tokens without a token mask (pages from _tile_pages with CLAMP,
    so every address is in a valid block) and handed on transposed, as K is to q @ K^T. In a MASKED
    tile the tokens from the end read other rows of their block (stale, possibly NaN): zeroed."""
    vt = _in_kv_dtype(tl.load(v_cache_ptr + v_rows[None, :] + d[:, None] * vc_stride_d, mask=d_mask[:, None],
                              other=0.0), v_cache_ptr, q)
    if MASKED:
        vt = tl.where(t_mask[None, :], vt, 0.0)
    return tl.trans(vt)


@triton.jit
def _decode_step(q, q_kv, m_i, l_i, acc, n0, end, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
                 kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
                 scale_log2e, d, d_mask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr):
    """One online-softmax step of the decode loop over tokens n0 .. n0 + BLOCK_N - 1: (m_i, l_i, acc)
    updated. MASKED: tokens from `end` on are left out (else the whole tile is below `end`).
    V_TOKEN_MAJOR: V is read as [D, BLOCK_N] tiles along tokens (kv_cache.token_major_v_cache) and
    handed to P @ V transposed, as K is to q @ K^T."""
    tok = n0 + tl.arange(0, BLOCK_N)
    t_mask = tok < end
    page = _tile_pages(bt_row, tok, t_mask, end, BLOCK_SIZE, MASKED, V_TOKEN_MAJOR)
    if MASKED:
        kv_mask = t_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    in_page = tok % BLOCK_SIZE
    k_rows = page * kc_stride_b + in_page * kc_stride_s + kv_head * kc_stride_h
    k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v_rows = page * vc_stride_b + in_page * vc_stride_s + kv_head * vc_stride_h
    if not V_TOKEN_MAJOR:  # V's load in flight with K's: one memory round trip a tile instead of two
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    k = _in_kv_dtype(k, k_cache_ptr, q)
    if not V_TOKEN_MAJOR:
        v = _widen_v_tile(v, kv_mask, v_cache_ptr, q)
    if USE_DOT:
        s = tl.dot(q_kv, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1)[None, :]
    if MASKED:
        s = tl.where(t_mask[None, :], s * scale_log2e, float("-inf"))
    else:
        s = s * scale_log2e
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_TOKEN_MAJOR:
        v = _load_v_token_major(v_cache_ptr, v_rows, d, d_mask, t_mask, vc_stride_d, q, MASKED)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(tl.sum(p, axis=0)[:, None] * v.to(tl.float32), axis=0)[None, :]
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_merge_splits(
    part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, live, num_splits, num_q_heads,
    out_stride_b, out_stride_h,
    GROUP: tl.constexpr, BLOCK_GM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE_SPLITS: tl.constexpr,
):
    """out[heads of kv_head] = sum_s w_s * part_s / sum_s w_s with w_s = 2^(lse_s - max lse),
    over the `live` (>= 2) splits, MERGE_SPLITS partials at a time (bounded registers)."""
    g = tl.arange(0, BLOCK_GM)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    base = (seq * num_q_heads + heads) * num_splits  # workspace row of split 0, per q head
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base[:, None] + s[None, :], mask=g_mask[:, None] & (s < live)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    lse_max = tl.where(g_mask, tl.max(lse, axis=1), 0.0)  # finite on real heads (live >= 2)
    total = tl.sum(tl.exp2(lse - lse_max[:, None]), axis=1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
    for s0 in range(0, live, MERGE_SPLITS):
        st = s0 + tl.arange(0, MERGE_SPLITS)
        gs_mask = g_mask[:, None] & (st < live)[None, :]
        rows = base[:, None] + st[None, :]
        w = tl.exp2(tl.load(part_lse_ptr + rows, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
                    - lse_max[:, None])
        parts = tl.load(part_out_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :],
                        mask=gs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(w[:, :, None] * parts, axis=1)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_offs = seq * out_stride_b + heads[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["bt_stride_b"])  # the block-table width changes per batch
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    pos_ptr, cos_sin_ptr, q_norm_w_ptr, k_norm_w_ptr, slot_ptr, eps, cos_sin_stride,
    scale_log2e, num_splits, min_chunk,
    q_stride_b, q_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h,
    vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
    bt_stride_b, out_stride_b, out_stride_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, ONE_PASS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_GM: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_SPLITS: tl.constexpr,
    FUSED_PREP: tl.constexpr, HALF: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program = (sequence, kv head, split): all GROUP q heads of that kv head over one
    contiguous token range of the context. ONE_PASS (a single split): writes the output. Else a
    sequence whose context fits one split also writes it directly; otherwise each live split
    writes its normalised partial output + log2-sum-exp, counts itself on the (sequence, kv head)
    counter, and the last one to arrive merges the partials into the output (see above).

    FUSED_PREP: q_ptr is the raw qkv projection row ([B, (Hq+2Hk)*D], row stride q_stride_b).
    Every program norms and rotates its GROUP q heads itself (qkv_prep's rounding); the program
    whose range ends at the context's last token (this step's, position ctx-1) reads the cache up
    to ctx-2, then norms and rotates that token's k, attends to it from registers (one more
    online-softmax step) and stores k and v into the cache at slot_mapping[b]; with slot -1 it
    stores nothing and reads position ctx-1 from the cache, as the composition does. One launch
    instead of qk_norm_rope_store + decode. Costs: the rotary lane constants stay live across the
    loop (sm_90: 109-111 registers a thread against 72 for the split launch, 118-120 against 107
    one-pass), and the launch compiles without fp contraction (for q's rounding points), so the
    softmax updates are separate multiplies and adds."""
    pdl_enter(USE_PDL)
    # kv heads vary fastest in launch order: a row's programs start together, and rows start in
    # batch order (the scheduler puts the longest contexts first, so the launch's tail is short ones)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(0)
    num_q_heads = num_kv_heads * GROUP

    # Token range of this split: the context cut into num_splits chunks rounded up to BLOCK_N.
    # Splits 0..live-1 are non-empty; all programs of a (sequence, kv head) agree on `live`.
    ctx = tl.load(context_lens_ptr + seq)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, min_chunk)  # a BLOCK_N multiple
    live = tl.cdiv(ctx, tl.maximum(chunk, 1))  # 0 for an empty context
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    if not ONE_PASS:
        # Empty splits do nothing (they are not counted: the merge waits for `live` arrivals);
        # split 0 of an empty context still runs to write its zeros.
        if split >= tl.maximum(live, 1):
            return

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    if FUSED_PREP:
        dtype = q_ptr.dtype.element_ty
        d, partner, sign, is_rot, cos, sin = _rope_lanes(pos_ptr, seq, cos_sin_ptr, cos_sin_stride, dtype, HALF,
                                                         BLOCK_D)
    else:
        d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    qd_mask = g_mask[:, None] & d_mask[None, :]
    if FUSED_PREP:
        qkv_row = q_ptr + seq * q_stride_b
        x, xp = _load_heads(qkv_row + heads[:, None] * HEAD_DIM, d, partner, qd_mask)
        q = _norm_rope(x, xp, q_norm_w_ptr, eps, cos, sin, d, partner, sign, is_rot, HEAD_DIM, HAS_Q_NORM, dtype)
        # the program whose range ends at the context's end takes the newest token (this step's)
        # from qkv after the loop and stores it: the loop stops one token short for it. A row
        # whose token is not stored (slot -1) attends to what the cache holds, as the composition.
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        owner = (end == ctx) & (ctx > 0) & (slot >= 0)
        loop_end = tl.where(owner, end - 1, end)
    else:
        loop_end = end
        q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=qd_mask, other=0.0)

    q_kv = _in_kv_dtype(q, k_cache_ptr, q)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * bt_stride_b
    if V_TOKEN_MAJOR:  # full tiles without token masks (V's loads then vectorise along tokens), then the tail
        full_end = start + (loop_end - start) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = _decode_step(
                q, q_kv, m_i, l_i, acc, tl.multiple_of(n0, BLOCK_N), loop_end, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
                scale_log2e, d, d_mask, BLOCK_SIZE, BLOCK_N, USE_DOT, DOT_PRECISION, False, True)
        # the tail in smaller masked tiles: one full-size masked tile outside the loop is not staged
        # through shared memory and held 184 registers a thread against 118 without it (sm_90)
        for n0 in range(full_end, loop_end, TAIL_BLOCK_N):
            m_i, l_i, acc = _decode_step(
                q, q_kv, m_i, l_i, acc, tl.multiple_of(n0, TAIL_BLOCK_N), loop_end, bt_row, k_cache_ptr,
                v_cache_ptr, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h,
                vc_stride_d, scale_log2e, d, d_mask, BLOCK_SIZE, TAIL_BLOCK_N, USE_DOT, DOT_PRECISION, True, True)
    else:
        for n0 in range(start, loop_end, BLOCK_N):
            m_i, l_i, acc = _decode_step(
                q, q_kv, m_i, l_i, acc, n0, loop_end, bt_row, k_cache_ptr, v_cache_ptr,
                kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
                scale_log2e, d, d_mask, BLOCK_SIZE, BLOCK_N, USE_DOT, DOT_PRECISION, True, False)

    if FUSED_PREP:
        if owner:  # the newest token: k normed and rotated, v as projected, one more online-softmax step
            one = tl.zeros([1], dtype=tl.int32)  # the token as a [1, BLOCK_D] row
            new_mask = (one == 0)[:, None] & d_mask[None, :]
            xk, xkp = _load_heads(qkv_row + (num_q_heads + kv_head) * HEAD_DIM + one[:, None], d, partner, new_mask)
            k_new = cast_to_cache(_norm_rope(xk, xkp, k_norm_w_ptr, eps, cos, sin, d, partner, sign, is_rot,
                                             HEAD_DIM, HAS_K_NORM, dtype), k_cache_ptr)
            v_src = qkv_row + (num_q_heads + num_kv_heads + kv_head) * HEAD_DIM + one[:, None]
            v_new = cast_to_cache(tl.load(v_src + d[None, :], mask=new_mask, other=0.0), v_cache_ptr)
            if USE_DOT:  # the q the loop's scores used: its tl.dot takes q_kv, its sum (GQA 1) q
                q_scores = q_kv
            else:
                q_scores = q
            s_new = tl.sum(q_scores.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale_log2e  # [BLOCK_G]
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            if USE_DOT:  # the loop's P @ V takes p in the dtype K/V are widened to
                p_new = _in_kv_dtype(p_new, k_cache_ptr, q).to(tl.float32)
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
            m_i = m_new
            page = slot // BLOCK_SIZE
            in_page = slot % BLOCK_SIZE
            k_dst = k_cache_ptr + page * kc_stride_b + in_page * kc_stride_s + kv_head * kc_stride_h
            v_dst = v_cache_ptr + page * vc_stride_b + in_page * vc_stride_s + kv_head * vc_stride_h
            tl.store(k_dst + one[:, None] + d[None, :], k_new, mask=new_mask)
            tl.store(v_dst + one[:, None] + d[None, :] * vc_stride_d, v_new, mask=new_mask)

    out_offs = seq * out_stride_b + heads[:, None] * out_stride_h + d[None, :]
    if ONE_PASS:
        # Empty context: acc is 0 and l_i is 0 -> write zeros.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        if live <= 1:  # the whole context is this split (or it is empty): no merge needed
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
        else:
            rows = (seq * num_q_heads + heads) * num_splits + split
            tl.store(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=qd_mask)
            tl.store(part_lse_ptr + rows, m_i + tl.log2(l_i), mask=g_mask)
            # All threads' partial stores are issued before the one counting thread releases them.
            tl.debug_barrier()
            counter = counters_ptr + seq * num_kv_heads + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == live - 1:  # the last live split of this (sequence, kv head)
                tl.debug_barrier()  # the acquire above precedes every thread's partial loads
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _decode_merge_splits(
                    part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, live, num_splits, num_q_heads,
                    out_stride_b, out_stride_h,
                    GROUP, BLOCK_GM, HEAD_DIM, BLOCK_D, BLOCK_S, MERGE_SPLITS,
                )


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    max_context_len: int,
    max_num_splits: int = DEFAULT_MAX_NUM_SPLITS,
    block_n: int = _DECODE_BLOCK_N,
) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, never more than
    max_num_splits or than max_context_len / block_n. Host ints only (graph-capturable)."""
    useful = cdiv(max(1, max_context_len), block_n)
    wanted = cdiv(_TARGET_DECODE_PROGRAMS, max(1, batch * num_kv_heads))
    return max(1, min(max_num_splits, wanted, useful))


def decode_block_n(num_splits: int, num_programs: int, cache_dtype: torch.dtype, v_token_major: bool = False) -> int:
    """Tokens a program step by default: 32 for split launches, 64 for one-pass ones, 128 for one-pass
    launches over an fp8 cache that is token-major (the engine's fp8 layout; run 35: 121.4 against 124.9
    us at 256 rows x 600, 53.2 against 56.2 at 64 x 1,088) or has at least _FP8_WIDE_TILE_PROGRAMS
    (batch x Hk) programs (head-major: runs 30-31)."""
    if num_splits > 1:
        return _DECODE_SPLIT_BLOCK_N
    if cache_dtype == FP8_KV_DTYPE and (v_token_major or num_programs >= _FP8_WIDE_TILE_PROGRAMS):
        return 2 * _DECODE_BLOCK_N
    return _DECODE_BLOCK_N


def decode_workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of split scratch: partial outputs [B,Hq,splits,D] + log-sum-exp [B,Hq,splits]."""
    return batch * num_q_heads * num_splits * (head_dim + 1)


def decode_workspace_numel_for(max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                               table_tokens: int, max_num_splits: int = DEFAULT_MAX_NUM_SPLITS) -> int:
    """fp32 elements of split scratch that cover every default launch (block_n None) of batch
    <= max_batch over block tables of `table_tokens` tokens: the largest batch x splits product of
    the launches that split (tight: ~B*Hk*splits stays near _TARGET_DECODE_PROGRAMS)."""
    needs = [decode_workspace_numel(b, num_q_heads, head_dim, splits) for b in range(1, max_batch + 1)
             if (splits := decode_num_splits(b, num_kv_heads, table_tokens, max_num_splits)) > 1]
    return max(needs, default=0)


def alloc_decode_workspace(
    max_batch: int,
    num_q_heads: int,
    head_dim: int,
    max_num_splits: int = DEFAULT_MAX_NUM_SPLITS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Scratch for paged_decode_attention_triton(workspace=...), valid for any batch <= max_batch
    launched with the same (or a smaller) max_num_splits. Needs no initialisation."""
    numel = decode_workspace_numel(max_batch, num_q_heads, head_dim, max_num_splits)
    return torch.empty(numel, dtype=torch.float32, device=device)


def alloc_decode_counters(
    max_batch: int, num_kv_heads: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Arrival counters for paged_decode_attention_triton(counters=...): int32 [max_batch * Hk],
    ZERO-initialised. Every launch leaves them at zero again, so allocate once and reuse them for
    any batch <= max_batch (and across CUDA-graph replays). Launches that may run concurrently
    (different streams) need separate counter buffers; sequential ones can share."""
    return torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)


# Counters used when the caller passes none: one zeroed buffer per device, shared by all
# sequential launches (each leaves it zeroed). A split launch of the shape rule has B*Hk <
# _TARGET_DECODE_PROGRAMS (else it would be one pass), so the first allocation fits every later
# one; a forced `num_splits` at a larger batch grows it (a fallback), and outgrown buffers are kept
# alive because a captured CUDA graph may point at them. The model runner's eager warm-up forward
# before each capture allocates the buffer.
_SHARED_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN_COUNTERS: list[torch.Tensor] = []


def _default_decode_counters(device: torch.device, numel: int) -> torch.Tensor:
    counters = _SHARED_COUNTERS.get(device)
    if counters is not None and counters.numel() >= numel:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Not allocated before the capture: a zeroed buffer of this call (the memset is captured
        # too, so every replay starts from zero); keeps the shared one out of a graph pool.
        return torch.zeros(numel, dtype=torch.int32, device=device)
    if counters is not None:
        _OUTGROWN_COUNTERS.append(counters)
    counters = torch.zeros(max(numel, _TARGET_DECODE_PROGRAMS), dtype=torch.int32, device=device)
    _SHARED_COUNTERS[device] = counters
    return counters


def _check_attention_inputs(q, k_cache, v_cache) -> None:
    check_cache_dtype(q.dtype, k_cache, v_cache, "q")
    check_v_cache_layout(v_cache)
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: 3xTF32 keeps ~fp32 accuracy on tensor cores (plain "ieee" compiles to slow FMA
    # code); 16-bit inputs ignore the option.
    return "tf32x3" if dtype == torch.float32 else "tf32"


# fp32 partials the merge holds at once ([GROUP, MERGE_SPLITS, D]): ~32 registers per thread at 4 warps.
_MERGE_TILE_ELEMS = 4096


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    counters: torch.Tensor | None = None,
    min_split_tokens: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    num_splits: int | None = None,
    tail_block_n: int | None = None,
) -> torch.Tensor:
    """Split-KV paged decode in one launch. Splits come from shapes only (batch, Hk, M*S) and
    max_num_splits; `workspace` (see alloc_decode_workspace) avoids an allocation per call;
    `counters` (see alloc_decode_counters: int32, >= B*Hk, zero-initialised, left zeroed) are
    the merge's arrival counters, by default a shared per-device buffer; `out` may be given.
    `min_split_tokens` (default 32, rounded up to block_n) is the fewest tokens a split covers.
    block_n defaults to 64 where the launch needs no split (batch x Hk fills the GPU) and to 32
    where it splits (the split count is taken at block_n 64 either way). num_warps / num_stages are
    tuning knobs (defaults: 4 warps, 8 for groups over 32; 2 stages), as is `num_splits` (replaces the
    shape rule; at most max_num_splits, and a given workspace must hold it). One-pass launches over
    an fp8 cache may take 128-token tiles (`decode_block_n`). Over token-major V the loop takes full
    tiles and then the context's tail in masked tiles of `tail_block_n` tokens (default block_n / 2,
    at least 16; a power of two <= block_n)."""
    require_triton()
    batch, num_q_heads, head_dim = q.shape
    _check_attention_inputs(q, k_cache, v_cache)
    return _launch_decode(q, (q.stride(0), q.stride(1)), batch, num_q_heads, head_dim, k_cache, v_cache,
                          block_tables, context_lens, scale, None, max_num_splits=max_num_splits,
                          workspace=workspace, out=out, block_n=block_n, counters=counters,
                          min_split_tokens=min_split_tokens, num_warps=num_warps, num_stages=num_stages, pdl=pdl,
                          num_splits=num_splits, tail_block_n=tail_block_n)


def paged_decode_attention_qkv_composed(
    qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping,
    block_tables, context_lens, scale, num_q_heads, num_kv_heads, head_dim, *, prep, decode, **decode_kw,
):
    """The composition the fused decode launch replaces: `prep` (a qk_norm_rope_store: in place on
    qkv, K/V into the cache), then `decode` (a paged_decode_attention, given `decode_kw`) of the
    normed, rotated q."""
    q, _, _ = prep(qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping,
                   num_q_heads, num_kv_heads, head_dim)
    return decode(q, k_cache, v_cache, block_tables, context_lens, scale, **decode_kw)


# the torch path: the two references composed (the CPU engine and the oracle of the fused kernel)
paged_decode_attention_qkv_ref = functools.partial(paged_decode_attention_qkv_composed, prep=qk_norm_rope_store_ref,
                                                   decode=paged_decode_attention_ref)


def paged_decode_attention_qkv_triton(
    qkv, positions, cos_sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping,
    block_tables, context_lens, scale, num_q_heads, num_kv_heads, head_dim, *,
    max_num_splits: int | None = None, workspace: torch.Tensor | None = None, out: torch.Tensor | None = None,
    block_n: int | None = None, counters: torch.Tensor | None = None, min_split_tokens: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """qk_norm_rope_store + paged decode attention in one launch, for decode steps (one token a
    sequence, at position context_lens[b] - 1 of its block table). Same results: the cache gets the
    same K/V bits, q is rounded as qk_norm_rope_store rounds it, and the output matches the
    composition up to fp32 summation order. qkv's q and k parts are left as projected (the
    composition updates them in place: read neither after the call). Keywords as
    paged_decode_attention_triton, without its tuning knobs (num_warps, num_stages, num_splits, tail_block_n)."""
    require_triton()
    _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
    batch = qkv.shape[0]
    cos_sin = _check_prep_inputs(qkv, positions, cos_sin, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping,
                                 num_kv_heads, head_dim)
    prep = (positions, cos_sin, q_norm_w, k_norm_w, slot_mapping, float(eps))
    return _launch_decode(qkv, (qkv.stride(0), head_dim), batch, num_q_heads, head_dim, k_cache, v_cache,
                          block_tables, context_lens, scale, prep, max_num_splits=max_num_splits,
                          workspace=workspace, out=out, block_n=block_n, counters=counters,
                          min_split_tokens=min_split_tokens, num_warps=None, num_stages=None, pdl=pdl)


def _launch_decode(q_src, q_strides, batch, num_q_heads, head_dim, k_cache, v_cache, block_tables, context_lens,
                   scale, prep, *, max_num_splits, workspace, out, block_n, counters, min_split_tokens, num_warps,
                   num_stages, pdl, num_splits=None, tail_block_n=None):
    """One _decode_split_kernel launch; `prep` (positions, cos_sin, q_norm_w, k_norm_w, slot_mapping,
    eps) makes it the fused variant reading the raw qkv row at q_src."""
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q heads [{batch}, {num_q_heads}, {head_dim}]")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hk={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if batch > _MAX_GRID_Y:  # the batch is the grid's y dimension (kv heads run fastest, on x)
        raise ValueError(f"decode batch {batch} exceeds {_MAX_GRID_Y} rows a launch")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    max_num_splits = max_num_splits or DEFAULT_MAX_NUM_SPLITS
    if num_splits is None:
        num_splits = decode_num_splits(
            batch, num_kv_heads, block_tables.shape[1] * block_size, max_num_splits, block_n or _DECODE_BLOCK_N
        )
    elif not 1 <= num_splits <= max_num_splits:
        raise ValueError(f"num_splits must be in [1, max_num_splits={max_num_splits}], got {num_splits}")
    if block_n is None:
        block_n = decode_block_n(num_splits, batch * num_kv_heads, k_cache.dtype, is_token_major(v_cache))
    if tail_block_n is None:
        tail_block_n = max(16, block_n // 2)
    elif tail_block_n < 16 or tail_block_n & (tail_block_n - 1) or tail_block_n > block_n:
        raise ValueError(f"tail_block_n must be a power of two in [16, block_n={block_n}], got {tail_block_n}")
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=q_src.dtype, device=q_src.device)
    if batch == 0:
        return out

    one_pass = num_splits == 1
    if one_pass:
        part_out = part_lse = counters = out  # unused placeholders
    else:
        numel = decode_workspace_numel(batch, num_q_heads, head_dim, num_splits)
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=q_src.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < numel:
            raise ValueError(f"workspace needs {numel} fp32 elements, got {workspace.numel()} {workspace.dtype}")
        split_rows = batch * num_q_heads * num_splits
        part_out = workspace[: split_rows * head_dim]
        part_lse = workspace[split_rows * head_dim : split_rows * (head_dim + 1)]
        if counters is None:
            counters = _default_decode_counters(q_src.device, batch * num_kv_heads)
        elif counters.dtype != torch.int32 or counters.numel() < batch * num_kv_heads:
            raise ValueError(f"counters need {batch * num_kv_heads} int32 elements, "
                             f"got {counters.numel()} {counters.dtype}")
    if prep is None:  # placeholders for the fused variant's pointers (never read)
        positions = cos_sin = q_norm_w = k_norm_w = slot_mapping = q_src
        eps, half, cos_sin_stride = 0.0, 1, 0
    else:
        positions, cos_sin, q_norm_w, k_norm_w, slot_mapping, eps = prep
        half, cos_sin_stride = cos_sin.shape[-1] // 2, cos_sin.stride(0)

    use_dot = group > 1
    block_g = max(16, next_pow2(group)) if use_dot else 1
    block_d = max(16, next_pow2(head_dim))
    block_gm = next_pow2(group)
    block_s = next_pow2(num_splits)
    merge_splits = max(1, min(block_s, _MERGE_TILE_ELEMS // (block_gm * block_d)))
    scale_log2e = float(scale) * LOG2E
    min_split = _DECODE_MIN_SPLIT_TOKENS if min_split_tokens is None else max(1, int(min_split_tokens))
    min_chunk = cdiv(min_split, block_n) * block_n
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q_src, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_lse, counters,
        positions, cos_sin, q_norm_w if q_norm_w is not None else q_src,
        k_norm_w if k_norm_w is not None else q_src, slot_mapping, eps, cos_sin_stride,
        scale_log2e, num_splits, min_chunk,
        q_strides[0], q_strides[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, TAIL_BLOCK_N=tail_block_n,
        USE_DOT=use_dot, ONE_PASS=one_pass, DOT_PRECISION=_dot_precision(q_src.dtype),
        BLOCK_GM=block_gm, BLOCK_S=block_s, MERGE_SPLITS=merge_splits,
        FUSED_PREP=prep is not None, HALF=half, HAS_Q_NORM=prep is not None and q_norm_w is not None,
        HAS_K_NORM=prep is not None and k_norm_w is not None, V_TOKEN_MAJOR=is_token_major(v_cache),
        num_warps=num_warps or (4 if block_g <= 32 else 8), num_stages=num_stages or 2, **pdl_args(pdl),
        # the fused variant keeps HF's rounding points in q/k (qkv_prep): no product contracted into an fma
        enable_fp_fusion=prep is None,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Triton: prefill / extend (varlen causal flash attention over the paged cache)
# ----------------------------------------------------------------------------------------------


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
        v = _widen_v_tile(tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), kv_mask,
                          v_cache_ptr, q)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["bt_stride_b"])  # the block-table width changes per batch
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
) -> torch.Tensor:
    """Varlen causal attention of the new tokens over the paged cache. `max_seqlen_q` is a host
    int (>= every q_len) that sizes the grid; no GPU value is read on the host. block_m/block_n/
    num_warps/num_stages are tuning knobs (defaults chosen for H200, bf16, D=128)."""
    require_triton()
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hk={num_kv_heads}")
    _check_attention_inputs(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    batch = context_lens.shape[0]
    max_seqlen_q = int(max_seqlen_q)
    if num_tokens == 0 or batch == 0 or max_seqlen_q <= 0:
        return out
    block_d = max(16, next_pow2(head_dim))
    default_m, default_n, default_warps, default_stages = _prefill_config(max_seqlen_q, block_d, q.element_size())
    block_m, block_n = block_m or default_m, block_n or default_n
    if min(block_m, block_n) < 16 or (block_m & (block_m - 1)) or (block_n & (block_n - 1)):
        raise ValueError(f"block_m/block_n must be powers of two >= 16, got {block_m}/{block_n}")
    grid = (cdiv(max_seqlen_q, block_m), num_q_heads, batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype), V_TOKEN_MAJOR=is_token_major(v_cache),
        num_warps=num_warps or default_warps, num_stages=num_stages or default_stages, **pdl_args(pdl),
    )
    return out
