"""Triton kernels of DeepSeek-V2's multi-head latent attention (MLA) over the paged latent cache.

Why separate kernels from the dense ones: in the absorbed form every head attends to the same cached
vector per token ([c, k_pe], L + R values; the values are c itself), so a program takes all heads (or a
block of them) of a sequence and runs them as the M dimension of tl.dot, reading each cache tile once for
all heads. A program per (sequence, head) would read the cache H times.

Contracts (the torch references: mla_ref.py; docs/CONTRACTS.md, "MLA"):
- `mla_decode_attention_triton(q_lat[B,H,L], q_pe[B,H,R], cache, block_tables, context_lens, scale)`:
  split-KV decode in one launch: (sequence, split, head block) programs with an online softmax over the
  split's tokens; the last live split of a (sequence, head block) to finish merges the partials (an int32
  arrival counter, as the dense decode does). The split count comes from host-known values only
  (batch, heads, the block table's width), so the launch can be captured in a CUDA graph with a
  workspace sized once by `mla_decode_workspace_numel`.
- `mla_prefill_attention_triton(q_lat[T,H,L], q_pe[T,H,R], cache, cu_seqlens_q, context_lens,
  block_tables, max_seqlen_q, scale)`: causal, the q_len new tokens of sequence b are the last of its
  context_lens[b] cached ones (prefill, prefix hit and chunked prefill alike). A program holds BLOCK_M
  query tokens x BLOCK_H heads as the rows of its tiles (about 64 rows: the [rows, L] fp32 accumulator is
  the register budget at L = 512).
q_lat / q_pe may be strided views (any strides; Triton specialises a unit stride). Math in fp32; an fp8
cache is widened exactly as it is loaded: in the decode to fp16 for bf16 queries (whose products then run in fp16,
as the dense decode's: attention_decode._in_kv_dtype), else to q's dtype; outputs in q_lat's dtype.
"""

from __future__ import annotations

import torch

from ._triton import PlannedLaunch, cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .attention_decode import LOG2E, _default_decode_counters, _dot_precision, _in_kv_dtype, split_partials
from .kv_cache import FP8_KV_DTYPE

# Decode split rule (H200: 132 SMs). The decode grid aims at ~2 programs per SM; a split covers at least
# _MLA_MIN_SPLIT_TOKENS tokens (its fp32 partial [H, L] costs as much traffic as ~30 cached tokens of
# bf16 latent, so much shorter splits would spend more on partials than on the cache) and at most
# _MLA_MAX_SPLITS splits (the in-kernel merge's BLOCK_S). A short context (more than one minimum split, at
# most _MLA_SHORT_MAX_SPLITS short splits) is cut into _MLA_SHORT_SPLIT_TOKENS-token splits instead: at batch
# 1 and 8 a context of 100-256 tokens then runs 4-8 splits in parallel rather than 2-4 in series (run 72's
# sweep, an H100: 11.7 -> 10.6 us a layer at 100 tokens, 12.2 -> 10.9 at 160; one pass stays best up to 64
# tokens and 8 splits of 64 beat 16 of 32 at 512, where the last split's merge of 16 partials is the tail).
_MLA_TARGET_PROGRAMS = 264
_MLA_MIN_SPLIT_TOKENS = 64
_MLA_SHORT_SPLIT_TOKENS = 32
_MLA_SHORT_MAX_SPLITS = 8
_MLA_MAX_SPLITS = 64
_MLA_DECODE_BLOCK_N = 32
# Decode pipeline depth: two cache tiles in flight a program (their blocks read a step ahead). Run 113 (H100, CUDA
# graphs): 256 rows x 600 tokens 69.8 against 78.7 us with one tile in flight, 16 x 1,500 27.4 against 35.7, 1 x
# 1,000 17.7 against 19.3; DeepSeek-V2-Lite throughput 8,403 / 8,416 against 8,223 / 8,224 tok/s (runs 113-114)
_MLA_DECODE_STAGES = 3


