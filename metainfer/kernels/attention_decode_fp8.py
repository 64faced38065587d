"""Paged decode attention over an fp8 cache on fp8 tensor cores, for bf16 queries.

Contract: attention_decode.paged_decode_attention_triton's (that launcher plans this kernel for bf16 q over an fp8
cache in the engine's layouts: K block-major, V token-major); the result is the same up to the rounding below.

Why: the kernel that widens each cached e4m3 value to fp16 before its products is bound by those widening
instructions, not by bytes (docs/PERFORMANCE.md, run 106: ~30% of its instructions, DRAM at 68% of peak). Here no
cached value is widened: both products run as e4m3 x e4m3 -> fp32 tensor-core MMAs (sm_90 wgmma, which takes
8-bit operands only with M >= 64 and K-major operands, so the products are transposed: S^T = K q^T with the tile's
tokens as M, and O^T = V^T P^T with head_dim as M; token-major V is V^T K-major).

Exactness: each query row is scaled by a power of two so its largest |value| lies in (224, 448], then split into
two e4m3 terms hi = e4m3(x) and lo = e4m3(16 (x - hi)); a bf16 value's 8 significant bits are 4 + 4, so the pair
holds it exactly down to 2^-6 after scaling (~2^-14 of the row's largest); below that its error is at most 2^-14 in
scaled units (~2^-22 of the row's largest). The probabilities (at most 1, scaled by 256) are split the same way:
~8 significant bits (the bf16 cache path's precision for them) down to p = 2^-14 and an absolute error of at most
2^-22 below that, so the many small probabilities of a long context with a dominant token still add up. The two
terms sit in adjacent columns of the products' N dimension (column 2h + t: head h, term t), weighted 1 and 1/16, so
summing them is a per-thread add of neighbouring accumulator columns; wgmma's smallest N for 8-bit operands is 16,
so up to 8 query heads share a kv head at no extra cost. Each tile's P @ V starts from zero and is added to the
running output in fp32 (the fp8 MMA's own accumulation keeps ~14 bits).
"""

from __future__ import annotations

from ._triton import tl, triton


