"""Fused attention-input preparation: per-head q/k RMSNorm -> neox rotary -> paged K/V store.

Contract (docs/CONTRACTS.md, row `qk_norm_rope_store`):
`qk_norm_rope_store(qkv[T, (Hq+2Hk)*D], positions i64[T], cos_sin fp32[max_pos, rot_dim],
q_norm_w[D] or None, k_norm_w[D] or None, eps, k_cache[N,S,Hk,D], v_cache[N,S,Hk,D],
slot_mapping i32[T], num_q_heads, num_kv_heads, head_dim) -> (q[T,Hq,D], k[T,Hk,D], v[T,Hk,D])`

Semantics are exactly the composition of the un-fused references, in this order:
1. q <- rms_norm(q, q_norm_w, eps) and k <- rms_norm(k, k_norm_w, eps), per head of D, each only
   when its weight is given (Qwen3 has both; Qwen2/Llama pass None);
2. rotary_neox on the first rot_dim = cos_sin.shape[-1] dims of every q and k head;
3. store_kv(k, v, k_cache, v_cache, slot_mapping): cache[slot // S, slot % S] = k/v, slot -1 skipped.

In place: q and k are written back into `qkv`, and the returned q, k, v are views of `qkv`
(`qkv[:, :Hq*D]`, `qkv[:, Hq*D:(Hq+Hk)*D]`, `qkv[:, (Hq+Hk)*D:]` seen as `[T, heads, D]`; their
token stride is qkv's row stride, (Hq+2Hk)*D for a plain projection output). v is not modified.
`qkv` may have any row stride (its last stride must be 1); nothing is copied.

`qk_norm_rope_store_ref` is literally built from `rms_norm_ref`, `rotary_neox_ref` and
`store_kv_ref`, so it inherits whatever rounding convention those have. The Triton kernel (one
launch instead of four; the paged attention backend runs it before every prefill and decode
attention) rounds where HF transformers does in the model's dtype:
RMSNorm `n = (x_fp32 * rsqrt(mean(x^2)+eps)).to(dtype)`, `y = (n * w).to(dtype)`; rotary with
`c, s = cos.to(dtype), sin.to(dtype)`, `out1 = (round(x1*c) - round(x2*s)).to(dtype)`,
`out2 = (round(x2*c) + round(x1*s)).to(dtype)` (all products computed in fp32; in fp32 every
rounding is a no-op). The cache gets the rounded k (then cast to the cache dtype, fp8 clamped), as store_kv.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .kv_cache import cast_to_cache, check_cache_dtype, check_v_cache_layout, store_kv_ref
from .rms_norm import rms_norm_ref
from .rotary import rotary_neox_ref


def _split_heads(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v as [T, heads, D] views of the fused projection output (no copy)."""
    if qkv.dim() != 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (Hq+2Hk)*D] with Hq={num_q_heads}, "
                         f"Hk={num_kv_heads}, D={head_dim}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv must have a unit last stride (q and k are updated in place)")
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    num_tokens = qkv.shape[0]
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# torch reference (the CPU path): the three un-fused references, composed
# ----------------------------------------------------------------------------------------------


