"""Split-KV bookkeeping shared by the dense decode kernels (attention_decode.py, attention_decode_fp8.py): a
split's token range, the write of a program's result, and the in-kernel merge of the partials by the last split
of each (sequence, kv head) to arrive."""

from __future__ import annotations

from ._triton import tl, triton

# ----------------------------------------------------------------------------------------------
# One launch: the last split of each (sequence, kv head) merges
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
def _split_range(ctx, split, num_splits, min_chunk, BLOCK_N: tl.constexpr):
    """(start, end, live) of a split: the context cut into num_splits chunks rounded up to BLOCK_N (at least
    min_chunk tokens). Splits 0..live-1 are non-empty; every program of a (sequence, kv head) agrees on `live`
    (0 for an empty context). Empty splits must do nothing (they are not counted: the merge waits for `live`
    arrivals); split 0 of an empty context still runs to write its zeros."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, min_chunk)  # a BLOCK_N multiple
    live = tl.cdiv(ctx, tl.maximum(chunk, 1))
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    return start, end, live


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


@triton.jit
def _decode_finish(acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, seq, kv_head, split, live,
                   num_splits, out_stride_b, out_stride_h,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_GM: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_SPLITS: tl.constexpr, ONE_PASS: tl.constexpr):
    """A program's (acc [BLOCK_G, BLOCK_D] un-normalised, m_i, l_i) over its split: ONE_PASS, or a context that is
    one split, writes acc / l_i (zeros for an empty context); otherwise the split writes its normalised partial and
    log2-sum-exp, counts itself on the (sequence, kv head) counter, and the last to arrive merges (see above)."""
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    qd_mask = g_mask[:, None] & (d < HEAD_DIM)[None, :]
    out_offs = seq * out_stride_b + heads[:, None] * out_stride_h + d[None, :]
    if ONE_PASS:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        if live <= 1:  # the whole context is this split (or it is empty): no merge needed
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
        else:
            num_kv_heads = tl.num_programs(0)
            num_q_heads = num_kv_heads * GROUP
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
