"""Scatter the new tokens' K/V into the paged cache.

Contract: `store_kv(k[T,Hk,D], v[T,Hk,D], k_cache[N,S,Hk,D], v_cache, slot_mapping i32[T])`
writes cache[slot // S, slot % S] = k/v; slot -1 marks padding and is skipped. k and v may be
strided views of the fused qkv output (token stride != Hk*D).

The cache dtype is the model's or fp8 (`float8_e4m3fn`, `kv_cache_dtype="fp8"`): values are cast
with a unit scale after clamping to the fp8 range (+-448), so an outlier saturates instead of
becoming NaN; writers take a cache of k's dtype or fp8 (`check_cache_dtype`). Readers widen fp8 K/V
exactly before any product (kernels/attention_decode.py: to q's dtype, or fp16 for bf16 q).

V layouts: every kernel takes v_cache as a [N, S, Hk, D] tensor and addresses it through its
strides. Head-major (contiguous, d fastest) is what a plain tensor is; token-major (`token_major_v_cache`: each
(block, kv head) a contiguous [D, S] tile, tokens fastest) is for an fp8 cache, so that P @ V reads V
along the tokens it sums over, as q @ K^T reads K along d (sm_90 has no 8-bit transposing ldmatrix;
docs/PERFORMANCE.md). The layout follows the dtype: a 16-bit cache's V is head-major, an fp8 cache's V
token-major (`check_v_cache_layout`; the head-major fp8 layout lost its A/B and was removed).

K layouts: every kernel addresses K through its strides (a unit last one). A 16-bit cache's K is head-major; an
fp8 cache's K is block-major (`block_major_k_cache`: each (block, kv head) a contiguous [S, D] tile, d fastest),
so a decode tile of one kv head reads whole 2-KB blocks instead of 128-byte rows Hk*D apart (run 98: the fp8
decode attention 2.0-2.7% faster, nano-vllm's fp8 throughput +0.7%; the bf16 kernel the same in both layouts).
"""

from __future__ import annotations

import torch

