"""Torch references of the multi-head latent attention (MLA) kernels: the CPU path and the tests' oracle.

The latent cache holds, per token, one vector of `L + R` values (L = kv_lora_rank, R = qk_rope_head_dim):
the kv_a_layernorm'ed latent c, then the rotated k_pe. Attention runs absorbed (DeepSeek-V2 §2.1.2): the
query's non-rotary part is folded through W_UK into latent space, so every head attends to the same
cached vectors (an MQA with head dim L+R for the scores and L for the values), and W_UV is applied to the
output after. Contracts (docs/CONTRACTS.md, "MLA"):
- `store_latent(latent[T,L+R], cache[N,S,L+R], slot_mapping i32[T])`: cache[slot // S, slot % S] = latent,
  slot -1 skipped; an fp8 cache clamps to +-448 and casts (unit scale), as the dense cache.
- `mla_decode_attention(q_lat[B,H,L], q_pe[B,H,R], cache, block_tables i32[B,M], context_lens i32[B],
  scale) -> o[B,H,L]`: o = softmax(scale * (q_lat . c + q_pe . k_pe)) @ c over the sequence's
  context_lens[b] cached tokens (the new one already stored); context 0 gives 0.
- `mla_prefill_attention(q_lat[T,H,L], q_pe[T,H,R], cache, cu_seqlens_q i32[B+1], context_lens i32[B],
  block_tables, max_seqlen_q: int, scale) -> o[T,H,L]`: the q_len new tokens of sequence b are the last of
  its context_lens[b] stored ones and attend causally (prefill, prefix hit and chunked prefill alike).
- `mla_expanded_attention(q[T,H,Dn+R], kv[S,H,Dn+Dv], k_pe[S,R], cu_seqlens_q i32[B+1], cu_seqlens_k
  i32[B+1], max_seqlen_q: int, scale) -> o[T,H,Dv]`: the expanded (non-absorbed) prefill over the step's
  context K/V, up-projected from the cached latents by kv_b_proj (kv = c @ W_kv_b^T per head: k_nope then v)
  with the rotated k_pe shared by every head: sequence b's q_len new queries are the last of its
  cu_seqlens_k[b+1] - cu_seqlens_k[b] keys and attend causally.
q_lat and q_pe may be strided views. Math in fp32 (fp8 widened exactly); outputs in q_lat's dtype.
`rotary_interleaved(positions[T], q_pe[T,H,R], k_pe[T,R], cos_sin[P,R])`: DeepSeek's rope, as
transformers applies it: pairs (x[2i], x[2i+1]) rotated by frequency i (cos_sin = cat(cos, sin) * mscale,
kernels/rotary.py), in fp32, rounded once to the input dtype; in place.
The Triton kernels: kernels/mla_attention.py (decode, prefill), kernels/mla_expanded.py (expanded prefill);
the store and the rope run fused with the latent norm on the GPU path (kernels/mla_prep.py), whose reference
composes these two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import to_cache_dtype


def store_latent_ref(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = to_cache_dtype(latent[valid], cache.dtype)


def rotary_interleaved_ref(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
                           cos_sin: torch.Tensor):
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[positions.long()].split(half, dim=-1)  # [T, R/2] fp32
    for x, c, s in ((q_pe, cos[:, None], sin[:, None]), (k_pe, cos, sin)):
        pairs = x.float().unflatten(-1, (half, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
        x.copy_(rotated.to(x.dtype))
    return q_pe, k_pe


def _context(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = table_row[: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length].float()


def _attend(q_lat, q_pe, ctx, kv_lora_rank, scale, first_pos):
    """fp32 [Lq,H,L] of queries at positions first_pos.. over ctx [Lc, L+R] (causal)."""
    latent, k_pe = ctx[:, :kv_lora_rank], ctx[:, kv_lora_rank:]
    scores = (torch.einsum("qhl,cl->qhc", q_lat.float(), latent)
              + torch.einsum("qhr,cr->qhc", q_pe.float(), k_pe)) * scale
    q_pos = first_pos + torch.arange(q_lat.shape[0], device=ctx.device)
    mask = torch.arange(ctx.shape[0], device=ctx.device)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    return torch.einsum("qhc,cl->qhl", scores.softmax(dim=-1), latent)


def mla_decode_attention_ref(q_lat, q_pe, cache, block_tables, context_lens, scale, *, plans=None):
    """One batched pass in fp32, as the dense decode reference (attention_ref.py): every row's blocks gathered
    up to the longest context, keys past a row's length masked, rows of length 0 give zeros. Why batched: the
    per-row loop it replaced cost the CPU engine's DeepSeek-V2 decode a Python pass and three small einsums a
    row a layer (docs/PERFORMANCE.md, session 26)."""
    lens = context_lens.long()
    max_len = int(lens.max()) if lens.numel() else 0
    if max_len == 0:
        return torch.zeros(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    kv_lora_rank = q_lat.shape[-1]
    blocks = block_tables[:, : -(-max_len // cache.shape[1])].long().clamp_min(0)  # -1: unused, masked below
    ctx = cache[blocks].flatten(1, 2)[:, :max_len].float()  # [B, Lc, L+R]
    past_end = torch.arange(max_len, device=q_lat.device)[None, :] >= lens[:, None]  # [B, Lc]
    # slots past a row's end hold another row's latents or stale (maybe NaN) data: zero, not 0 * NaN
    ctx = ctx.masked_fill(past_end[:, :, None], 0.0)
    latent, k_pe = ctx[..., :kv_lora_rank], ctx[..., kv_lora_rank:]
    scores = (torch.einsum("bhl,bcl->bhc", q_lat.float(), latent)
              + torch.einsum("bhr,bcr->bhc", q_pe.float(), k_pe)) * scale
    probs = scores.masked_fill(past_end[:, None, :], float("-inf")).softmax(dim=-1).nan_to_num(nan=0.0)
    return torch.einsum("bhc,bcl->bhl", probs, latent).to(q_lat.dtype)


def mla_prefill_attention_ref(q_lat, q_pe, cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale,
                              *, plans=None):
    out = torch.zeros(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    kv_lora_rank = q_lat.shape[-1]
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(context_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end > start:
            ctx = _context(cache, block_tables[b], length)
            out[start:end] = _attend(q_lat[start:end], q_pe[start:end], ctx, kv_lora_rank, scale,
                                     length - (end - start))
    return out


def mla_expanded_attention_ref(q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, *, out=None,
                               plans=None):
    rope = k_pe.shape[-1]
    nope = q.shape[-1] - rope
    heads = q.shape[1]
    out = q.new_empty(q.shape[0], heads, kv.shape[-1] - nope) if out is None else out
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        k = torch.cat([kv[k0:k1, :, :nope], k_pe[k0:k1, None, :].expand(-1, heads, -1)], dim=-1).float()
        if k1 - k0 == q1 - q0:  # no cached prefix: SDPA's fused causal kernel (top-left is exact here)
            visible, causal = None, True
        else:  # bottom-right causal: query i sits at (k1 - k0) - (q1 - q0) + i
            visible, causal = (torch.arange(k1 - k0, device=q.device)[None, :]
                               <= (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0, device=q.device)[:, None]), False
        o = F.scaled_dot_product_attention(q[q0:q1].float().transpose(0, 1), k.transpose(0, 1),
                                           kv[k0:k1, :, nope:].float().transpose(0, 1), attn_mask=visible,
                                           is_causal=causal, scale=scale)
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
    return out
