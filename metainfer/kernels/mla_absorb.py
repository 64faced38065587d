"""MLA's per-head up-projections of the absorbed form: the query's K-up and the output's V-up.

Why: absorbed MLA attention (attention/mla.py) multiplies every head's query by its [Dn, L] slice of
kv_b_proj before attention and its [L] output by the [Dv, L] slice after. As batched GEMMs (torch.bmm,
cuBLAS) a decode step pays two cuBLAS launches a layer that read ~2 MB each (DeepSeek-V2-Lite: 16 heads,
Dn = Dv = 128, L = 512) and cannot join the Triton kernels' programmatic dependent launch chain (H200,
run 51: 0.18 ms a token for 52 of them, against ~0.03 ms of bytes). For decode-sized batches the Triton
kernels here load their weight tile before waiting on the previous kernel (weights are never written), so
under PDL the weight read overlaps that kernel's tail; each row of the batch is then a few FMAs.

Contracts (shapes per rank: H = heads / tp):
- `mla_absorb_ref(q_nope [T, H, Dn] (any strides), w_uk [H, Dn, L] (any strides)) -> q_lat [T, H, L]`:
  q_lat[t, h] = q_nope[t, h] @ w_uk[h], fp32 accumulation, one rounding to q's dtype (torch.bmm).
- `mla_value_up_ref(o_lat [T, H, L], w_uv [H, Dv, L], out=None) -> [T, H * Dv]`: out[t, h*Dv + v] =
  o_lat[t, h] . w_uv[h, v], likewise; written into `out` ([T, H * Dv], unit last stride) when given (the
  piecewise graphs' static attention output: no copy after the GEMM).
- `mla_absorb_triton` / `mla_value_up_triton`: the same results (fp32 accumulation in another order) for
  T <= max_rows (default MAX_ROWS), the refs beyond (tensor-core GEMMs win once every weight tile serves
  many rows). H200 A/B in the engine (run 62, DeepSeek-V2-Lite bs1 decode): 2.38 -> 2.22 ms a token
  (419.9 / 421.1 -> 450.3 tok/s), so the engine binds them.
- `mma_rows` (default 0: off): max_rows < T <= mma_rows take tensor-core tiles (`_mla_absorb_mma_kernel`,
  `_mla_value_up_mma_kernel`: BLOCK_T rows x a column block of one head a program; the K-up's weight tile
  loaded before the PDL wait) instead of the refs' cuBLAS bmm, which sits outside the PDL chain (~5.4 us a launch
  at 256 rows on an H100, runs 96-97, against ~1-2 us of bytes and FLOPs). Not yet on the engine's path:
  `tools/bench_mla.py --absorb-rows` times it against the bmm first (docs/PERFORMANCE.md, Pending).
"""

from __future__ import annotations

import torch

from ._triton import cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton

MAX_ROWS = 16  # the Triton kernels' largest batch (each program holds its weight tile and loops over the rows)
_ABSORB_BLOCK_L = 64  # latent columns a program of the K-up (a [Dn, 64] tile: 64 fp32 registers a thread at Dn 128)
_VALUE_UP_BLOCK_V = 16  # value rows a program of the V-up (a [16, L] tile)


