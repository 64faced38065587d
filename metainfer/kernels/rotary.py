"""Neox-style rotary embedding (rotate halves), in place on q and k, plus the cos/sin cache.

Contract: `rotary_neox(positions[T], q[T, Hq*D], k[T, Hk*D], cos_sin[max_pos, rot_dim], head_dim)`
rotates the first `rot_dim` dims of every head; `cos_sin[:, :rot_dim/2]` holds cos, the rest sin.
q and k may be strided views (slices of the fused qkv output) and may also be given as
`[T, H, D]`; they are updated in place and returned.

Rounding points follow HF transformers (`q * cos + rotate_half(q) * sin` with cos/sin already
cast to q's dtype, every op in that dtype): c, s = cos, sin rounded to x's dtype;
out1 = round(round(x1*c) - round(x2*s)), out2 = round(round(x2*c) + round(x1*s)), each product
and sum formed in fp32 from the rounded operands (so every op is one correctly rounded op in the
dtype, as torch does it). In fp32 all roundings are no-ops.

`build_cos_sin_cache` supports no scaling, "linear", "llama3" (Llama-3.1) and "yarn"
(DeepSeek-V2/V3 style). Frequencies follow transformers' rope init functions so the CPU path can
match HF token for token; the table is fp32 (cos/sin of large angles in bf16 lose ~3 digits).
"""

from __future__ import annotations

import math

import torch

from ._triton import next_pow2, pdl_args, pdl_enter, require_triton, tl, triton

