"""MLA's per-token prep in one launch: kv_a_layernorm of the latent, DeepSeek's interleaved rope on k_pe
and on every head's q_pe, and the [normed c, rotated k_pe] row into the paged latent cache.

Why one kernel: at batch 1 each of the four steps it replaces (RMSNorm, a copy back, rope, store) is a
~2 us launch moving a few KB; 27 layers x 3 launches saved is ~0.2 ms of a ~3 ms token. It replaced
separate latent-store and interleaved-rope kernels (run 50, with the other bs1 fusions: 3.34 -> 2.47 ms).

Contract: `mla_latent_prep(latent[T, L+R], norm_weight[L], eps, positions i64[T], q_pe[T, H, R],
cos_sin f32[P, R], cache[N, S, L+R], slot_mapping i32[T])`: cache[slot] = [rms_norm(c) * w, rope(k_pe)]
for every slot >= 0 (an fp8 cache clamps and casts as kernels/kv_cache.py does), q_pe rotated in place;
`latent` is left as it was. Rounding: the RMSNorm of kernels/rms_norm.py (HF's: normalised value rounded
to the dtype, then times the weight, rounded), the rope of kernels/mla_ref.py (fp32, one rounding).
latent, q_pe may be strided views (rows of a fused projection).
"""

from __future__ import annotations

import torch

from ._triton import next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .kv_cache import cast_to_cache
from .mla_ref import rotary_interleaved_ref, store_latent_ref
from .rms_norm import rms_norm_ref


def mla_latent_prep_ref(latent, norm_weight, eps, positions, q_pe, cos_sin, cache, slot_mapping) -> None:
    lat = norm_weight.shape[0]
    k_pe = latent[:, lat:].clone()
    rotary_interleaved_ref(positions, q_pe, k_pe, cos_sin)
    store_latent_ref(torch.cat([rms_norm_ref(latent[:, :lat], norm_weight, eps), k_pe], dim=-1), cache, slot_mapping)


@triton.jit
def _rotate_pairs(ptr, offs, stride_r, cos, sin, mask):
    """Rotate the pairs (x[2i], x[2i+1]) at ptr + offs in place: fp32 math, one rounding."""
    even_ptr = ptr + offs
    odd_ptr = even_ptr + stride_r
    even = tl.load(even_ptr, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(odd_ptr, mask=mask, other=0.0).to(tl.float32)
    dtype = ptr.dtype.element_ty
    tl.store(even_ptr, (even * cos - odd * sin).to(dtype), mask=mask)
    tl.store(odd_ptr, (even * sin + odd * cos).to(dtype), mask=mask)


@triton.jit
def _mla_latent_prep_kernel(
    lat_ptr, w_ptr, pos_ptr, q_ptr, cs_ptr, cache_ptr, slot_ptr, eps,
    lat_stride_t, q_stride_t, q_stride_h, q_stride_r, cs_stride_p, c_stride_b, c_stride_s, num_heads,
    KV_LORA: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program = one token."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    dtype = lat_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(cs_ptr + pos * cs_stride_p + i, mask=i_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * cs_stride_p + HALF + i, mask=i_mask, other=0.0)
    h = tl.arange(0, BLOCK_H)
    q_offs = token * q_stride_t + h[:, None] * q_stride_h + (2 * i)[None, :] * q_stride_r
    _rotate_pairs(q_ptr, q_offs, q_stride_r, cos[None, :], sin[None, :], (h < num_heads)[:, None] & i_mask[None, :])
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + (slot // BLOCK_SIZE) * c_stride_b + (slot % BLOCK_SIZE) * c_stride_s
        cols = tl.arange(0, BLOCK_L)
        c_mask = cols < KV_LORA
        c = tl.load(lat_ptr + token * lat_stride_t + cols, mask=c_mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(c * c, axis=0) / KV_LORA + eps)
        normed = (c * inv_rms).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(row + cols, cast_to_cache((w * normed).to(dtype), cache_ptr), mask=c_mask)
        k_even = tl.load(lat_ptr + token * lat_stride_t + KV_LORA + 2 * i, mask=i_mask, other=0.0).to(tl.float32)
        k_odd = tl.load(lat_ptr + token * lat_stride_t + KV_LORA + 2 * i + 1, mask=i_mask, other=0.0).to(tl.float32)
        tl.store(row + KV_LORA + 2 * i, cast_to_cache((k_even * cos - k_odd * sin).to(dtype), cache_ptr), mask=i_mask)
        tl.store(row + KV_LORA + 2 * i + 1, cast_to_cache((k_even * sin + k_odd * cos).to(dtype), cache_ptr),
                 mask=i_mask)


def mla_latent_prep_triton(latent, norm_weight, eps, positions, q_pe, cos_sin, cache, slot_mapping, *,
                           pdl: bool = False) -> None:
    require_triton()
    num_tokens, width = latent.shape
    lat = norm_weight.shape[0]
    _, num_heads, rot = q_pe.shape
    if width != lat + rot or cache.shape[-1] != width or cos_sin.shape[-1] != rot or latent.stride(1) != 1:
        raise ValueError(f"latent {tuple(latent.shape)}, norm weight {tuple(norm_weight.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}, cache {tuple(cache.shape)}: need [T, L+R], [L], [T, H, R], [N, S, L+R] "
                         "with a unit column stride")
    if num_tokens == 0:
        return
    block_l = next_pow2(lat)
    _mla_latent_prep_kernel[(num_tokens,)](
        latent, norm_weight, positions, q_pe, cos_sin, cache, slot_mapping, float(eps),
        latent.stride(0), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2), cos_sin.stride(0), cache.stride(0),
        cache.stride(1), num_heads, KV_LORA=lat, HALF=rot // 2, BLOCK_L=block_l, BLOCK_HALF=next_pow2(rot // 2),
        BLOCK_H=next_pow2(num_heads), BLOCK_SIZE=cache.shape[1], num_warps=max(1, min(4, block_l // 256)),
        enable_fp_fusion=False, **pdl_args(pdl),
    )