def mla_absorb_ref(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, Dn] @ w_uk [H, Dn, L] per head -> q_lat [T, H, L] (a strided view of [H, T, L])."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def mla_value_up_ref(o_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """o_lat [T, H, L] @ w_uv [H, Dv, L]^T per head -> [T, H * Dv] (into `out` when given)."""
    if out is None:
        result = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, Dv]
        return result.transpose(0, 1).reshape(o_lat.shape[0], -1)
    heads, dv, _ = w_uv.shape
    torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.view(o_lat.shape[0], heads, dv).transpose(0, 1))
    return out


@triton.jit(do_not_specialize=["T"])
def _mla_absorb_kernel(q_ptr, w_ptr, out_ptr, T, D, L, stride_qt, stride_qh, stride_wh, stride_wd,
                       stride_ot, stride_oh, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, h, l] = sum_d q[t, h, d] * w[h, d, l] for the BLOCK_L columns l of program (h, l block)."""
    h = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    d_mask, l_mask = offs_d < D, offs_l < L
    w = tl.load(w_ptr + h * stride_wh + offs_d[:, None] * stride_wd + offs_l[None, :],
                mask=d_mask[:, None] & l_mask[None, :], other=0.0).to(tl.float32)  # before the wait: a weight
    pdl_enter(USE_PDL)
    for t in range(T):
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        acc = tl.sum(w * q[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_l, acc.to(out_ptr.dtype.element_ty), mask=l_mask)


@triton.jit(do_not_specialize=["T"])
def _mla_value_up_kernel(o_ptr, w_ptr, out_ptr, T, DV, L, stride_ot, stride_oh, stride_wh, stride_wv, stride_yt,
                         BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, h*DV + v] = sum_l o[t, h, l] * w[h, v, l] for the BLOCK_V rows v of program (h, v block)."""
    h = tl.program_id(0).to(tl.int64)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_l = tl.arange(0, BLOCK_L)
    v_mask, l_mask = offs_v < DV, offs_l < L
    w = tl.load(w_ptr + h * stride_wh + offs_v[:, None] * stride_wv + offs_l[None, :],
                mask=v_mask[:, None] & l_mask[None, :], other=0.0).to(tl.float32)  # before the wait: a weight
    pdl_enter(USE_PDL)
    for t in range(T):
        o = tl.load(o_ptr + t * stride_ot + h * stride_oh + offs_l, mask=l_mask, other=0.0).to(tl.float32)
        acc = tl.sum(w * o[None, :], axis=1)
        tl.store(out_ptr + t * stride_yt + h * DV + offs_v, acc.to(out_ptr.dtype.element_ty), mask=v_mask)


@triton.jit(do_not_specialize=["T"])
def _mla_absorb_mma_kernel(q_ptr, w_ptr, out_ptr, T, D, L, stride_qt, stride_qh, stride_wh, stride_wd,
                           stride_ot, stride_oh, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, h, l] = sum_d q[t, h, d] * w[h, d, l] for the BLOCK_T rows and BLOCK_L columns of program
    (h, l block, t block): one [BLOCK_T, D] x [D, BLOCK_L] tensor-core product (D <= BLOCK_D, one tile)."""
    h = tl.program_id(0).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask, l_mask, t_mask = offs_d < D, offs_l < L, offs_t < T
    w = tl.load(w_ptr + h * stride_wh + offs_d[:, None] * stride_wd + offs_l[None, :],
                mask=d_mask[:, None] & l_mask[None, :], other=0.0)  # before the wait: a weight
    pdl_enter(USE_PDL)
    q = tl.load(q_ptr + offs_t.to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.dot(q, w, input_precision="ieee" if q.dtype == tl.float32 else "tf32")
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_l[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & l_mask[None, :])


@triton.jit(do_not_specialize=["T"])
def _mla_value_up_mma_kernel(o_ptr, w_ptr, out_ptr, T, DV, L, stride_ot, stride_oh, stride_wh, stride_wv, stride_yt,
                             BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """out[t, h*DV + v] = sum_l o[t, h, l] * w[h, v, l] for the BLOCK_T rows and BLOCK_V value rows of program
    (h, v block, t block): [BLOCK_T, L] x [L, BLOCK_V] on tensor cores, L in BLOCK_K steps; the first step's
    weight tile is loaded before the PDL wait."""
    h = tl.program_id(0).to(tl.int64)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    v_mask, t_mask = offs_v < DV, offs_t < T
    w_ptrs = w_ptr + h * stride_wh + offs_v[None, :] * stride_wv + offs_k[:, None]  # [BLOCK_K, BLOCK_V]: w[h]^T
    o_ptrs = o_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_k[None, :]
    w = tl.load(w_ptrs, mask=(offs_k < L)[:, None] & v_mask[None, :], other=0.0)  # before the wait: a weight
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k0 in range(0, L, BLOCK_K):
        k_mask = (k0 + offs_k) < L
        if k0 > 0:
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & v_mask[None, :], other=0.0)
        o = tl.load(o_ptrs + k0, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(o, w, acc, input_precision="ieee" if o.dtype == tl.float32 else "tf32")
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + h * DV + offs_v[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])


# the tensor-core forms' tiles: BLOCK_T rows a program; the K-up's [Dn, 64] weight tile, the V-up's 64 value
# rows in 64-wide latent steps
_MMA_BLOCK_T = 64
_MMA_ABSORB_BLOCK_L = 64
_MMA_VALUE_UP_BLOCK_V = 64
_MMA_VALUE_UP_BLOCK_K = 64
_MMA_MAX_DN = 256  # the K-up holds all of Dn in one tile (DeepSeek: 128); a larger Dn takes the reference


def _check(x: torch.Tensor, w: torch.Tensor, name: str, w_dim: int) -> None:
    """x [T, H, K] against w [H, ., .] whose axis w_dim is K: same heads, same dtype, unit last strides."""
    if not (x.dim() == 3 and w.dim() == 3 and x.shape[1] == w.shape[0] and x.shape[2] == w.shape[w_dim]
            and x.dtype == w.dtype and x.stride(2) == 1 and w.stride(2) == 1):
        raise ValueError(f"{name} needs x [T, H, K] and w [H, ., .] sharing H, K, dtype, with unit last strides; "
                         f"got x {tuple(x.shape)} {x.dtype} strides {x.stride()}, w {tuple(w.shape)} {w.dtype} "
                         f"strides {w.stride()}")


def _form(x: torch.Tensor, w: torch.Tensor, max_rows: int, mma_rows: int, name: str, w_dim: int) -> str:
    """"rows" (1 <= T <= max_rows: the row-loop kernel), "mma" (max_rows < T <= mma_rows: tensor-core tiles),
    else "ref"; a Triton form's inputs are checked (_check)."""
    rows = x.shape[0]
    form = "rows" if 0 < rows <= max_rows else "mma" if max_rows < rows <= mma_rows else "ref"
    if form != "ref":
        require_triton()
        _check(x, w, name, w_dim)
    return form


def mla_absorb_triton(q_nope: torch.Tensor, w_uk: torch.Tensor, *, pdl: bool = False,
                      max_rows: int = MAX_ROWS, mma_rows: int = 0) -> torch.Tensor:
    """mla_absorb_ref's q_lat, contiguous [T, H, L], by the Triton kernels for T <= max(max_rows, mma_rows)
    (else the ref)."""
    form = _form(q_nope, w_uk, max_rows, mma_rows if w_uk.shape[1] <= _MMA_MAX_DN else 0, "mla_absorb_triton", 1)
    if form == "ref":
        return mla_absorb_ref(q_nope, w_uk)
    num_tokens = q_nope.shape[0]
    heads, dn, lat = w_uk.shape
    out = torch.empty(num_tokens, heads, lat, dtype=q_nope.dtype, device=q_nope.device)
    strides = (q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1), out.stride(0), out.stride(1))
    if form == "mma":
        block_l, block_t = min(_MMA_ABSORB_BLOCK_L, max(16, next_pow2(lat))), _MMA_BLOCK_T
        _mla_absorb_mma_kernel[(heads, cdiv(lat, block_l), cdiv(num_tokens, block_t))](
            q_nope, w_uk, out, num_tokens, dn, lat, *strides, BLOCK_T=block_t, BLOCK_D=max(16, next_pow2(dn)),
            BLOCK_L=block_l, num_warps=4, **pdl_args(pdl))
        return out
    block_l = min(_ABSORB_BLOCK_L, next_pow2(lat))
    _mla_absorb_kernel[(heads, cdiv(lat, block_l))](
        q_nope, w_uk, out, num_tokens, dn, lat, *strides, BLOCK_D=next_pow2(dn), BLOCK_L=block_l, num_warps=4,
        **pdl_args(pdl))
    return out


def mla_value_up_triton(o_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor | None = None, *,
                        pdl: bool = False, max_rows: int = MAX_ROWS, mma_rows: int = 0) -> torch.Tensor:
    """mla_value_up_ref's [T, H * Dv] by the Triton kernels for T <= max(max_rows, mma_rows) (else the ref),
    into `out`."""
    if out is not None:  # checked on both paths: a bad buffer is the caller's error, whichever GEMM runs
        _check(o_lat, w_uv, "mla_value_up_triton", 2)
        width = w_uv.shape[0] * w_uv.shape[1]
        if out.shape != (o_lat.shape[0], width) or out.stride(-1) != 1 or out.dtype != o_lat.dtype:
            raise ValueError(f"mla_value_up_triton: out must be [{o_lat.shape[0]}, {width}] {o_lat.dtype} with a "
                             f"unit last stride, got {tuple(out.shape)} {out.dtype}")
    form = _form(o_lat, w_uv, max_rows, mma_rows, "mla_value_up_triton", 2)
    if form == "ref":
        return mla_value_up_ref(o_lat, w_uv, out)
    num_tokens = o_lat.shape[0]
    heads, dv, lat = w_uv.shape
    if out is None:
        out = torch.empty(num_tokens, heads * dv, dtype=o_lat.dtype, device=o_lat.device)
    strides = (o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0))
    if form == "mma":
        block_v, block_t = min(_MMA_VALUE_UP_BLOCK_V, max(16, next_pow2(dv))), _MMA_BLOCK_T
        _mla_value_up_mma_kernel[(heads, cdiv(dv, block_v), cdiv(num_tokens, block_t))](
            o_lat, w_uv, out, num_tokens, dv, lat, *strides, BLOCK_T=block_t, BLOCK_V=block_v,
            BLOCK_K=min(_MMA_VALUE_UP_BLOCK_K, max(16, next_pow2(lat))), num_warps=4, **pdl_args(pdl))
        return out
    block_v = min(_VALUE_UP_BLOCK_V, next_pow2(dv))
    _mla_value_up_kernel[(heads, cdiv(dv, block_v))](
        o_lat, w_uv, out, num_tokens, dv, lat, *strides, BLOCK_V=block_v, BLOCK_L=next_pow2(lat), num_warps=4,
        **pdl_args(pdl))
    return out


__all__ = ["MAX_ROWS", "mla_absorb_ref", "mla_absorb_triton", "mla_value_up_ref", "mla_value_up_triton"]
