"""How fast can the fp8 decode attention's reads go? A probe, not an engine kernel.

The fp8 decode attention (kernels/attention_decode.py) reads its cache at 2.2-2.7 TB/s where the bf16 one reads at
the copy rate (docs/PERFORMANCE.md, runs 35, 73). This kernel walks the same cache the same way (a program per
(kv head, sequence), the block table's pages, K head-major [BLOCK_N, D] and V token-major [D, BLOCK_N] tiles) and
does nothing but sum what it loaded, so its read rate is what the access pattern allows:
  WIDEN False: the raw bytes summed as int8 (loads only);
  WIDEN True:  each value widened to fp16 first, as the attention does for its products (loads + widening).
If both reach the copy rate, the attention's own math and operand staging bound it; if only the first does, the
widening does; if neither, the access pattern (and the fix is in the layout or the loads).

`kv_read_probe(k_cache, v_cache, block_tables, context_lens, widen, block_n) -> f32[B, Hk]`: per (sequence, kv
head) the sum over its context's K and V values (WIDEN: as fp16 values; else their int8 bit patterns).
"""

from __future__ import annotations

import torch

from metainfer.kernels._triton import require_triton, tl, triton


@triton.jit(do_not_specialize=["bt_stride"])
def _kv_read_probe_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, bt_stride,
                          kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, vc_d,
                          HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                          WIDEN: tl.constexpr):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    num_kv_heads = tl.num_programs(0)
    ctx = tl.load(lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    # per-dimension sums, reduced every tile: a [BLOCK_N, HEAD_DIM] fp32 accumulator (run 95) held 64-128
    # registers a thread per operand and spilled at 128-token tiles, so the probe, not the cache, set its rate
    acc_k = tl.zeros([HEAD_DIM], tl.float32)
    acc_v = tl.zeros([HEAD_DIM], tl.float32)
    for n0 in range(0, ctx, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < ctx
        # the last valid token's page past the end (as the attention's CLAMP): unmasked, vectorised loads
        page = tl.load(bt_ptr + seq * bt_stride + tl.minimum(tok, ctx - 1) // BLOCK_SIZE).to(tl.int64)
        in_page = tok % BLOCK_SIZE
        k = tl.load(k_ptr + (page * kc_b + in_page * kc_s + kv_head * kc_h)[:, None] + d[None, :])
        v = tl.load(v_ptr + (page * vc_b + in_page * vc_s + kv_head * vc_h)[None, :] + d[:, None] * vc_d)
        if WIDEN:
            k = k.to(tl.float16).to(tl.float32)
            v = v.to(tl.float16).to(tl.float32)
        else:
            k = k.to(tl.int8, bitcast=True).to(tl.float32)
            v = v.to(tl.int8, bitcast=True).to(tl.float32)
        acc_k += tl.sum(tl.where(t_mask[:, None], k, 0.0), axis=0)
        acc_v += tl.sum(tl.where(t_mask[None, :], v, 0.0), axis=1)
    total = tl.sum(acc_k, axis=0) + tl.sum(acc_v, axis=0)
    tl.store(out_ptr + seq * num_kv_heads + kv_head, total)


def kv_read_probe(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, widen: bool, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 2) -> torch.Tensor:
    """See the module docstring. k_cache [N, S, Hk, D] fp8 head-major, v_cache token-major
    (kernels/kv_cache.token_major_v_cache); every context >= 1."""
    require_triton()
    n, s, hk, d = k_cache.shape
    batch = context_lens.shape[0]
    out = torch.empty(batch, hk, dtype=torch.float32, device=k_cache.device)
    _kv_read_probe_kernel[(hk, batch)](
        k_cache, v_cache, block_tables, context_lens, out, block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride(),
        HEAD_DIM=d, BLOCK_SIZE=s, BLOCK_N=block_n, WIDEN=widen, num_warps=num_warps, num_stages=num_stages)
    return out


def block_major_k_view(memory: torch.Tensor) -> torch.Tensor:
    """A [N, S, Hk, D] K cache over contiguous memory of that shape, laid out block-major: the memory read as
    [N, Hk, S, D], permuted to [N, S, Hk, D] (strides (Hk*S*D, D, S*D, 1)); a block stays contiguous, so the
    block table and the prefix cache address it as before. The GPU suite's `fp8_k_layout` A/B re-views the
    engine's (empty) K caches this way."""
    n, s, hk, d = memory.shape
    return memory.view(n, hk, s, d).permute(0, 2, 1, 3)


def block_major_k_copy(k_cache: torch.Tensor) -> torch.Tensor:
    """The values of a [N, S, Hk, D] K cache over memory laid out [N, Hk, S, D] (strides (Hk*S*D, D, S*D, 1)): a kv
    head's tokens of one block are S*D contiguous elements (2 KB in fp8 at S 16, D 128) instead of S rows of D
    elements Hk*D apart (128-byte rows 1 KB apart). The decode kernels and this probe take any K strides with a unit
    last one, so `attn_read_probe` times both layouts without an engine change."""
    return block_major_k_view(torch.empty(k_cache.shape, dtype=k_cache.dtype, device=k_cache.device)).copy_(k_cache)


def kv_read_probe_ref(k_cache, v_cache, block_tables, context_lens, widen: bool) -> torch.Tensor:
    """The same sums in torch (float64), token by token through the block table."""
    batch, hk = context_lens.shape[0], k_cache.shape[2]
    out = torch.zeros(batch, hk, dtype=torch.float64)
    for b in range(batch):
        ctx = int(context_lens[b])
        tok = torch.arange(ctx)
        pages = block_tables[b].cpu()[tok // k_cache.shape[1]].long()
        for cache in (k_cache, v_cache):
            vals = cache.cpu()[pages, tok % cache.shape[1]]  # [ctx, Hk, D]
            vals = vals.to(torch.float64) if widen else vals.view(torch.int8).to(torch.float64)
            out[b] += vals.sum(dim=(0, 2))
    return out
