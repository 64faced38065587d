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


def _check(x: torch.Tensor, w: torch.Tensor, name: str, w_dim: int) -> None:
    """x [T, H, K] against w [H, ., .] whose axis w_dim is K: same heads, same dtype, unit last strides."""
    if not (x.dim() == 3 and w.dim() == 3 and x.shape[1] == w.shape[0] and x.shape[2] == w.shape[w_dim]
            and x.dtype == w.dtype and x.stride(2) == 1 and w.stride(2) == 1):
        raise ValueError(f"{name} needs x [T, H, K] and w [H, ., .] sharing H, K, dtype, with unit last strides; "
                         f"got x {tuple(x.shape)} {x.dtype} strides {x.stride()}, w {tuple(w.shape)} {w.dtype} "
                         f"strides {w.stride()}")


def _takes_triton(x: torch.Tensor, w: torch.Tensor, max_rows: int, name: str, w_dim: int) -> bool:
    """1 <= T <= max_rows: the Triton kernel, its inputs checked (_check); else the reference."""
    if not 0 < x.shape[0] <= max_rows:
        return False
    require_triton()
    _check(x, w, name, w_dim)
    return True


def mla_absorb_triton(q_nope: torch.Tensor, w_uk: torch.Tensor, *, pdl: bool = False,
                      max_rows: int = MAX_ROWS) -> torch.Tensor:
    """mla_absorb_ref's q_lat, contiguous [T, H, L], by the Triton kernel for T <= max_rows (else the ref)."""
    if not _takes_triton(q_nope, w_uk, max_rows, "mla_absorb_triton", 1):
        return mla_absorb_ref(q_nope, w_uk)
    num_tokens = q_nope.shape[0]
    heads, dn, lat = w_uk.shape
    out = torch.empty(num_tokens, heads, lat, dtype=q_nope.dtype, device=q_nope.device)
    block_l = min(_ABSORB_BLOCK_L, next_pow2(lat))
    _mla_absorb_kernel[(heads, cdiv(lat, block_l))](
        q_nope, w_uk, out, num_tokens, dn, lat, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
        out.stride(0), out.stride(1), BLOCK_D=next_pow2(dn), BLOCK_L=block_l, num_warps=4, **pdl_args(pdl))
    return out


def mla_value_up_triton(o_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor | None = None, *,
                        pdl: bool = False, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """mla_value_up_ref's [T, H * Dv] by the Triton kernel for T <= max_rows (else the ref), into `out`."""
    if out is not None:  # checked on both paths: a bad buffer is the caller's error, whichever GEMM runs
        _check(o_lat, w_uv, "mla_value_up_triton", 2)
        width = w_uv.shape[0] * w_uv.shape[1]
        if out.shape != (o_lat.shape[0], width) or out.stride(-1) != 1 or out.dtype != o_lat.dtype:
            raise ValueError(f"mla_value_up_triton: out must be [{o_lat.shape[0]}, {width}] {o_lat.dtype} with a "
                             f"unit last stride, got {tuple(out.shape)} {out.dtype}")
    if not _takes_triton(o_lat, w_uv, max_rows, "mla_value_up_triton", 2):
        return mla_value_up_ref(o_lat, w_uv, out)
    num_tokens = o_lat.shape[0]
    heads, dv, lat = w_uv.shape
    if out is None:
        out = torch.empty(num_tokens, heads * dv, dtype=o_lat.dtype, device=o_lat.device)
    block_v = min(_VALUE_UP_BLOCK_V, next_pow2(dv))
    _mla_value_up_kernel[(heads, cdiv(dv, block_v))](
        o_lat, w_uv, out, num_tokens, dv, lat, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1),
        out.stride(0), BLOCK_V=block_v, BLOCK_L=next_pow2(lat), num_warps=4, **pdl_args(pdl))
    return out


__all__ = ["MAX_ROWS", "mla_absorb_ref", "mla_absorb_triton", "mla_value_up_ref", "mla_value_up_triton"]
