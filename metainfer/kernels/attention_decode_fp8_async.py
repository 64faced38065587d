"""Paged decode attention over an fp8 cache with the cache tiles copied asynchronously a few tiles ahead of the
products (sm_90, written in Gluon: Triton's dialect with explicit layouts, shared memory and async copies).

Contract: one-pass launches of attention_decode.paged_decode_attention_triton over the engine's fp8 layouts (bf16
q [B, Hq, D], K block-major and V token-major [N, S, Hk, D] e4m3, D in {64, 128, 256}); one program a (kv head,
sequence) over the whole context writes the normalised output; an empty context writes zeros. The numerics are
attention_decode_fp8's: the products on e4m3 tensor cores with q and the probabilities as two e4m3 terms each (hi
and lo = 16 (x - hi)), a tile's P @ V summed from zero and added to the running output in fp32. The two terms run
as two products each here (columns are heads), so no column-pair sums are needed.

Why: the Triton kernel moves each tile global -> registers -> shared memory with one tile in flight a program, and
Triton's pipeliner issues the next tile's copies after this tile's products (docs/PERFORMANCE.md, runs 141-142 and
Pending 10: 3.03 TB/s of ~4.2 on the H200, 46% of stalls on global loads). Here tile i + STAGES - 1 is issued as
cp.async (16 bytes a thread, straight into shared memory) before tile i is waited on, so STAGES - 1 tiles of each
program are in flight during the products, and the block-table ids a tile needs are loaded a tile earlier still.
"""

from __future__ import annotations

import torch

from ._triton import PlannedLaunch, next_pow2, pdl_args

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    HAS_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon (before 3.5) or no Triton
    HAS_GLUON = False

# heads a program holds as the products' N: wgmma's smallest N for 8-bit operands in Triton's lowering
_MIN_COLUMNS = 16
_TILE_TOKENS = 64  # a tile's tokens are S^T = K q^T's M: an sm_90 wgmma's smallest
_MAX_STAGES = 4


def fp8_async_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, group: int) -> bool:
    """Whether this kernel can take a one-pass fp8 tensor-core launch (attention_decode.uses_fp8_mma holds): a CUDA
    cache (not the interpreter), Gluon present, K block-major and V token-major as the engine lays them out
    (kv_cache.block_major_k_cache / token_major_v_cache: the copies assume their in-block strides), blocks of 16-64
    tokens (a V row's block is one or more 16-byte copies) and at most 64 q heads a kv head. A host call, once a
    plan."""
    _, block_size, _, head_dim = k_cache.shape
    return (HAS_GLUON and k_cache.is_cuda and k_cache.stride(1) == head_dim and k_cache.stride(3) == 1
            and v_cache.stride(1) == 1 and v_cache.stride(3) == block_size and 16 <= block_size <= _TILE_TOKENS
            and not block_size & (block_size - 1) and group <= 64)


def plan_fp8_async(q, k_cache, v_cache, block_tables, context_lens, scale_log2e: float, out, stages: int,
                   pdl: bool) -> PlannedLaunch:
    """The one-pass launch of _decode_fp8_async_kernel (attention_decode._plan_decode's choice where
    fp8_async_applies): grid (kv heads, sequences), one warpgroup a program."""
    if not 2 <= stages <= _MAX_STAGES:
        raise ValueError(f"fp8 async stages must be in [2, {_MAX_STAGES}], got {stages}")
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    return PlannedLaunch(
        _decode_fp8_async_kernel, (num_kv_heads, batch),
        (block_tables, context_lens),
        (scale_log2e, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(2), v_cache.stride(0),
         v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1)),
        dict(GROUP=group, COLUMNS=max(_MIN_COLUMNS, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
             BLOCK_N=_TILE_TOKENS, STAGES=stages, num_warps=4, **pdl_args(pdl)),
        (batch, num_q_heads, head_dim), q.dtype)


