"""Split-KV paged decode attention (one query per sequence) over the paged KV cache.

Contract (docs/CONTRACTS.md): `paged_decode_attention(q[B,Hq,D], k_cache[N,S,Hk,D], v_cache,
block_tables i32[B,M], context_lens i32[B], scale) -> o[B,Hq,D]`: the query of sequence b attends to
its `context_lens[b]` cached tokens (the new token is already stored); rows with context 0 give 0.
GQA: q head h reads kv head h // (Hq / Hk). Math in fp32; the output has q's dtype. The cache holds
q's dtype (V head-major) or fp8 (V token-major, kernels/kv_cache.py): fp8 K/V are widened exactly as
they are loaded, to q's dtype, or to fp16 for bf16 q (whose products then run in fp16: `_in_kv_dtype`), except
for bf16 q over the engine's fp8 layouts, whose products run on fp8 tensor cores (`uses_fp8_mma`,
attention_decode_fp8.py). The torch reference: attention_ref.py.

The kernel gathers K/V token by token through the block table (physical row =
block_tables[b, t // S] * S + t % S), so every block size works, including 1.
The launcher never reads GPU values on the host (no .item()/.tolist()), so it can be captured in a
CUDA graph: the grid depends only on shapes and the host ints given. Split-KV decode is one launch:
the last split of each (sequence, kv head) to finish, found with an int32 arrival counter that it
resets to 0, merges the partial results (no separate reduce kernel).
"""

from __future__ import annotations

import functools

import torch

from ._triton import PlannedLaunch, cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .attention_decode_fp8 import _fp8_attend
from .decode_split import _decode_finish, _split_range
from .kv_cache import FP8_KV_DTYPE, check_cache_dtype, check_v_cache_layout, is_token_major

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
_FP8_MMA_MIN_TOKENS = 64  # the fp8 tensor-core kernel's tiles: an sm_90 wgmma's M (attention_decode_fp8.py)
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's y dimension


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
        v = _in_kv_dtype(v, v_cache_ptr, q)
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


@triton.jit(do_not_specialize=["bt_stride_b"])  # the block-table width changes per batch
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    scale_log2e, num_splits, min_chunk,
    q_stride_b, q_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h,
    vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
    bt_stride_b, out_stride_b, out_stride_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, ONE_PASS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_GM: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_SPLITS: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr, FP8_MMA: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program = (sequence, kv head, split): all GROUP q heads of that kv head over one
    contiguous token range of the context. ONE_PASS (a single split): writes the output. Else a
    sequence whose context fits one split also writes it directly; otherwise each live split
    writes its normalised partial output + log2-sum-exp, counts itself on the (sequence, kv head)
    counter, and the last one to arrive merges the partials into the output (decode_split.py).
    V_TOKEN_MAJOR (an fp8 cache): full tiles without token masks, then the tail in masked tiles. FP8_MMA: the
    products on fp8 tensor cores (attention_decode_fp8.py: bf16 q over an fp8 cache)."""
    pdl_enter(USE_PDL)
    # kv heads vary fastest in launch order: a row's programs start together, and rows start in
    # batch order (the scheduler puts the longest contexts first, so the launch's tail is short ones)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start, end, live = _split_range(ctx, split, num_splits, min_chunk, BLOCK_N)
    if not ONE_PASS:
        if split >= tl.maximum(live, 1):  # an empty split (split 0 of an empty context writes its zeros)
            return

    bt_row = block_tables_ptr + seq * bt_stride_b
    if FP8_MMA:
        acc, m_i, l_i = _fp8_attend(q_ptr + seq * q_stride_b, q_stride_h, k_cache_ptr, v_cache_ptr, bt_row, start, end,
                                    kv_head, scale_log2e, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
                                    vc_stride_h, vc_stride_d, GROUP, BLOCK_G, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                    TAIL_BLOCK_N)
    else:
        g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + g
        g_mask = g < GROUP
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        qd_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=qd_mask, other=0.0)
        q_kv = _in_kv_dtype(q, k_cache_ptr, q)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if V_TOKEN_MAJOR:  # full tiles without token masks (V's loads then vectorise along tokens), then the tail
            full_end = start + (end - start) // BLOCK_N * BLOCK_N
            for n0 in range(start, full_end, BLOCK_N):
                m_i, l_i, acc = _decode_step(
                    q, q_kv, m_i, l_i, acc, tl.multiple_of(n0, BLOCK_N), end, bt_row, k_cache_ptr, v_cache_ptr,
                    kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
                    scale_log2e, d, d_mask, BLOCK_SIZE, BLOCK_N, USE_DOT, DOT_PRECISION, False, True)
            # the tail in smaller masked tiles: one full-size masked tile outside the loop is not staged
            # through shared memory and held 184 registers a thread against 118 without it (sm_90)
            for n0 in range(full_end, end, TAIL_BLOCK_N):
                m_i, l_i, acc = _decode_step(
                    q, q_kv, m_i, l_i, acc, tl.multiple_of(n0, TAIL_BLOCK_N), end, bt_row, k_cache_ptr,
                    v_cache_ptr, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h,
                    vc_stride_d, scale_log2e, d, d_mask, BLOCK_SIZE, TAIL_BLOCK_N, USE_DOT, DOT_PRECISION, True, True)
        else:
            for n0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = _decode_step(
                    q, q_kv, m_i, l_i, acc, n0, end, bt_row, k_cache_ptr, v_cache_ptr,
                    kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
                    scale_log2e, d, d_mask, BLOCK_SIZE, BLOCK_N, USE_DOT, DOT_PRECISION, True, False)
    _decode_finish(acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, seq, kv_head, split, live,
                   num_splits, out_stride_b, out_stride_h, GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_GM, BLOCK_S,
                   MERGE_SPLITS, ONE_PASS)


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


def decode_block_n(num_splits: int, cache_dtype: torch.dtype, fp8_mma: bool = False) -> int:
    """Tokens a program step by default: 32 for split launches, 64 for one-pass ones, 128 for one-pass
    launches over an fp8 cache (token-major V; run 35: 121.4 against 124.9 us at 256 rows x 600, 53.2
    against 56.2 at 64 x 1,088). The fp8 tensor-core kernel (`fp8_mma`) takes 64 in split launches: its
    tiles' tokens are the M of an sm_90 wgmma, at least 64."""
    if fp8_mma:
        return _FP8_MMA_MIN_TOKENS
    if num_splits > 1:
        return _DECODE_SPLIT_BLOCK_N
    return 2 * _DECODE_BLOCK_N if cache_dtype == FP8_KV_DTYPE else _DECODE_BLOCK_N


