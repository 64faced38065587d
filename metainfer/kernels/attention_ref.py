"""Torch references of the paged attention kernels: the CPU engine's path and the tests' oracle.

Contracts (docs/CONTRACTS.md):
- `paged_decode_attention(q[B,Hq,D], k_cache[N,S,Hk,D], v_cache, block_tables i32[B,M],
  context_lens i32[B], scale) -> o[B,Hq,D]`: the query of sequence b attends to its
  `context_lens[b]` cached tokens (the new token is already stored); rows with context 0 give 0.
- `paged_prefill_attention(q[T,Hq,D], k_cache, v_cache, cu_seqlens_q i32[B+1], context_lens i32[B],
  block_tables, max_seqlen_q: int, scale) -> o[T,Hq,D]`: the q_len new tokens of sequence b are the
  last of its context_lens[b] stored tokens; query i sits at position context_len - q_len + i and
  attends causally. One kernel covers plain prefill, prefix-cache hits and chunked prefill.
GQA: q head h reads kv head h // (Hq / Hk). Math in fp32 (fp8 K/V widened exactly); the output has q's
dtype. The Triton kernels: attention_decode.py, attention_prefill.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import cdiv


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
    gqa = num_heads != num_kv_heads
    if first_pos == 0:  # no cached prefix: top-left causal is exact, and SDPA's fused causal kernel runs
        # (2.7x faster than the mask at 2,048 tokens on the CPU, docs/PERFORMANCE.md session 26)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    key_pos = torch.arange(length, device=q.device)
    q_pos = first_pos + torch.arange(num_q, device=q.device)
    mask = key_pos[None, :] <= q_pos[:, None]  # bottom-right causal: query i sits at first_pos + i
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
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