from ._triton import next_pow2, pdl_args, pdl_enter, require_triton, tl, triton

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype: fp8 clamps to +-448 first (the Triton kernels' `cast_to_cache`)."""
    if dtype == FP8_KV_DTYPE:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def token_major_v_cache(memory: torch.Tensor) -> torch.Tensor:
    """The [N, S, Hk, D] V cache over contiguous memory of that shape, laid out token-major: the
    memory read as [N, Hk, D, S], permuted to [N, S, Hk, D] (strides (Hk*D*S, 1, D*S, S))."""
    n, s, hk, d = memory.shape
    return memory.view(n, hk, d, s).permute(0, 3, 1, 2)


def block_major_k_cache(memory: torch.Tensor) -> torch.Tensor:
    """The [N, S, Hk, D] K cache over contiguous memory of that shape, laid out block-major: the memory read as
    [N, Hk, S, D], permuted to [N, S, Hk, D] (strides (Hk*S*D, D, S*D, 1)). A block stays contiguous, so block
    ids and the prefix cache address it as a head-major one."""
    n, s, hk, d = memory.shape
    return memory.view(n, hk, s, d).permute(0, 2, 1, 3)


def block_major_copy(k_cache: torch.Tensor) -> torch.Tensor:
    """The values of a [N, S, Hk, D] K cache (any layout) in a new block-major one (tests, benchmarks)."""
    return block_major_k_cache(torch.empty(k_cache.shape, dtype=k_cache.dtype, device=k_cache.device)).copy_(k_cache)


def fp8_cache_copy(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (fp8 values, any layout) in new caches of the engine's fp8 layouts: K block-major, V token-major."""
    return block_major_copy(k_cache), token_major_copy(v_cache)


def token_major_copy(v_cache: torch.Tensor) -> torch.Tensor:
    """The values of a [N, S, Hk, D] V cache (any layout) in a new token-major one (tests, benchmarks)."""
    return token_major_v_cache(torch.empty(v_cache.shape, dtype=v_cache.dtype, device=v_cache.device)).copy_(v_cache)


def is_token_major(v_cache: torch.Tensor) -> bool:
    """True for a token-major V cache (token_major_v_cache) of more than one token a block; a block of
    one token is both layouts at once, and the head-major code reads it."""
    return v_cache.stride(-1) != 1


def check_v_cache_layout(v_cache: torch.Tensor) -> None:
    """A 16-bit (or fp32) v_cache is head-major (unit last stride); an fp8 one token-major
    (token_major_v_cache's strides; a block of one token is both)."""
    if v_cache.dim() != 4:
        raise ValueError(f"v_cache must be [N, S, Hk, D], got shape {tuple(v_cache.shape)}")
    n, s, hk, d = v_cache.shape
    if v_cache.dtype == FP8_KV_DTYPE:
        if v_cache.stride()[1:] == (1, d * s, s) or (s == 1 and v_cache.stride(-1) == 1):
            return
        raise ValueError(f"an fp8 v_cache must be token-major (strides {(hk * d * s, 1, d * s, s)}: "
                         f"token_major_v_cache), got {v_cache.stride()}")
    if v_cache.stride(-1) != 1:
        raise ValueError(f"a {v_cache.dtype} v_cache must be head-major (unit last stride), got {v_cache.stride()}")


def check_cache_dtype(compute_dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, name: str) -> None:
    """The caches hold `compute_dtype` or fp8 (both the same)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (compute_dtype, FP8_KV_DTYPE):
        raise ValueError(f"{name} {compute_dtype} and KV cache {k_cache.dtype}/{v_cache.dtype}: the cache must hold "
                         f"{name}'s dtype or {FP8_KV_DTYPE} (both caches the same)")


@triton.jit
def _round_to_fp8_grid(x):
    """fp32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value (ties to even), still fp32, so
    that the cast after it is exact. Why not let the cast round: Triton 3.6's interpreter drops the
    carry when rounding crosses a power of two (31.5 -> 16), and CI checks these kernels there."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 of fp32's 23 mantissa bits, round to nearest even (a carry bumps the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal range (|x| < 2^-6): |x| to a multiple of 2^-9 by the fp32 add of 1.5 * 2^14 (ulp 2^-9),
    # then x's sign (-0.0 included)
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, tl.where(x == x, normal, x))


@triton.jit
def cast_to_cache(x, cache_ptr):
    """x in the dtype of cache_ptr's elements; fp8 clamps to +-448 first (as to_cache_dtype)."""
    dtype = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:  # 448.0: FP8_MAX (a jit function reads no Python float)
        x = _round_to_fp8_grid(tl.clamp(x.to(tl.float32), -448.0, 448.0))
    return x.to(dtype)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_cache_dtype(k.dtype, k_cache, v_cache, "k")
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(k[valid], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(v[valid], v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h,
    vc_stride_b, vc_stride_s, vc_stride_h, vc_stride_d,
    num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
        src_k = token * k_stride_t + heads[:, None] * k_stride_h + dims[None, :]
        src_v = token * v_stride_t + heads[:, None] * v_stride_h + dims[None, :]
        dst_k = block * kc_stride_b + offset * kc_stride_s + heads[:, None] * kc_stride_h + dims[None, :]
        dst_v = block * vc_stride_b + offset * vc_stride_s + heads[:, None] * vc_stride_h + dims[None, :] * vc_stride_d
        k = tl.load(k_ptr + src_k, mask=mask)
        v = tl.load(v_ptr + src_v, mask=mask)
        tl.store(k_cache_ptr + dst_k, cast_to_cache(k, k_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + dst_v, cast_to_cache(v, v_cache_ptr), mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> None:
    require_triton()
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.shape[2:] != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match k {tuple(k.shape)}")
    check_cache_dtype(k.dtype, k_cache, v_cache, "k")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    check_v_cache_layout(v_cache)
    if num_tokens == 0:
        return
    block_h, block_d = next_pow2(num_heads), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        num_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=max(1, min(8, block_h * block_d // 256)), **pdl_args(pdl),
    )
