"""SiLU-and-mul: the gated-MLP activation on the fused gate_up projection.

Contract: x[..., 2I] -> y[..., I] with y = silu(x[..., :I]) * x[..., I:], output in x's dtype.

Rounding points follow HF transformers' `act_fn(gate_proj(x)) * up_proj(x)` in the model dtype:
s = silu(gate) in fp32 (gate / (1 + exp(-gate)), torch's formula) rounded to the dtype, then
y = s * up formed in fp32 from the two rounded values and rounded once more. In fp32 the
rounding of s is a no-op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import next_pow2, pdl_args, pdl_enter, require_triton, tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    # torch's bf16/fp16 silu computes in fp32 and rounds once: equal to this (checked exhaustively)
    act = F.silu(xf[..., :half]).to(x.dtype).float()
    return (act * xf[..., half:]).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, x_row_stride, y_row_stride, inter, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)  # HF: silu, rounded
    y = act * up
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    require_triton()
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return y
    block = min(1024, next_pow2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x2, y, x2.stride(0), inter, inter, BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl_args(pdl),
    )
    return y