@functools.cache
def _has_wgmma(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def uses_fp8_mma(q_dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a decode launch runs attention_decode_fp8's kernel (products on fp8 tensor cores): bf16 q over an
    fp8 cache with token-major V and a head_dim of 64, 128 or 256 (the M of its P @ V wgmma), on a GPU of compute
    capability 9.0 or later (it was written and measured for sm_90's wgmma; an sm_89 GPU keeps the widening
    kernel) or in the CPU interpreter. A host call, once a plan."""
    if k_cache.device.type == "cuda" and not _has_wgmma(k_cache.device.index):
        return False
    return (q_dtype == torch.bfloat16 and k_cache.dtype == FP8_KV_DTYPE and is_token_major(v_cache)
            and k_cache.shape[-1] in (64, 128, 256))


def decode_workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of split scratch: partial outputs [B,Hq,splits,D] + log-sum-exp [B,Hq,splits]."""
    return batch * num_q_heads * num_splits * (head_dim + 1)


def split_partials(workspace: torch.Tensor | None, rows: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs [rows * dim], log-sum-exps [rows]) of a split decode launch, views of `workspace` (fp32, >=
    rows * (dim + 1) elements; allocated here when None): one layout for the dense and the MLA decode's merges."""
    numel = rows * (dim + 1)
    if workspace is None:
        workspace = torch.empty(numel, dtype=torch.float32, device=device)
    elif workspace.dtype != torch.float32 or workspace.numel() < numel:
        raise ValueError(f"workspace needs {numel} fp32 elements, got {workspace.numel()} {workspace.dtype}")
    return workspace[: rows * dim], workspace[rows * dim : numel]


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
    plans: dict | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Split-KV paged decode in one launch. Splits come from shapes only (batch, Hk, M*S) and
    max_num_splits; `workspace` (see alloc_decode_workspace) avoids an allocation per call;
    `counters` (see alloc_decode_counters: int32, >= B*Hk, zero-initialised, left zeroed) are
    the merge's arrival counters, by default a shared per-device buffer; `out` may be given.
    `min_split_tokens` (default 32, rounded up to block_n) is the fewest tokens a split covers.
    block_n defaults to 64 where the launch needs no split (batch x Hk fills the GPU) and to 32
    where it splits (the split count is taken at block_n 64 either way). num_warps / num_stages are
    tuning knobs (defaults: 4 warps, 8 for groups over 32; 2 stages), as are `maxnreg` (registers a thread) and
    `num_splits` (replaces the shape rule; at most max_num_splits, and a given workspace must hold it). One-pass
    launches over an fp8 cache may take 128-token tiles (`decode_block_n`). Over token-major V the loop takes full
    tiles and then the context's tail in masked tiles of `tail_block_n` tokens (default block_n / 2,
    at least 16; a power of two <= block_n). bf16 q over the engine's fp8 layouts takes the fp8 tensor-core path
    (`uses_fp8_mma`): 64-token tiles and tails, one stage, unless a tile under 64 tokens is forced. `plans` (a
    step's AttentionMetadata.launch_plans): the launch is
    planned by the first call and replayed by the next ones through the same dict with the same q and out strides
    (_triton.PlannedLaunch: they must pass tensors of the planned shapes and layouts, as one step's layers do)."""
    # keyed by what may differ between callers of one step's plans (the piecewise capture probes with the packed
    # projection's q, then attends with the static one and an out) and by the tensors the plan holds, so another
    # caller re-plans instead of replaying the wrong launch
    key = ("paged_decode", q.shape[0], q.stride(0), q.stride(1), q.dtype, k_cache.dtype, k_cache.stride(),
           v_cache.stride(), scale, id(block_tables), id(context_lens),
           None if out is None else (out.stride(0), out.stride(1)))
    launch = plans.get(key) if plans is not None else None
    if launch is None:
        require_triton()
        _check_attention_inputs(q, k_cache, v_cache)
        launch = _plan_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_num_splits=max_num_splits,
                              workspace=workspace, out=out, block_n=block_n, counters=counters,
                              min_split_tokens=min_split_tokens, num_warps=num_warps, num_stages=num_stages, pdl=pdl,
                              num_splits=num_splits, tail_block_n=tail_block_n, maxnreg=maxnreg)
        if plans is not None:
            plans[key] = launch
    return launch(q, k_cache, v_cache, out)


def _plan_decode(q, k_cache, v_cache, block_tables, context_lens, scale, *, max_num_splits, workspace, out, block_n,
                 counters, min_split_tokens, num_warps, num_stages, pdl, num_splits=None,
                 tail_block_n=None, maxnreg=None) -> PlannedLaunch:
    """One _decode_split_kernel launch, planned: the argument checks and choices made here, once."""
    batch, num_q_heads, head_dim = q.shape
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
    # the fp8 tensor-core kernel's tiles are a wgmma's M: a forced narrower tile takes the widening kernel
    fp8_mma = uses_fp8_mma(q.dtype, k_cache, v_cache) and all(
        n is None or n >= _FP8_MMA_MIN_TOKENS for n in (block_n, tail_block_n))
    if block_n is None:
        block_n = decode_block_n(num_splits, k_cache.dtype, fp8_mma)
    if tail_block_n is None:
        tail_block_n = min(block_n, _FP8_MMA_MIN_TOKENS) if fp8_mma else max(16, block_n // 2)
    elif tail_block_n < 16 or tail_block_n & (tail_block_n - 1) or tail_block_n > block_n:
        raise ValueError(f"tail_block_n must be a power of two in [16, block_n={block_n}], got {tail_block_n}")
    out_shape = (batch, num_q_heads, head_dim)
    if out is None:  # the strides a fresh output has (each call allocates its own)
        out = torch.empty(out_shape, dtype=q.dtype, device="meta")
    if batch == 0:
        return PlannedLaunch(None, None, (), (), {}, out_shape, q.dtype)

    one_pass = num_splits == 1
    if one_pass:
        part_out = part_lse = counters = block_tables  # unused placeholders (not `out`: it changes per call)
    else:
        part_out, part_lse = split_partials(workspace, batch * num_q_heads * num_splits, head_dim, q.device)
        if counters is None:
            counters = _default_decode_counters(q.device, batch * num_kv_heads)
        elif counters.dtype != torch.int32 or counters.numel() < batch * num_kv_heads:
            raise ValueError(f"counters need {batch * num_kv_heads} int32 elements, "
                             f"got {counters.numel()} {counters.dtype}")
    use_dot = group > 1
    if fp8_mma:  # heads a program: 2 * block_g columns (two terms a head) are the wgmma's N, at least 16
        block_g = max(8, next_pow2(group))
    else:
        block_g = max(16, next_pow2(group)) if use_dot else 1
    block_d = max(16, next_pow2(head_dim))
    block_gm = next_pow2(group)
    block_s = next_pow2(num_splits)
    merge_splits = max(1, min(block_s, _MERGE_TILE_ELEMS // (block_gm * block_d)))
    scale_log2e = float(scale) * LOG2E
    min_split = _DECODE_MIN_SPLIT_TOKENS if min_split_tokens is None else max(1, int(min_split_tokens))
    min_chunk = cdiv(min_split, block_n) * block_n
    return PlannedLaunch(
        _decode_split_kernel, (num_kv_heads, batch, num_splits),
        (block_tables, context_lens),
        (part_out, part_lse, counters,
         scale_log2e, num_splits, min_chunk,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
         block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
             BLOCK_SIZE=block_size, BLOCK_N=block_n, TAIL_BLOCK_N=tail_block_n,
             USE_DOT=use_dot, ONE_PASS=one_pass, DOT_PRECISION=_dot_precision(q.dtype),
             BLOCK_GM=block_gm, BLOCK_S=block_s, MERGE_SPLITS=merge_splits,
             V_TOKEN_MAJOR=is_token_major(v_cache), FP8_MMA=fp8_mma,
             num_warps=num_warps or (4 if block_g <= 32 else 8), num_stages=num_stages or (1 if fp8_mma else 2),
             **pdl_args(pdl),
             **({"maxnreg": maxnreg} if maxnreg else {})),
        out_shape, q.dtype)
