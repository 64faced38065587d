"""A step's token ids and positions from its packed int32 staging fields (worker/step_inputs.py).

Contract: `step_inputs(ids i32[T], src i32[T], positions i32[T], sampled i64[S]) -> (input_ids i64[T],
positions i64[T])` with input_ids[t] = sampled[src[t]] where src[t] >= 0 (a PENDING token of async
scheduling: the previous step's sampled id, still on the device) and ids[t] otherwise.

Why a kernel: in torch this is six small launches (compare, clamp, gather, two casts, where) at the
head of every decode step's CUDA graph, each a serial ~1-2 us on the GPU before the first layer can
start (docs/PERFORMANCE.md, session 11); one launch does it all.
"""

from __future__ import annotations

import torch

from ._triton import pdl_args, pdl_enter, require_triton, tl, triton


def step_inputs_ref(ids: torch.Tensor, src: torch.Tensor, positions: torch.Tensor, sampled: torch.Tensor,
                    **_launch) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.where(src >= 0, sampled[src.clamp(min=0)], ids.long())
    return input_ids, positions.long()


# One compiled variant for every step: a fixed tile and the token count unspecialised, so no step of a
# new length compiles mid-serving (Triton would specialise on T % 16 and on the tile).
_BLOCK = 1024


@triton.jit(do_not_specialize=["num_tokens"])
def _step_inputs_kernel(ids_ptr, src_ptr, pos_ptr, sampled_ptr, out_ids_ptr, out_pos_ptr, num_tokens,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < num_tokens
    src = tl.load(src_ptr + t, mask=mask, other=-1)
    pending = src >= 0
    token = tl.load(ids_ptr + t, mask=mask, other=0).to(tl.int64)
    token = tl.where(pending, tl.load(sampled_ptr + tl.maximum(src, 0), mask=mask & pending, other=0), token)
    tl.store(out_ids_ptr + t, token, mask=mask)
    tl.store(out_pos_ptr + t, tl.load(pos_ptr + t, mask=mask, other=0).to(tl.int64), mask=mask)


def step_inputs_triton(ids: torch.Tensor, src: torch.Tensor, positions: torch.Tensor, sampled: torch.Tensor,
                       *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton()
    num_tokens = ids.shape[0]
    for name, t, dtype in (("ids", ids, torch.int32), ("src", src, torch.int32), ("positions", positions, torch.int32),
                           ("sampled", sampled, torch.int64)):
        if t.dtype != dtype or t.dim() != 1 or (name != "sampled" and t.shape[0] != num_tokens):
            raise ValueError(f"{name} must be {dtype} [{'S' if name == 'sampled' else num_tokens}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=ids.device)
    out_pos = torch.empty(num_tokens, dtype=torch.int64, device=ids.device)
    if num_tokens:
        _step_inputs_kernel[(triton.cdiv(num_tokens, _BLOCK),)](
            ids, src, positions, sampled, input_ids, out_pos, num_tokens, BLOCK=_BLOCK, num_warps=4,
            **pdl_args(pdl))
    return input_ids, out_pos