def qk_norm_rope_store_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
):
    q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q.copy_(rms_norm_ref(q, q_norm_w, eps))
    if k_norm_w is not None:
        k.copy_(rms_norm_ref(k, k_norm_w, eps))
    rotary_neox_ref(positions, q, k, cos_sin, head_dim)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round fp32 to the model dtype and back (a no-op for fp32)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rope_lanes(pos_ptr, token, cos_sin_ptr, cos_sin_stride, dtype: tl.constexpr, HALF: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Per-lane neox rotary constants of one token: (dims, partner, sign, is_rot, cos, sin), cos/sin
    rounded to the model dtype (HF casts the cache before the products)."""
    dims = tl.arange(0, BLOCK_D)
    first = dims < HALF
    is_rot = dims < 2 * HALF
    partner = tl.where(first, dims + HALF, tl.where(is_rot, dims - HALF, dims))
    sign = tl.where(first, -1.0, 1.0)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cs_idx = tl.where(first, dims, dims - HALF)
    cs_row = cos_sin_ptr + pos * cos_sin_stride
    cos = _round(tl.load(cs_row + cs_idx, mask=is_rot, other=0.0).to(tl.float32), dtype)
    sin = _round(tl.load(cs_row + HALF + cs_idx, mask=is_rot, other=0.0).to(tl.float32), dtype)
    return dims, partner, sign, is_rot, cos, sin


@triton.jit
def _norm_rope(x, xp, w_ptr, eps, cos, sin, dims, partner, sign, is_rot,
               HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    """Per-head RMSNorm then neox rotary of fp32 heads x [H, BLOCK_D] (xp: each lane's rotary
    partner d +- rot_dim/2, normalised with the same per-head inverse RMS, so partial rotary needs
    no special layout), rounded where HF rounds; returns [H, BLOCK_D] in `dtype`."""
    if HAS_NORM:
        d_mask = dims < HEAD_DIM
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + dims, mask=d_mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
        x = _round(_round(x * inv_rms, dtype) * w[None, :], dtype)
        xp = _round(_round(xp * inv_rms, dtype) * wp[None, :], dtype)
    rotated = _round(x * cos[None, :], dtype) + sign[None, :] * _round(xp * sin[None, :], dtype)
    return tl.where(is_rot[None, :], rotated, x).to(dtype)


@triton.jit
def _load_heads(base, dims, partner, mask):
    """fp32 heads at base + [H, 1] offsets and their rotary partners."""
    x = tl.load(base + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, xp


@triton.jit
def _norm_rope_heads(
    x_ptr, row, head0, num_heads, w_ptr, eps, cos, sin, dims, partner, sign, is_rot,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Norm + rotate BLOCK_H heads of D starting at head0 of the row at x_ptr + row, in place.
    Returns the rounded output [BLOCK_H, BLOCK_D], the head indices and the mask."""
    dtype = x_ptr.dtype.element_ty
    heads = head0 + tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & (dims < HEAD_DIM)[None, :]
    base = x_ptr + row + heads[:, None] * HEAD_DIM
    x, xp = _load_heads(base, dims, partner, mask)
    out = _norm_rope(x, xp, w_ptr, eps, cos, sin, dims, partner, sign, is_rot, HEAD_DIM, HAS_NORM, dtype)
    # in place: every lane's partner load must precede any lane's store (lanes may sit in other warps)
    tl.debug_barrier()
    tl.store(base + dims[None, :], out, mask=mask)
    return out, heads, mask


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    qkv_stride_t, cos_sin_stride,
    kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
    num_q_heads, num_kv_heads, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    # grid = (T, q head groups + kv head groups): a program handles BLOCK_H q heads, or BLOCK_H
    # k heads plus the matching v heads (norm, rotate, write back, store into the cache).
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    num_q_groups = tl.cdiv(num_q_heads, BLOCK_H)
    dtype = qkv_ptr.dtype.element_ty

    dims, partner, sign, is_rot, cos, sin = _rope_lanes(pos_ptr, token, cos_sin_ptr, cos_sin_stride, dtype, HALF,
                                                        BLOCK_D)

    row = token * qkv_stride_t
    if group < num_q_groups:
        _norm_rope_heads(qkv_ptr, row, group * BLOCK_H, num_q_heads, q_w_ptr, eps, cos, sin, dims, partner,
                         sign, is_rot, HEAD_DIM, HAS_Q_NORM, BLOCK_H)
    else:
        k_row = row + num_q_heads * HEAD_DIM
        k, heads, mask = _norm_rope_heads(qkv_ptr, k_row, (group - num_q_groups) * BLOCK_H, num_kv_heads,
                                          k_w_ptr, eps, cos, sin, dims, partner, sign, is_rot,
                                          HEAD_DIM, HAS_K_NORM, BLOCK_H)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            v_src = qkv_ptr + k_row + num_kv_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
            v = tl.load(v_src, mask=mask)
            k_dst = k_cache_ptr + block * kc_stride_b + offset * kc_stride_s + heads[:, None] * kc_stride_h
            v_dst = v_cache_ptr + block * vc_stride_b + offset * vc_stride_s + heads[:, None] * vc_stride_h
            tl.store(k_dst + dims[None, :], cast_to_cache(k, k_cache_ptr), mask=mask)
            tl.store(v_dst + dims[None, :] * vc_stride_d, cast_to_cache(v, v_cache_ptr), mask=mask)


# Programs the default split aims for: about one per SM of a large GPU (132 on the H200).
_FILL_PROGRAMS = 128


def _check_norm_weight(w: torch.Tensor | None, head_dim: int, name: str) -> None:
    if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor, got {tuple(w.shape)}")


def _check_prep_inputs(qkv, positions, cos_sin, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping,
                       num_kv_heads, head_dim) -> torch.Tensor:
    """ValueError on inputs the fused q/k kernels cannot take; returns cos_sin with a unit last stride."""
    num_tokens = qkv.shape[0]
    rot_dim = cos_sin.shape[-1]
    if rot_dim % 2 or rot_dim > head_dim or rot_dim == 0:
        raise ValueError(f"rot_dim {rot_dim} must be even, > 0 and <= head_dim {head_dim}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must be [{num_tokens}]")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} are not [N, S, {num_kv_heads}, "
                         f"{head_dim}]")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache must have a unit last stride")
    check_v_cache_layout(v_cache)
    check_cache_dtype(qkv.dtype, k_cache, v_cache, "qkv")
    _check_norm_weight(q_norm_w, head_dim, "q_norm_w")
    _check_norm_weight(k_norm_w, head_dim, "k_norm_w")
    return cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()