# ----------------------------------------------------------------------------------------------
# cos/sin cache
# ----------------------------------------------------------------------------------------------


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1*mscale*ln(scale)+1 (1 when not extending).

    DeepSeek also multiplies its softmax scale by `yarn_get_mscale(factor, mscale_all_dim)**2`;
    that belongs to the model, not to this cache.
    """
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _scaling_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _inv_freq(rot_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim/2] (fp32) and the magnitude scale applied to cos/sin."""
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (base**exponents)
    kind = _scaling_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor = float(scaling["factor"])
        orig_len = float(scaling["original_max_position_embeddings"])
        beta_fast = float(scaling.get("beta_fast") or 32)
        beta_slow = float(scaling.get("beta_slow") or 1)
        mscale = scaling.get("attention_factor")
        if mscale is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if m and m_all:
                mscale = yarn_get_mscale(factor, float(m)) / yarn_get_mscale(factor, float(m_all))
            else:
                mscale = yarn_get_mscale(factor)

        def correction_dim(num_rotations: float) -> float:
            return rot_dim * math.log(orig_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1 for high-frequency dims kept as trained
        pos_freqs = base**exponents
        interpolated = 1.0 / (factor * pos_freqs)
        inv_freq = interpolated * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
        return inv_freq, float(mscale)
    raise ValueError(f"rope scaling type {kind!r} is not supported (use none, linear, llama3, yarn)")


def rope_mscale(scaling: dict | None) -> float:
    """The factor `build_cos_sin_cache` folds into cos/sin (yarn's attention_factor, else 1)."""
    if _scaling_type(scaling) != "yarn":
        return 1.0
    return _inv_freq(2, 10000.0, scaling)[1]


def build_cos_sin_cache(
    rot_dim: int,
    max_pos: int,
    base: float,
    scaling: dict | None = None,
    *,
    device: torch.device | str | None = None,
    return_mscale: bool = False,
):
    """fp32 table [max_pos, rot_dim] = cat(cos, sin) * mscale (mscale is 1 except for yarn).

    `scaling` is the config's rope_scaling dict (key "rope_type" or "type"). With
    `return_mscale=True` returns `(table, mscale)`.
    """
    if rot_dim % 2:
        raise ValueError(f"rot_dim must be even, got {rot_dim}")
    inv_freq, mscale = _inv_freq(rot_dim, float(base), scaling)
    positions = torch.arange(max_pos, dtype=torch.int64).float()
    angles = torch.outer(positions, inv_freq)
    table = torch.cat([angles.cos() * mscale, angles.sin() * mscale], dim=-1)
    table = table.to(device) if device is not None else table
    return (table, mscale) if return_mscale else table


# ----------------------------------------------------------------------------------------------
# torch reference (the CPU path)
# ----------------------------------------------------------------------------------------------


def _heads_view(x: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    return x.view(num_tokens, -1, head_dim)


def rotary_neox_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin: torch.Tensor,
    head_dim: int,
):
    rot_dim = cos_sin.shape[-1]
    half = rot_dim // 2
    num_tokens = positions.shape[0]
    cs = cos_sin.index_select(0, positions.long())
    for x in (q, k):
        if x is None:
            continue
        dtype = x.dtype

        def rnd(t: torch.Tensor, dtype=dtype) -> torch.Tensor:
            return t.to(dtype).float()

        cos = rnd(cs[:, None, :half])  # HF: cos.to(dtype=x.dtype)
        sin = rnd(cs[:, None, half:])
        rot = _heads_view(x, num_tokens, head_dim)[..., :rot_dim]
        x1 = rot[..., :half].float()
        x2 = rot[..., half:].float()
        # HF: q*cos + cat(-x2, x1)*sin, each op rounded to the dtype (round(-a) == -round(a))
        out1 = rnd(x1 * cos) - rnd(x2 * sin)
        out2 = rnd(x2 * cos) + rnd(x1 * sin)
        rot.copy_(torch.cat([out1, out2], dim=-1))  # the last rounding
    return q, k


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin, half_idx,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & (half_idx[None, :] < HALF)
    ptr = x_ptr + token * stride_t + heads[:, None] * stride_h + half_idx[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # HF's rounding points (see the module docstring); no-ops in fp32
    c = cos.to(dtype).to(tl.float32)[None, :]
    s = sin.to(dtype).to(tl.float32)[None, :]
    out1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(ptr, out1.to(dtype), mask=mask)
    tl.store(ptr + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_neox_kernel(
    pos_ptr, q_ptr, k_ptr, cos_sin_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_sin_stride,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HAS_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per token: cos/sin are loaded once and applied to every q and k head.
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    half_idx = tl.arange(0, BLOCK_HALF)
    cs_mask = half_idx < HALF
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + half_idx, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + half_idx, mask=cs_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, q_stride_t, q_stride_h, num_q_heads, cos, sin, half_idx, HALF, BLOCK_HQ)
    if HAS_K:
        _rotate_heads(k_ptr, token, k_stride_t, k_stride_h, num_k_heads, cos, sin, half_idx, HALF, BLOCK_HK)


def _check_heads_view(x: torch.Tensor, num_tokens: int, head_dim: int, name: str) -> torch.Tensor:
    if x.shape[0] != num_tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens, positions has {num_tokens}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit last stride (rotary works in place)")
    return _heads_view(x, num_tokens, head_dim)


def rotary_neox_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin: torch.Tensor,
    head_dim: int,
    *,
    pdl: bool = False,
):
    require_triton()
    num_tokens = positions.shape[0]
    rot_dim = cos_sin.shape[-1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    q3 = _check_heads_view(q, num_tokens, head_dim, "q")
    k3 = _check_heads_view(k, num_tokens, head_dim, "k") if k is not None else q3
    if num_tokens == 0:
        return q, k
    half = rot_dim // 2
    block_half = next_pow2(half)
    block_hq = next_pow2(q3.shape[1])
    block_hk = next_pow2(k3.shape[1])
    num_warps = max(1, min(8, block_hq * block_half // 256))
    _rotary_neox_kernel[(num_tokens,)](
        positions, q3, k3, cos_sin,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin.stride(0),
        q3.shape[1], k3.shape[1],
        HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        HAS_K=k is not None, num_warps=num_warps, **pdl_args(pdl),
        enable_fp_fusion=False,  # keep HF's rounding points: no mul + sub contracted into a bf16 fma
    )
    return q, k