def _check_cache(cache: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, L, R) of a latent cache that matches the queries."""
    if cache.dim() != 3:
        raise ValueError(f"the latent cache must be [N, S, L+R], got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError("the latent cache must have a unit last stride")
    lat, rope = q_lat.shape[-1], q_pe.shape[-1]
    if cache.shape[2] != lat + rope:
        raise ValueError(f"cache width {cache.shape[2]} != L {lat} + R {rope}")
    if q_lat.shape[:-1] != q_pe.shape[:-1]:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} and q_pe {tuple(q_pe.shape)} differ in tokens/heads")
    if q_lat.dtype != q_pe.dtype or cache.dtype not in (q_lat.dtype, FP8_KV_DTYPE):
        raise ValueError(f"q {q_lat.dtype}/{q_pe.dtype} and cache {cache.dtype}: the cache holds q's dtype or fp8")
    if rope < 16 or lat < 16:
        raise ValueError(f"L={lat} and R={rope} must be >= 16 (tl.dot's K)")
    return cache.shape[1], lat, rope


# ----------------------------------------------------------------------------------------------
# shared tile step: scores of a row block against BLOCK_N cached tokens, online softmax, P @ c
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_pages(bt_row, tok, t_mask, BLOCK_SIZE: tl.constexpr):
    """The cache block of each token of a tile (tokens outside t_mask read block 0)."""
    return tl.load(bt_row + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)


@triton.jit
def _mla_tile(
    q_lat, q_pe, m_i, l_i, acc, tok, t_mask, visible, page, cache_ptr, c_stride_b, c_stride_s,
    scale_log2e, offs_l, offs_r,
    KV_LORA: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    c_raw=None,
):
    """(m_i, l_i, acc) after the tokens `tok` ([BLOCK_N]) on cache blocks `page`: t_mask says which tokens exist
    (loads), `visible` ([rows, BLOCK_N], used when MASKED) which scores count. The latent tile is loaded once (or
    given as `c_raw`, loaded a step ahead) and serves both q_lat @ c^T and P @ c; k_pe is a second, narrow tile."""
    rows = page * c_stride_b + (tok % BLOCK_SIZE).to(tl.int64) * c_stride_s
    if c_raw is None:
        c = tl.load(cache_ptr + rows[:, None] + offs_l[None, :], mask=t_mask[:, None], other=0.0).to(q_lat.dtype)
    else:
        c = c_raw.to(q_lat.dtype)
    kpe = tl.load(cache_ptr + rows[:, None] + KV_LORA + offs_r[None, :], mask=t_mask[:, None],
                  other=0.0).to(q_lat.dtype)
    s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(kpe), s, input_precision=DOT_PRECISION)
    s = s * scale_log2e
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # rows with nothing visible yet keep m = -inf: exp2(-inf - -inf) would be NaN, so their alpha is 1
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ----------------------------------------------------------------------------------------------
# decode: (sequence, split, head block) programs; the last live split merges
# ----------------------------------------------------------------------------------------------


def mla_split_chunk(ctx: int, num_splits: int, min_chunk: int, short_chunk: int, block_n: int) -> int:
    """Tokens a split covers (the kernel's _split_range, on the host for tools and tests): the context cut
    into num_splits chunks of a block_n multiple, at least min_chunk, or at least short_chunk for a context
    of more than min_chunk and at most short_chunk * _MLA_SHORT_MAX_SPLITS tokens."""
    short = min_chunk < ctx <= short_chunk * _MLA_SHORT_MAX_SPLITS
    return max(cdiv(cdiv(ctx, num_splits), block_n) * block_n, short_chunk if short else min_chunk)


@triton.jit
def _split_range(ctx, split, num_splits, min_chunk, short_chunk, BLOCK_N: tl.constexpr,
                 SHORT_MAX_SPLITS: tl.constexpr):
    """(start, end, live) of a split: mla_split_chunk's chunks; splits 0 .. live-1 are non-empty (live is 0
    for an empty context)."""
    short = (ctx > min_chunk) & (ctx <= short_chunk * SHORT_MAX_SPLITS)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, tl.where(short, short_chunk, min_chunk))
    live = tl.cdiv(ctx, chunk)
    start = split * chunk
    return start, tl.minimum(start + chunk, ctx), live


@triton.jit(do_not_specialize=["bt_stride_b"])
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counters_ptr, scale_log2e, num_splits, min_chunk, short_chunk, num_heads,
    ql_stride_b, ql_stride_h, ql_stride_l, qp_stride_b, qp_stride_h, qp_stride_r,
    c_stride_b, c_stride_s, bt_stride_b, out_stride_b, out_stride_h,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ONE_PASS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, SHORT_MAX_SPLITS: tl.constexpr,
):
    """One program = (sequence, split, block of BLOCK_H heads) over the split's tokens. A context that
    fits one split (or ONE_PASS) is written to out by split 0 (zeros for an empty context); otherwise
    each live split writes its normalised partial [heads, L] and log2-sum-exp, takes an arrival ticket
    on its (sequence, head block) counter, and the last live split merges them all and resets the
    counter: one launch, no merge kernel (the memory-ordering argument is attention_decode.py's)."""
    pdl_enter(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    h_block = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start, end, live = _split_range(ctx, split, num_splits, min_chunk, short_chunk, BLOCK_N, SHORT_MAX_SPLITS)
    if split >= tl.maximum(live, 1):
        return

    h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < num_heads
    offs_l = tl.arange(0, KV_LORA)
    offs_r = tl.arange(0, ROPE)
    q_lat = tl.load(q_lat_ptr + seq * ql_stride_b + h[:, None] * ql_stride_h + offs_l[None, :] * ql_stride_l,
                    mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * qp_stride_b + h[:, None] * qp_stride_h + offs_r[None, :] * qp_stride_r,
                   mask=h_mask[:, None], other=0.0)
    # the products' dtype: fp16 over an fp8 cache for bf16 queries (one widening instruction per two cached values,
    # against bf16's through fp32; sm_90: 778 against 1,090 instructions a 32-token tile; run 117, an H100: 113.6
    # against 153.8 us at 256 rows x 600 tokens). Not in the prefill kernel:
    # there it spills registers (tests/kernels/test_mla_attention.py's sm_90 compile)
    q_lat, q_pe = _in_kv_dtype(q_lat, cache_ptr, q_lat), _in_kv_dtype(q_pe, cache_ptr, q_pe)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, KV_LORA], tl.float32)
    bt_row = block_tables_ptr + seq * bt_stride_b
    # The next tile's blocks are read one step ahead and carried in the loop: the cache loads then hang off no load
    # of the same step, so Triton's pipeliner gives them num_stages - 1 buffers (with the block read in the step it
    # kept one whatever num_stages was: docs/PERFORMANCE.md, run 113). Past `end` the last block is re-read; an empty
    # range reads nothing.
    last_block = tl.maximum(end - 1, 0) // BLOCK_SIZE
    page = tl.load(bt_row + tl.minimum((start + tl.arange(0, BLOCK_N)) // BLOCK_SIZE, last_block), mask=start < end,
                   other=0).to(tl.int64)
    # An fp8 latent tile, which Triton does not pipeline (its two products read it transposed and not, and 8-bit
    # tiles have no transposed shared-memory load), is loaded into registers a step ahead in one-pass launches (run
    # 119, an H100: 107.3 against 117.6 us at 256 rows x 600 tokens; split launches 1-2% slower with it: not there).
    REG_PREFETCH: tl.constexpr = (cache_ptr.dtype.element_ty == tl.float8e4nv) & ONE_PASS
    if REG_PREFETCH:
        tok0 = start + tl.arange(0, BLOCK_N)
        rows0 = page * c_stride_b + (tok0 % BLOCK_SIZE).to(tl.int64) * c_stride_s
        c_next = tl.load(cache_ptr + rows0[:, None] + offs_l[None, :], mask=(tok0 < end)[:, None], other=0.0)
    else:
        c_next = None
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        page_next = tl.load(bt_row + tl.minimum((tok + BLOCK_N) // BLOCK_SIZE, last_block)).to(tl.int64)
        if REG_PREFETCH:
            c_cur = c_next
            tok_n = tok + BLOCK_N
            rows_n = page_next * c_stride_b + (tok_n % BLOCK_SIZE).to(tl.int64) * c_stride_s
            c_next = tl.load(cache_ptr + rows_n[:, None] + offs_l[None, :], mask=(tok_n < end)[:, None], other=0.0)
            m_i, l_i, acc = _mla_tile(q_lat, q_pe, m_i, l_i, acc, tok, t_mask, t_mask[None, :], page, cache_ptr,
                                      c_stride_b, c_stride_s, scale_log2e, offs_l, offs_r,
                                      KV_LORA, BLOCK_SIZE, True, DOT_PRECISION, c_cur)
        else:
            m_i, l_i, acc = _mla_tile(q_lat, q_pe, m_i, l_i, acc, tok, t_mask, t_mask[None, :], page, cache_ptr,
                                      c_stride_b, c_stride_s, scale_log2e, offs_l, offs_r,
                                      KV_LORA, BLOCK_SIZE, True, DOT_PRECISION)
        page = page_next
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if ONE_PASS or live <= 1:
        tl.store(out_ptr + seq * out_stride_b + h[:, None] * out_stride_h + offs_l[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        base = (seq * num_heads + h) * num_splits  # workspace row of split 0, per head
        tl.store(part_out_ptr + (base + split)[:, None] * KV_LORA + offs_l[None, :], out, mask=h_mask[:, None])
        tl.store(part_lse_ptr + base + split, m_i + tl.log2(l_i), mask=h_mask)
        tl.debug_barrier()  # every thread's partial stores precede the counting thread's release
        counter = counters_ptr + seq * tl.num_programs(2) + h_block
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == live - 1:  # the last live split of this (sequence, head block)
            tl.debug_barrier()  # the acquire above precedes every thread's partial loads
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            s = tl.arange(0, BLOCK_S)
            lse = tl.load(part_lse_ptr + base[:, None] + s[None, :], mask=h_mask[:, None] & (s < live)[None, :],
                          other=float("-inf"), cache_modifier=".cg")
            lse_max = tl.where(h_mask, tl.max(lse, axis=1), 0.0)  # finite on real heads (live >= 2)
            total = tl.sum(tl.exp2(lse - lse_max[:, None]), axis=1)
            merged = tl.zeros([BLOCK_H, KV_LORA], tl.float32)
            for i in range(0, live):
                w_i = tl.exp2(tl.load(part_lse_ptr + base + i, mask=h_mask, other=float("-inf"),
                                      cache_modifier=".cg") - lse_max)
                merged += w_i[:, None] * tl.load(part_out_ptr + (base + i)[:, None] * KV_LORA + offs_l[None, :],
                                                 mask=h_mask[:, None], other=0.0, cache_modifier=".cg")
            merged = merged / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + seq * out_stride_b + h[:, None] * out_stride_h + offs_l[None, :],
                     merged.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


def mla_decode_num_splits(batch: int, num_heads: int, max_context_tokens: int,
                          block_n: int = _MLA_DECODE_BLOCK_N) -> int:
    """Splits of a default decode launch, from host values only (never context_lens' contents):
    enough (sequence, split, head block) programs for ~2 per SM of an H200, each split at least
    _MLA_MIN_SPLIT_TOKENS tokens, at most _MLA_MAX_SPLITS. 1 means one pass (no workspace)."""
    head_blocks = cdiv(num_heads, _decode_block_h(num_heads))
    min_tokens = cdiv(_MLA_MIN_SPLIT_TOKENS, block_n) * block_n
    by_context = max(1, cdiv(max(int(max_context_tokens), 1), min_tokens))
    by_grid = max(1, _MLA_TARGET_PROGRAMS // max(1, batch * head_blocks))
    return min(by_context, by_grid, _MLA_MAX_SPLITS)


def _decode_block_h(num_heads: int) -> int:
    """Heads a decode program takes: all of them up to 32 (tl.dot's M is padded to >= 16)."""
    return min(32, max(16, next_pow2(num_heads)))


def _decode_num_warps(block_h: int, cache_dtype: torch.dtype) -> int:
    """sm_90 AOT at L = 512, R = 64, 16 heads, 32-token tiles, 3 stages (registers a thread): a 16-bit cache holds
    128 one-pass and 200 split at 4 warps (93 KB of shared memory: two programs an SM); an fp8 cache (widened in
    registers, products in fp16) reaches 255 at 4 warps and holds 190 at 8. Head blocks of 32 double the
    accumulator: 8 warps. The warp counts are not timed."""
    return 4 if block_h <= 16 and cache_dtype != FP8_KV_DTYPE else 8


def _decode_workspace_numel(batch: int, num_heads: int, kv_lora_rank: int, num_splits: int) -> int:
    return 0 if num_splits <= 1 else batch * num_heads * num_splits * (kv_lora_rank + 1)


def mla_decode_workspace_numel(max_batch: int, num_heads: int, kv_lora_rank: int, max_context_tokens: int) -> int:
    """fp32 elements of the one workspace that serves every default decode launch of batch <= max_batch
    over block tables of <= max_context_tokens tokens: max over b of b * H * splits(b) * (L + 1), where
    splits(b) = mla_decode_num_splits(b, H, max_context_tokens) (0 where no launch splits)."""
    return max((_decode_workspace_numel(b, num_heads, kv_lora_rank,
                                        mla_decode_num_splits(b, num_heads, max_context_tokens))
                for b in range(1, max_batch + 1)), default=0)


def mla_decode_attention_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split_tokens: int | None = None,
    short_split_tokens: int | None = None,
    counters: torch.Tensor | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """Split-KV MLA decode -> o [B, H, L], one launch. num_splits defaults to mla_decode_num_splits(B, H,
    table width in tokens); a split launch needs `workspace` (fp32, >= B*H*splits*(L+1):
    mla_decode_workspace_numel sizes one for the engine; allocated here when None) and arrival `counters`
    (int32, >= B * head blocks, zero-initialised and left zeroed; by default the per-device buffer the
    dense decode shares: attention_decode.alloc_decode_counters). No GPU value is read on the host.
    block_n / num_warps / num_stages / min_split_tokens (the fewest tokens a split covers, rounded up to
    block_n) / short_split_tokens (the same for a short context, at most min_split_tokens) are tuning knobs
    (defaults 32 / 4 (8 over an fp8 cache or for 32-head blocks) / 3 (_MLA_DECODE_STAGES) / 64 / 32). `plans` (a step's
    AttentionMetadata.launch_plans): planned by the first layer's call, replayed by the others (_triton.PlannedLaunch,
    as the dense launchers)."""
    key = ("mla_decode", q_lat.shape, q_lat.stride(), q_pe.stride(), q_lat.dtype, cache.dtype, cache.stride(),
           float(scale), id(block_tables),
           id(context_lens), id(workspace), id(counters), None if out is None else out.stride(), num_splits, pdl,
           block_n, num_warps, num_stages, min_split_tokens, short_split_tokens)
    launch = plans.get(key) if plans is not None else None
    if launch is None:
        launch = _plan_mla_decode(q_lat, q_pe, cache, block_tables, context_lens, scale, workspace=workspace,
                                  num_splits=num_splits, pdl=pdl, out=out, block_n=block_n, num_warps=num_warps,
                                  num_stages=num_stages, min_split_tokens=min_split_tokens,
                                  short_split_tokens=short_split_tokens, counters=counters)
        if plans is not None:
            plans[key] = launch
    return launch(q_lat, q_pe, cache, out)


def _plan_mla_decode(q_lat, q_pe, cache, block_tables, context_lens, scale, *, workspace, num_splits, pdl, out,
                     block_n, num_warps, num_stages, min_split_tokens, short_split_tokens, counters) -> PlannedLaunch:
    """One _mla_decode_kernel launch, planned: the checks, the split rule and the arguments, once."""
    require_triton()
    batch, num_heads, kv_lora = q_lat.shape
    block_size, _, rope = _check_cache(cache, q_lat, q_pe)
    block_n = block_n or _MLA_DECODE_BLOCK_N
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if kv_lora & (kv_lora - 1) or rope & (rope - 1):
        raise ValueError(f"L={kv_lora} and R={rope} must be powers of two")
    if num_splits is None:
        num_splits = mla_decode_num_splits(batch, num_heads, block_tables.shape[1] * block_size, block_n)
    elif not 1 <= num_splits <= _MLA_MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MLA_MAX_SPLITS}], got {num_splits}")
    out_shape = (batch, num_heads, kv_lora)
    if out is None:  # the strides a fresh output has (each call allocates its own)
        out = torch.empty(out_shape, dtype=q_lat.dtype, device="meta")
    if batch == 0:
        return PlannedLaunch(None, None, (), (), {}, out_shape, q_lat.dtype)
    one_pass = num_splits == 1
    block_h = _decode_block_h(num_heads)
    head_blocks = cdiv(num_heads, block_h)
    if one_pass:
        part_out = part_lse = counters = block_tables  # unused placeholders (not `out`: it changes per call)
    else:
        if counters is None:
            counters = _default_decode_counters(q_lat.device, batch * head_blocks)
        elif counters.dtype != torch.int32 or counters.numel() < batch * head_blocks:
            raise ValueError(f"counters need {batch * head_blocks} int32 elements, got {counters.numel()} "
                             f"{counters.dtype}")
        part_out, part_lse = split_partials(workspace, batch * num_heads * num_splits, kv_lora, q_lat.device)
    min_split = _MLA_MIN_SPLIT_TOKENS if min_split_tokens is None else max(1, int(min_split_tokens))
    short_split = _MLA_SHORT_SPLIT_TOKENS if short_split_tokens is None else max(1, int(short_split_tokens))
    min_chunk = cdiv(min_split, block_n) * block_n
    short_chunk = cdiv(min(short_split, min_split), block_n) * block_n
    return PlannedLaunch(
        _mla_decode_kernel, (batch, num_splits, head_blocks), (block_tables, context_lens),
        (part_out, part_lse, counters, float(scale) * LOG2E, num_splits, min_chunk, short_chunk, num_heads,
         q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
         cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(KV_LORA=kv_lora, ROPE=rope, BLOCK_H=block_h, BLOCK_SIZE=block_size, BLOCK_N=block_n,
             BLOCK_S=next_pow2(num_splits), ONE_PASS=one_pass, SHORT_MAX_SPLITS=_MLA_SHORT_MAX_SPLITS,
             DOT_PRECISION=_dot_precision(q_lat.dtype), num_warps=num_warps or _decode_num_warps(block_h, cache.dtype),
             num_stages=num_stages or _MLA_DECODE_STAGES, **pdl_args(pdl)),
        out_shape, q_lat.dtype)


# ----------------------------------------------------------------------------------------------
# prefill / extend
# ----------------------------------------------------------------------------------------------


# the block-table width changes per batch; the per-sequence pointers of a mixed step's prefill part start
# at its first prefill row (any alignment): one variant for both
@triton.jit(do_not_specialize=["bt_stride_b"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr"])
def _mla_prefill_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    scale_log2e, num_heads,
    ql_stride_t, ql_stride_h, ql_stride_l, qp_stride_t, qp_stride_h, qp_stride_r,
    c_stride_b, c_stride_s, bt_stride_b, out_stride_t, out_stride_h,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program = (BLOCK_M query tokens of a sequence, BLOCK_H heads): BLOCK_M * BLOCK_H rows, row r
    is token r // BLOCK_H, head r % BLOCK_H. Keys before the tile's first query are visible to every row
    (no mask); the tiles from there to the last query's position are masked causally."""
    pdl_enter(USE_PDL)
    m_block = tl.program_id(0)
    h_block = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M * BLOCK_H)
    m = m0 + r // BLOCK_H
    h = h_block * BLOCK_H + r % BLOCK_H
    r_mask = (m < q_len) & (h < num_heads)
    q_pos = ctx - q_len + m
    token = (q_start + m).to(tl.int64)
    offs_l = tl.arange(0, KV_LORA)
    offs_r = tl.arange(0, ROPE)
    q_lat = tl.load(q_lat_ptr + token[:, None] * ql_stride_t + h[:, None] * ql_stride_h
                    + offs_l[None, :] * ql_stride_l, mask=r_mask[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + token[:, None] * qp_stride_t + h[:, None] * qp_stride_h
                   + offs_r[None, :] * qp_stride_r, mask=r_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, KV_LORA], tl.float32)
    bt_row = block_tables_ptr + seq * bt_stride_b
    first_pos = ctx - q_len + m0
    diag_start = first_pos // BLOCK_N * BLOCK_N
    hi = tl.minimum(ctx, first_pos + BLOCK_M)
    for n0 in range(0, diag_start, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < ctx  # always true here; keeps the loads' masks uniform
        m_i, l_i, acc = _mla_tile(q_lat, q_pe, m_i, l_i, acc, tok, t_mask, t_mask[None, :],
                                  _tile_pages(bt_row, tok, t_mask, BLOCK_SIZE), cache_ptr,
                                  c_stride_b, c_stride_s, scale_log2e, offs_l, offs_r,
                                  KV_LORA, BLOCK_SIZE, False, DOT_PRECISION)
    for n0 in range(diag_start, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < ctx
        visible = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :]
        m_i, l_i, acc = _mla_tile(q_lat, q_pe, m_i, l_i, acc, tok, t_mask, visible,
                                  _tile_pages(bt_row, tok, t_mask, BLOCK_SIZE), cache_ptr,
                                  c_stride_b, c_stride_s, scale_log2e, offs_l, offs_r,
                                  KV_LORA, BLOCK_SIZE, True, DOT_PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * out_stride_t + h[:, None] * out_stride_h + offs_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])


# BLOCK_M * BLOCK_H rows a prefill program. sm_90 AOT at L = 512, R = 64, 32-token tiles, 2 stages (registers
# a thread, cuobjdump): 64 rows at 8 warps spill (255 + 136 B stack bf16, + 784 B fp8); 32 rows at 8 warps
# hold 186 (bf16) / 255 (fp8) without spilling; 32 rows at 4 warps spill over fp8. Not timed yet.
_PREFILL_ROWS = 32


def mla_prefill_attention_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """Causal absorbed MLA over the paged latent cache -> o [T, H, L]. `max_seqlen_q` is a host int
    (>= every q_len) that sizes the grid. Tiles: block_h heads (default min(H, 16) rounded to a power of
    two) x block_m tokens (default 32 // block_h), block_n cached tokens a step (default 32); 8 warps, 2 stages.
    `plans`: as the decode's."""
    key = ("mla_prefill", q_lat.shape, q_lat.stride(), q_pe.stride(), q_lat.dtype, cache.dtype, cache.stride(),
           float(scale), int(max_seqlen_q), id(cu_seqlens_q), id(context_lens), id(block_tables),
           None if out is None else out.stride(), pdl, block_m, block_h, block_n, num_warps, num_stages)
    launch = plans.get(key) if plans is not None else None
    if launch is None:
        launch = _plan_mla_prefill(q_lat, q_pe, cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale,
                                   pdl=pdl, out=out, block_m=block_m, block_h=block_h, block_n=block_n,
                                   num_warps=num_warps, num_stages=num_stages)
        if plans is not None:
            plans[key] = launch
    return launch(q_lat, q_pe, cache, out)


def _plan_mla_prefill(q_lat, q_pe, cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, *, pdl, out,
                      block_m, block_h, block_n, num_warps, num_stages) -> PlannedLaunch:
    """One _mla_prefill_kernel launch, planned."""
    require_triton()
    num_tokens, num_heads, kv_lora = q_lat.shape
    block_size, _, rope = _check_cache(cache, q_lat, q_pe)
    if kv_lora & (kv_lora - 1) or rope & (rope - 1):
        raise ValueError(f"L={kv_lora} and R={rope} must be powers of two")
    out_shape = (num_tokens, num_heads, kv_lora)
    if out is None:  # the strides a fresh output has (each call allocates its own)
        out = torch.empty(out_shape, dtype=q_lat.dtype, device="meta")
    batch = context_lens.shape[0]
    max_seqlen_q = int(max_seqlen_q)
    if num_tokens == 0 or batch == 0 or max_seqlen_q <= 0:
        return PlannedLaunch(None, None, (), (), {}, out_shape, q_lat.dtype)
    block_h = block_h or min(16, next_pow2(num_heads))
    block_m = block_m or max(1, _PREFILL_ROWS // block_h)
    block_n = block_n or 32
    for name, value in (("block_h", block_h), ("block_m", block_m), ("block_n", block_n)):
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_m * block_h < 16 or block_n < 16:
        raise ValueError(f"block_m * block_h and block_n must be >= 16 (tl.dot), got {block_m * block_h}, {block_n}")
    return PlannedLaunch(
        _mla_prefill_kernel, (cdiv(max_seqlen_q, block_m), cdiv(num_heads, block_h), batch),
        (block_tables, cu_seqlens_q, context_lens),
        (float(scale) * LOG2E, num_heads,
         q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
         cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(KV_LORA=kv_lora, ROPE=rope, BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_N=block_n,
             DOT_PRECISION=_dot_precision(q_lat.dtype), num_warps=num_warps or 8, num_stages=num_stages or 2,
             **pdl_args(pdl)),
        out_shape, q_lat.dtype)


__all__ = [
    "mla_decode_attention_triton",
    "mla_decode_num_splits",
    "mla_decode_workspace_numel",
    "mla_prefill_attention_triton",
]