@triton.jit
def _e4m3_terms(x, term):
    """fp32 x (|x| <= 448) as its e4m3 term `term` (0 or 1, broadcast against x): hi = e4m3(x) and
    lo = e4m3(LO_SCALE * (x - hi)), so x = hi + lo / LO_SCALE. x - hi is exact in fp32 and at most half an ulp of hi
    (16 below 448), so LO_SCALE (16) keeps lo within e4m3's range while lifting small residuals out of its
    subnormals."""
    hi = x.to(tl.float8e4nv)
    lo = ((x - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    return tl.where(term == 0, hi, lo)


@triton.jit
def _term_weights(term):
    """1 for hi columns, 1 / LO_SCALE for lo columns (see _e4m3_terms)."""
    return tl.where(term == 0, 1.0, 0.0625)


@triton.jit
def _pair_sum(x):
    """[R, 2H] -> [R, 2H]: columns 2h and 2h + 1 both hold their sum (in-thread: an MMA accumulator's neighbouring
    columns are one thread's). The sum is formed in [R, 2H], not as [R, H], because Triton 3.6 fails to lower a
    join + reshape that feeds a dot's operand (sm_90)."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    return x + tl.reshape(tl.join(b, a), [x.shape[0], x.shape[1]])


@triton.jit
def _fp8_tile(q_terms, q_weights, term, m_i, l_i, acc, n0, end, page, k_cache_ptr, v_cache_ptr, kv_head,
              kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_h, vc_stride_d,
              d, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over tokens n0 .. n0 + BLOCK_N - 1 (page: their cache blocks). Columns c = 2h + t
    (head h, term t): m_i, l_i [2H] (each head's twice), acc = O^T [D, 2H] (term t of the probabilities in column
    2h + t). MASKED: tokens from `end` on are loaded as 0 and left out."""
    tok = n0 + tl.arange(0, BLOCK_N)
    in_page = tok % BLOCK_SIZE
    k_rows = page * kc_stride_b + in_page * kc_stride_s + kv_head * kc_stride_h
    v_cols = page * vc_stride_b + in_page + kv_head * vc_stride_h  # token-major V: tokens are unit-stride
    k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :])
    vt = tl.load(v_cache_ptr + v_cols[None, :] + d[:, None] * vc_stride_d)
    if MASKED:
        t_mask = tok < end
        vt = tl.where(t_mask[None, :], vt, 0.0)
    s = _pair_sum(tl.dot(k, q_terms) * q_weights)  # [BLOCK_N, 2H], log2 units
    if MASKED:
        s = tl.where(t_mask[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    if MASKED:
        l_i = l_i * alpha + tl.sum(p, axis=0)
    else:  # per-token partial sums, reduced over the tokens once after the loop (no cross-warp sum a tile)
        l_i = l_i * alpha[None, :] + p
    # a tile's products summed from zero, then added in fp32: sm_90's fp8 MMA adds into its accumulator with ~14 bits
    # kept (DeepSeek-V3's report), so a context-long chain of them would drift as the sum grows
    acc = acc * alpha[None, :] + tl.dot(vt, _e4m3_terms(p * 256.0, term))
    return m_new, l_i, acc


@triton.jit
def _fp8_attend(q_row, q_stride_h, k_cache_ptr, v_cache_ptr, bt_row, start, end, kv_head, scale_log2e,
                kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_h, vc_stride_d,
                GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, TAIL_BLOCK_N: tl.constexpr):
    """(acc [BLOCK_G, D] un-normalised, m_i, l_i [BLOCK_G]) of kv head `kv_head`'s GROUP q heads (q_row: the
    sequence's q) over tokens start .. end - 1 (bt_row: its block-table row), for attention_decode's
    `_decode_split_kernel` (FP8_MMA). HEAD_DIM == BLOCK_D, a multiple of 64; 2 * BLOCK_G >= 16."""
    # columns c = 2h + t: term t of head h (see above); q^T [D, 2 * BLOCK_G] with each head's values twice
    c = tl.arange(0, 2 * BLOCK_G)
    term = (c % 2)[None, :]
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_row + (kv_head * GROUP + c // 2)[None, :] * q_stride_h + d[:, None], mask=(c // 2 < GROUP)[None, :],
                other=0.0).to(tl.float32)
    # a power of two per head puts its largest |q| in (224, 448] (1 for a zero row; at most 2^126, so a row of tiny
    # values stays finite)
    q_max = tl.max(tl.abs(q), axis=0)
    q_scale = tl.exp2(tl.minimum(tl.floor(tl.log2(448.0 / tl.where(q_max > 0, q_max, 448.0))), 126.0))
    q_terms = _e4m3_terms(q * q_scale[None, :], term)
    # the scores' factor per column: the softmax scale in log2 units over q's scale, and the lo term's 1 / LO_SCALE
    q_weights = (scale_log2e / q_scale)[None, :] * _term_weights(term)
    m_i = tl.full([2 * BLOCK_G], float("-inf"), tl.float32)
    l_parts = tl.zeros([BLOCK_N, 2 * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_D, 2 * BLOCK_G], tl.float32)
    # Full tiles, their blocks read a step ahead and carried in the loop (a cache load hanging off a block-table
    # load of the same step keeps Triton's pipeliner to one buffer: docs/PERFORMANCE.md, run 113), then the tail
    # in tiles whose tokens past `end` are left out.
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    last_block = tl.maximum(full_end - 1, 0) // BLOCK_SIZE
    n = tl.arange(0, BLOCK_N)
    page = tl.load(bt_row + tl.minimum((start + n) // BLOCK_SIZE, last_block), mask=start < full_end,
                   other=0).to(tl.int64)
    for n0 in range(start, full_end, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        page_next = tl.load(bt_row + tl.minimum((n0 + BLOCK_N + n) // BLOCK_SIZE, last_block)).to(tl.int64)
        m_i, l_parts, acc = _fp8_tile(q_terms, q_weights, term, m_i, l_parts, acc, n0, end, page, k_cache_ptr,
                                      v_cache_ptr, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
                                      vc_stride_h, vc_stride_d, d, BLOCK_SIZE, BLOCK_N, False)
        page = page_next
    l_i = tl.sum(l_parts, axis=0)
    for n0 in range(full_end, end, TAIL_BLOCK_N):
        n0 = tl.multiple_of(n0, TAIL_BLOCK_N)
        tok = n0 + tl.arange(0, TAIL_BLOCK_N)
        # pages clamped to the last valid block: every address is in a block of the row's own
        tail_page = tl.load(bt_row + tl.minimum(tok // BLOCK_SIZE, (end - 1) // BLOCK_SIZE)).to(tl.int64)
        m_i, l_i, acc = _fp8_tile(q_terms, q_weights, term, m_i, l_i, acc, n0, end, tail_page, k_cache_ptr,
                                  v_cache_ptr, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
                                  vc_stride_h, vc_stride_d, d, BLOCK_SIZE, TAIL_BLOCK_N, True)
    # O^T's two terms added (the pair sums of neighbouring columns), back to [heads, D]: each head's row twice,
    # the even rows are the heads
    out_t = _pair_sum(acc * _term_weights(term)) * (1.0 / 256.0)
    acc_h, _ = tl.split(tl.reshape(tl.trans(out_t), [BLOCK_G, 2, BLOCK_D]).permute(0, 2, 1))
    m_h, _ = tl.split(tl.reshape(m_i, [BLOCK_G, 2]))
    l_h, _ = tl.split(tl.reshape(l_i, [BLOCK_G, 2]))
    return acc_h, m_h, l_h