if HAS_GLUON:

    @gluon.jit
    def _pdl_enter(USE_PDL: gl.constexpr):
        """Wait for the kernel before (it writes q) and let the next one launch (see _triton.pdl_enter)."""
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _e4m3_terms(x):
        """fp32 x (|x| <= 448) as hi = e4m3(x) and lo = e4m3(16 (x - hi)): x = hi + lo / 16 (attention_decode_fp8)."""
        hi = x.to(gl.float8e4nv)
        lo = ((x - hi.to(gl.float32)) * 16.0).to(gl.float8e4nv)
        return hi, lo

    @gluon.jit
    def _tile_pages(bt_row, tile, last_page, TOKENS_LAYOUT: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                    BLOCK_N: gl.constexpr):
        """The cache block of each of tile `tile`'s tokens, clamped to the context's last block (int64)."""
        tok = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=TOKENS_LAYOUT)
        return gl.load(bt_row + gl.minimum(tok // BLOCK_SIZE, last_page)).to(gl.int64)

    @gluon.jit
    def _issue_tile(k_buf, v_buf, k_cache_ptr, v_cache_ptr, k_pages, v_pages, tile, ctx, kv_head,
                    kc_stride_b, kc_stride_h, vc_stride_b, vc_stride_h,
                    K_COPY: gl.constexpr, V_COPY: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                    BLOCK_N: gl.constexpr):
        """cp.async of tile `tile`'s K [tokens, D] and V^T [D, tokens] into k_buf / v_buf, 16 bytes a copy; tokens
        from ctx on are not read (their rows stay unread: the products mask them)."""
        tok_k = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_COPY))
        d_k = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, K_COPY))
        # block-major K: a block's tokens of one kv head are [S, D], contiguous
        k_rows = gl.multiple_of(k_pages * kc_stride_b + kv_head * kc_stride_h + (tok_k % BLOCK_SIZE) * HEAD_DIM, 16)
        async_copy.async_copy_global_to_shared(k_buf, k_cache_ptr + k_rows[:, None] + d_k[None, :],
                                               mask=(tok_k < ctx)[:, None])
        tok_v = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, V_COPY))
        d_v = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, V_COPY))
        # token-major V: a block's tokens of one kv head are [D, S], each dim's S tokens contiguous
        v_cols = gl.max_contiguous(gl.multiple_of(v_pages * vc_stride_b + kv_head * vc_stride_h
                                                  + tok_v % BLOCK_SIZE, BLOCK_SIZE), BLOCK_SIZE)
        # whole blocks are copied (a mask a token would break the 16-byte copies): the tokens of the context's last
        # block past its end are zeroed in shared memory before they are used (_zero_past_end)
        in_block = (tok_v // BLOCK_SIZE * BLOCK_SIZE < ctx)[None, :]
        async_copy.async_copy_global_to_shared(v_buf, v_cache_ptr + v_cols[None, :] + (d_v * BLOCK_SIZE)[:, None],
                                               mask=in_block)

    @gluon.jit
    def _zero_past_end(v_tile, tile, ctx, V_COPY: gl.constexpr, BLOCK_N: gl.constexpr):
        """Tokens from ctx on set to 0 in V^T's tile (a stale cache byte may be an e4m3 NaN, and NaN x 0 is NaN)."""
        tok = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, V_COPY))
        v = v_tile.load(V_COPY)
        v_tile.store(gl.where((tok < ctx)[None, :], v, gl.zeros_like(v)))

    @gluon.jit
    def _decode_fp8_async_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
        scale_log2e, q_stride_b, q_stride_h, kc_stride_b, kc_stride_h, vc_stride_b, vc_stride_h,
        bt_stride_b, out_stride_b, out_stride_h,
        GROUP: gl.constexpr, COLUMNS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr,
    ):
        """Program (kv head, sequence): its GROUP q heads (columns of the products, COLUMNS with padding) over the
        sequence's context, STAGES tiles of BLOCK_N tokens in shared memory (num_warps 4: one warpgroup)."""
        _pdl_enter(USE_PDL)
        kv_head = gl.program_id(0)
        seq = gl.program_id(1).to(gl.int64)
        ctx = gl.load(context_lens_ptr + seq)
        bt_row = block_tables_ptr + seq * bt_stride_b

        # copies: 16 bytes a thread along a K row (D contiguous) and along a V^T row (a block's tokens contiguous)
        K_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HEAD_DIM, HEAD_DIM // 16], [4, 1], [1, 0])
        V_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_N, BLOCK_N // 16], [4, 1], [1, 0])
        Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
        # the products: S^T [BLOCK_N, COLUMNS] = K q^T and O^T [D, COLUMNS] = V^T P^T, M split over the 4 warps
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, COLUMNS, 32])
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM],
                                           gl.NVMMASharedLayout(min(128, HEAD_DIM), 8))
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N],
                                           gl.NVMMASharedLayout(min(128, BLOCK_N), 8))
        # the B operands, stored [N, K] (K contiguous: wgmma takes 8-bit operands K-major only) and read transposed
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(min(128, HEAD_DIM), 8)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout(min(128, BLOCK_N), 8)
        q_hi_smem = gl.allocate_shared_memory(gl.float8e4nv, [COLUMNS, HEAD_DIM], Q_SMEM)
        q_lo_smem = gl.allocate_shared_memory(gl.float8e4nv, [COLUMNS, HEAD_DIM], Q_SMEM)
        p_hi_smem = gl.allocate_shared_memory(gl.float8e4nv, [COLUMNS, BLOCK_N], P_SMEM)
        p_lo_smem = gl.allocate_shared_memory(gl.float8e4nv, [COLUMNS, BLOCK_N], P_SMEM)

        num_tiles = gl.cdiv(ctx, BLOCK_N)
        last_page = gl.maximum(ctx - 1, 0) // BLOCK_SIZE
        k_pages = _tile_pages(bt_row, 0, last_page, gl.SliceLayout(1, K_COPY), BLOCK_SIZE, BLOCK_N)
        v_pages = _tile_pages(bt_row, 0, last_page, gl.SliceLayout(0, V_COPY), BLOCK_SIZE, BLOCK_N)
        for t in gl.static_range(STAGES - 1):
            _issue_tile(k_smem.index(t), v_smem.index(t), k_cache_ptr, v_cache_ptr, k_pages, v_pages, t, ctx, kv_head,
                        kc_stride_b, kc_stride_h, vc_stride_b, vc_stride_h, K_COPY, V_COPY, HEAD_DIM, BLOCK_SIZE,
                        BLOCK_N)
            async_copy.commit_group()
            k_pages = _tile_pages(bt_row, t + 1, last_page, gl.SliceLayout(1, K_COPY), BLOCK_SIZE, BLOCK_N)
            v_pages = _tile_pages(bt_row, t + 1, last_page, gl.SliceLayout(0, V_COPY), BLOCK_SIZE, BLOCK_N)

        # q^T's two terms, each head scaled by a power of two that puts its largest |q| in (224, 448]
        c_q = gl.arange(0, COLUMNS, layout=gl.SliceLayout(1, Q_LOAD))
        d_q = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_LOAD))
        q = gl.load(q_ptr + seq * q_stride_b + (kv_head * GROUP + c_q)[:, None] * q_stride_h + d_q[None, :],
                    mask=(c_q < GROUP)[:, None], other=0.0).to(gl.float32)
        q_max = gl.max(gl.abs(q), axis=1)
        q_scale = gl.exp2(gl.minimum(gl.floor(gl.log2(448.0 / gl.where(q_max > 0, q_max, 448.0))), 126.0))
        q_hi, q_lo = _e4m3_terms(q * q_scale[:, None])
        q_hi_smem.store(q_hi)
        q_lo_smem.store(q_lo)
        q_weight = gl.convert_layout(scale_log2e / q_scale, COLS)  # scores in log2 units

        zero_s = gl.zeros([BLOCK_N, COLUMNS], gl.float32, MMA)
        zero_o = gl.zeros([HEAD_DIM, COLUMNS], gl.float32, MMA)
        m_i = gl.full([COLUMNS], float("-inf"), gl.float32, COLS)
        l_parts = gl.zeros([BLOCK_N, COLUMNS], gl.float32, MMA)  # per-token partial sums, reduced once at the end
        acc = gl.zeros([HEAD_DIM, COLUMNS], gl.float32, MMA)  # O^T, in units of 256 (the probabilities' scale)
        for i in range(num_tiles):
            # the copies of tile i + STAGES - 1 go out before tile i is waited on (its buffer was read at i - 1)
            j = i + STAGES - 1
            _issue_tile(k_smem.index(j % STAGES), v_smem.index(j % STAGES), k_cache_ptr, v_cache_ptr, k_pages,
                        v_pages, j, ctx, kv_head, kc_stride_b, kc_stride_h, vc_stride_b, vc_stride_h, K_COPY, V_COPY,
                        HEAD_DIM, BLOCK_SIZE, BLOCK_N)
            async_copy.commit_group()
            k_pages = _tile_pages(bt_row, j + 1, last_page, gl.SliceLayout(1, K_COPY), BLOCK_SIZE, BLOCK_N)
            v_pages = _tile_pages(bt_row, j + 1, last_page, gl.SliceLayout(0, V_COPY), BLOCK_SIZE, BLOCK_N)
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()  # every thread's copies of tile i have landed
            if (i + 1) * BLOCK_N > ctx:  # the last tile, partly past the context
                _zero_past_end(v_smem.index(i % STAGES), i, ctx, V_COPY, BLOCK_N)
                gl.thread_barrier()
            fence_async_shared()  # ... and are visible to the tensor cores (the q terms too, on the first pass)
            k_tile = k_smem.index(i % STAGES)
            s_hi = warpgroup_mma(k_tile, q_hi_smem.permute((1, 0)), zero_s, use_acc=False)
            s_lo = warpgroup_mma(k_tile, q_lo_smem.permute((1, 0)), zero_s, use_acc=False)
            s = (s_hi + s_lo * 0.0625) * q_weight[None, :]
            tok = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
            s = gl.where((tok < ctx)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l_parts = l_parts * alpha[None, :] + p
            p_hi, p_lo = _e4m3_terms(p * 256.0)
            p_hi_smem.store(gl.permute(p_hi, (1, 0)))
            p_lo_smem.store(gl.permute(p_lo, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            v_tile = v_smem.index(i % STAGES)
            o_hi = warpgroup_mma(v_tile, p_hi_smem.permute((1, 0)), zero_o, use_acc=False)
            o_lo = warpgroup_mma(v_tile, p_lo_smem.permute((1, 0)), zero_o, use_acc=False)
            acc = acc * alpha[None, :] + (o_hi + o_lo * 0.0625)
            m_i = m_new
            gl.thread_barrier()  # tile i's buffers are free for the copies the next pass issues
        async_copy.wait_group(0)

        l_i = gl.sum(l_parts, axis=0)
        out = acc * (1.0 / 256.0) / gl.where(l_i > 0, l_i, 1.0)[None, :]
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, MMA))
        c_o = gl.arange(0, COLUMNS, layout=COLS)
        gl.store(out_ptr + seq * out_stride_b + (kv_head * GROUP + c_o)[None, :] * out_stride_h + d_o[:, None],
                 out.to(gl.bfloat16), mask=(c_o < GROUP)[None, :])
