"""RMSNorm and fused residual-add + RMSNorm.

Contract (docs/CONTRACTS.md): y = w * n with n = x * rsqrt(mean(x^2) + eps), output in x's
dtype; any leading shape `[..., H]` (Qwen3's q_norm/k_norm run on `[T, heads, D]` views of
the qkv projection, so the kernels take strided rows instead of forcing a copy).
The fused variant first stores residual <- x + residual (rounded to residual's dtype, as an
unfused model would) and normalises that rounded sum. `fused_add_rms_norm_slots(slots, residual, weight,
eps)` takes a fused MoE's unsummed output (kernels/moe_ref.py: ExpertSlots, in the model's dtype) as x:
x = moe_sum(slots, residual.dtype), the fp32 sum over a token's valid slots rounded once, read in the same
launch (the MoE's sum kernel and its [T, H] round trip folded away: one launch a MoE layer fewer).

Rounding points follow HF transformers' `Qwen3RMSNorm` (`weight * hidden.to(input_dtype)`):
the mean of squares, rsqrt and n are fp32 math on the fp32-converted input, n is rounded to the
input's dtype, and the product with the weight is formed in fp32 from the two rounded values
(exact for bf16/fp16 operands) and rounded once more to the output dtype. In fp32 both roundings
are no-ops.
"""

from __future__ import annotations

import torch

from ._triton import next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .moe_ref import ExpertSlots, moe_sum_ref

# ----------------------------------------------------------------------------------------------
# torch reference (the CPU path)
# ----------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    normed = (xf * inv_rms).to(x.dtype)  # HF: hidden_states.to(input_dtype)
    return (weight.float() * normed.float()).to(x.dtype)  # HF: weight * normed, in the dtype


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x.float() + residual.float()).to(residual.dtype)
    residual.copy_(summed)
    return rms_norm_ref(residual, weight, eps).to(x.dtype), residual


def fused_add_rms_norm_slots_ref(
    slots: ExpertSlots, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_ref(moe_sum_ref(slots, residual.dtype), residual, weight, eps)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


# n_rows changes with every prefill's token count: not specialised (no recompile per size class)
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, y_ptr, w_ptr, ids_ptr,
    n_rows, inner_rows, hidden, eps, num_experts,
    x_stride0, x_stride1, r_stride0, r_stride1, y_stride0, y_stride1,
    HAS_RESIDUAL: tl.constexpr, SLOTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Rows are addressed as (outer, inner) of a [outer, inner, H] view so that strided views
    # (e.g. per-head slices of a fused qkv tensor) need no copy. SLOTS: x is a fused MoE's slots [n_rows * TOP_K, H]
    # (row stride x_stride0) in the model's dtype (any float dtype), summed in fp32 over each row's slots with a
    # valid id (0 if TOP_K is 0).
    pdl_enter(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    outer = rows // inner_rows
    inner = rows % inner_rows
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    mask = row_mask[:, None] & col_mask[None, :]

    if SLOTS:
        x = tl.zeros([BLOCK_ROWS, BLOCK_H], tl.float32)
        for k in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + rows * TOP_K + k, mask=row_mask, other=-1)
            valid = (expert >= 0) & (expert < num_experts)
            x += tl.load(x_ptr + (rows * TOP_K + k)[:, None] * x_stride0 + cols[None, :],
                         mask=mask & valid[:, None], other=0.0).to(tl.float32)
        x = x.to(res_ptr.dtype.element_ty).to(tl.float32)  # the MoE output's one rounding (its sum kernel's)
    else:
        x_off = (outer * x_stride0 + inner * x_stride1)[:, None] + cols[None, :]
        x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_off = (outer * r_stride0 + inner * r_stride1)[:, None] + cols[None, :]
        summed = (x + tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32))
        summed = summed.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + r_off, summed, mask=mask)
        x = summed.to(tl.float32)

    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # HF's rounding points: n rounded to the normalised input's dtype, then w * n rounded on store
    if HAS_RESIDUAL:
        normed = (x * inv_rms[:, None]).to(res_ptr.dtype.element_ty).to(tl.float32)
    else:
        normed = (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = w[None, :] * normed
    y_off = (outer * y_stride0 + inner * y_stride1)[:, None] + cols[None, :]
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """View `[..., H]` as `[outer, inner, H]` without copying (raises if impossible)."""
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.view(-1, 1, t.shape[-1])


def _launch_rms_norm(x, residual, weight, eps, pdl, slots: ExpertSlots | None = None):
    require_triton()
    if slots is not None:  # x: the slots' [T*K, H] rows (any float dtype), read by token; the shapes: the residual's
        num_tokens, top_k = slots.ids.shape
        if (slots.out.dim() != 2 or slots.out.shape[0] != num_tokens * top_k or slots.out.stride(-1) != 1
                or not slots.out.dtype.is_floating_point
                or residual.dim() != 2 or residual.shape != (num_tokens, slots.out.shape[1])):
            raise ValueError(f"slots out {tuple(slots.out.shape)} {slots.out.dtype} / ids {tuple(slots.ids.shape)} "
                             f"do not fit the residual {tuple(residual.shape)}")
        x = residual
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    if x.stride(-1) != 1 or (x.dim() > 3 and not x.is_contiguous()):
        x = x.contiguous()
    x3 = _rows_view(x)
    r3 = x3
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.stride(-1) != 1:
            raise ValueError("residual must have a unit last stride (it is updated in place)")
        r3 = _rows_view(residual)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y3 = _rows_view(y)
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows == 0:
        return y
    top_k = 0 if slots is None else slots.ids.shape[1]
    source, ids = (x3, y3) if slots is None else (slots.out, slots.ids.contiguous())
    source_strides = (x3.stride(0), x3.stride(1)) if slots is None else (slots.out.stride(0), 0)

    block_h = next_pow2(hidden)
    if block_h > 65536:
        raise ValueError(f"hidden size {hidden} too large for the single-pass RMSNorm kernel")
    # Several short rows per program (head-wise norms, D=128) so each program moves ~4K elements.
    block_rows = max(1, min(64, 4096 // block_h))
    num_warps = max(1, min(16, block_rows * block_h // 512))
    grid = (triton.cdiv(n_rows, block_rows),)
    _rms_norm_kernel[grid](
        source, r3, y3, weight, ids,
        n_rows, x3.shape[1], hidden, float(eps), 0 if slots is None else slots.num_experts,
        *source_strides, r3.stride(0), r3.stride(1), y3.stride(0), y3.stride(1),
        HAS_RESIDUAL=residual is not None, SLOTS=slots is not None, TOP_K=top_k, BLOCK_ROWS=block_rows,
        BLOCK_H=block_h,
        num_warps=num_warps, **pdl_args(pdl),
    )
    return y


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False) -> torch.Tensor:
    """`pdl`: launch with programmatic dependent launch (kernels/_triton.py: pdl_enter)."""
    return _launch_rms_norm(x, None, weight, eps, pdl)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_rms_norm(x, residual, weight, eps, pdl), residual


def fused_add_rms_norm_slots_triton(
    slots: ExpertSlots, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_slots_ref's result in one launch (the module docstring)."""
    return _launch_rms_norm(None, residual, weight, eps, pdl, slots), residual