def qk_norm_rope_store_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    heads_per_program: int | None = None,
    pdl: bool = False,
):
    """`heads_per_program` (a power of two) is a tuning knob. The default gives a program ~1K
    elements, or fewer heads where that would leave most SMs idle (at batch 1, 8 heads a program
    made 5 programs): about one program per SM's worth of heads, never below one head."""
    require_triton()
    q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
    num_tokens = qkv.shape[0]
    cos_sin = _check_prep_inputs(qkv, positions, cos_sin, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping,
                                 num_kv_heads, head_dim)
    rot_dim = cos_sin.shape[-1]
    if num_tokens == 0:
        return q, k, v

    block_d = next_pow2(head_dim)
    if heads_per_program is None:
        fill_sms = next_pow2(cdiv(num_tokens * (num_q_heads + num_kv_heads), _FILL_PROGRAMS))
        heads_per_program = max(1, min(next_pow2(max(num_q_heads, num_kv_heads)), 1024 // block_d, fill_sms))
    block_h = heads_per_program
    if block_h & (block_h - 1):
        raise ValueError(f"heads_per_program must be a power of two, got {block_h}")
    num_groups = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h)
    _qk_norm_rope_store_kernel[(num_tokens, num_groups)](
        qkv, positions, cos_sin,
        q_norm_w if q_norm_w is not None else qkv, k_norm_w if k_norm_w is not None else qkv,
        k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        num_q_heads, num_kv_heads, float(eps),
        HEAD_DIM=head_dim, HALF=rot_dim // 2, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_SIZE=k_cache.shape[1], HAS_Q_NORM=q_norm_w is not None, HAS_K_NORM=k_norm_w is not None,
        num_warps=max(1, min(8, block_h * block_d // 256)), **pdl_args(pdl),
        enable_fp_fusion=False,  # keep HF's rounding points: no mul + sub contracted into a bf16 fma
    )
    return q, k, v
