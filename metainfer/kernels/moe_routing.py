"""MoE routing in Triton: softmax top-k over router logits, and the whole decode-sized router (GEMM + routing).

Contracts (the math of kernels/moe_ref.py, docs/CONTRACTS.md "MoE"):
- `route_topk_triton(router_logits f32[T,E], top_k, method, n_group, topk_group, renormalize, scaling,
  *, pdl=False)`: route_topk_ref in one launch for `greedy`, K <= 8, E <= 256 (ties: the lowest
  expert id); other methods and sizes call route_topk_ref.
- `router_topk_triton(x[T,H], weight[E,H], workspace, top_k, ..., *, pdl=False)` for T <= 16:
  router_topk_ref (the router GEMM in the weight's dtype, then route_topk_ref) in one launch; E / 4
  programs compute the logits, the last to finish routes them (an acq_rel ticket counter).

Why a kernel of its own: HF's routing is softmax, topk (two kernels), renormalisation, scaling and, for
DeepSeek, shared experts appended: five to seven small launches a layer; and at decode sizes the router's
GEMM (an fp32 cast plus a two-kernel cuBLAS GEMV at T = 1) is three more.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, next_pow2, pdl_args, pdl_enter, require_triton, tl, triton
from .moe_ref import route_topk_ref


@triton.jit
def _route_rows(logits, rows, row_mask, cols, col_mask, weights_ptr, ids_ptr, num_experts, scaling,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr,
                NUM_SHARED: tl.constexpr):
    """route_topk_ref on a [BLOCK_T, E_PAD] fp32 logits tile: softmax over the experts, K rounds of argmax
    (the lowest index on a tie), the renormalisation and the scaling; then the NUM_SHARED shared experts'
    ids E.. with weight 1 (rows of TOP_K + NUM_SHARED)."""
    logits = tl.where(col_mask[None, :], logits, float("-inf"))
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = tl.math.div_rn(exp, tl.sum(exp, axis=1)[:, None])
    probs = tl.where(col_mask[None, :], probs, -1.0)  # padding experts are never chosen
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    top_i = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        idx = tl.argmax(probs, axis=1, tie_break_left=True).to(tl.int32)
        top_w = tl.where(slots[None, :] == k, best[:, None], top_w)
        top_i = tl.where(slots[None, :] == k, idx[:, None], top_i)
        total += best
        probs = tl.where(cols[None, :] == idx[:, None], -1.0, probs)
    if RENORMALIZE:
        top_w = tl.math.div_rn(top_w, total[:, None])
    top_w = top_w * scaling
    width: tl.constexpr = TOP_K + NUM_SHARED
    out = rows.to(tl.int64)[:, None] * width + slots[None, :]
    mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)
    for j in tl.static_range(NUM_SHARED):
        tl.store(weights_ptr + rows.to(tl.int64) * width + TOP_K + j, tl.full([BLOCK_T], 1.0, tl.float32),
                 mask=row_mask)
        tl.store(ids_ptr + rows.to(tl.int64) * width + TOP_K + j,
                 tl.full([BLOCK_T], 0, tl.int32) + num_experts + j, mask=row_mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_lt, scaling,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                       RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCK_T tokens a program, their logits routed by _route_rows."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    cols = tl.arange(0, E_PAD)
    col_mask = cols < num_experts
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :],
                     mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    _route_rows(logits, rows, row_mask, cols, col_mask, weights_ptr, ids_ptr, num_experts, scaling,
                TOP_K, K_PAD, BLOCK_T, RENORMALIZE, NUM_SHARED)


@triton.jit(do_not_specialize=["num_tokens"])
def _router_topk_kernel(x_ptr, w_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
                        hidden, stride_xt, stride_we, scaling,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_LOGITS: tl.constexpr,
                        RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, USE_PDL: tl.constexpr):
    """The router GEMM and the routing in one launch, for a few tokens. Program p computes the logits of
    experts [p*BLOCK_E, (p+1)*BLOCK_E) for every token (fp32 products and sums of the inputs' values; rounded
    to the weight's dtype when ROUND_LOGITS, as a 16-bit GEMM's output is) into the workspace, then takes an
    arrival ticket; the program that takes the last one routes all the logits (_route_rows) and resets the
    counter for the next launch. The memory-ordering argument is attention_decode.py's in-kernel merge:
    bar.sync, one thread's acq_rel ticket, bar.sync, then the last program's loads through L2 (.cg)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xt + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e.to(tl.int64)[:, None] * stride_we + k[None, :],
                    mask=e_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if ROUND_LOGITS:
        acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + rows[:, None] * E_PAD + e[None, :], acc, mask=row_mask[:, None] & e_mask[None, :])
    tl.debug_barrier()  # every thread's logits stores precede the counting thread's release
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:  # the last program: every program's logits are visible
        tl.debug_barrier()  # the acquire above precedes every thread's loads
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        cols = tl.arange(0, E_PAD)
        col_mask = cols < num_experts
        logits = tl.load(logits_ptr + rows[:, None] * E_PAD + cols[None, :],
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0, cache_modifier=".cg")
        _route_rows(logits, rows, row_mask, cols, col_mask, weights_ptr, ids_ptr, num_experts, scaling,
                    TOP_K, K_PAD, BLOCK_T, RENORMALIZE, NUM_SHARED)


ROUTE_MAX_K = 8
ROUTE_MAX_EXPERTS = 256


def route_topk_triton(router_logits: torch.Tensor, top_k: int, method: str = "greedy", n_group: int = 1,
                      topk_group: int = 1, renormalize: bool = False, scaling: float = 1.0, num_shared: int = 0, *,
                      pdl: bool = False):
    """route_topk_ref's (weights f32[T, K+S], ids i32[T, K+S]) in one launch for `greedy` with K <= 8 and
    E <= 256; other methods and sizes take route_topk_ref (group-limited routing: DeepSeek-V2's larger
    models, not V2-Lite). The choice is by shapes and the method (host values, fixed per model)."""
    num_tokens, num_experts = router_logits.shape
    if method != "greedy" or not 1 <= top_k <= min(ROUTE_MAX_K, num_experts) or num_experts > ROUTE_MAX_EXPERTS:
        return route_topk_ref(router_logits, top_k, method, n_group, topk_group, renormalize, scaling, num_shared)
    require_triton()
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_pad = max(16, next_pow2(num_experts))
    # decode-sized batches: a tile of the tokens there are, one warp (the K argmax rounds reduce within it)
    block_t = max(1, min(2048 // e_pad, next_pow2(num_tokens)))
    warps = 1 if block_t * e_pad <= 256 else 4
    _route_topk_kernel[(cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0), float(scaling), TOP_K=top_k,
        K_PAD=next_pow2(top_k), E_PAD=e_pad, BLOCK_T=block_t, RENORMALIZE=bool(renormalize),
        NUM_SHARED=num_shared, num_warps=warps,
        **pdl_args(pdl))
    return weights, ids


# the fused router GEMM + routing: up to this many tokens (decode batches); a [tokens, BLOCK_E, BLOCK_K] fp32
# product tile of at most _ROUTER_TILE_ELEMS, BLOCK_E experts a program (E / 4 programs read the weight)
ROUTER_FUSED_MAX_TOKENS = 16
_ROUTER_TILE_ELEMS = 8192
_ROUTER_BLOCK_E = 4


def router_fusable(num_experts: int, top_k: int, method: str) -> bool:
    """Whether router_topk_triton serves this router (the routing kernel's limits; fixed per model)."""
    return method == "greedy" and 1 <= top_k <= min(ROUTE_MAX_K, num_experts) and num_experts <= ROUTE_MAX_EXPERTS


def router_workspace(num_experts: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits scratch f32[ROUTER_FUSED_MAX_TOKENS, E_PAD], ticket counter i32[1] = 0) of one router: the
    counter is back at 0 after every launch, so the pair serves every step and CUDA-graph replay."""
    e_pad = max(16, next_pow2(num_experts))
    return (torch.zeros(ROUTER_FUSED_MAX_TOKENS, e_pad, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def router_topk_triton(x: torch.Tensor, weight: torch.Tensor, workspace: tuple[torch.Tensor, torch.Tensor],
                       top_k: int, method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                       renormalize: bool = False, scaling: float = 1.0, num_shared: int = 0, *, pdl: bool = False):
    """route_topk_ref(linear(x as weight's dtype, weight)) in one launch for up to ROUTER_FUSED_MAX_TOKENS
    tokens of a `router_fusable` router: x [T, H] (any float dtype), weight [E, H] (fp32 for the routers HF
    keeps in fp32, else the model dtype: the logits are then rounded to it, as that GEMM's output is),
    workspace from `router_workspace`. Replaces the input cast, the GEMM (two cuBLAS kernels at T = 1) and
    the routing launch of a decode step's router."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if num_tokens > ROUTER_FUSED_MAX_TOKENS or not router_fusable(num_experts, top_k, method):
        raise ValueError(f"router_topk_triton: {num_tokens} tokens (<= {ROUTER_FUSED_MAX_TOKENS}), {num_experts} "
                         f"experts (<= {ROUTE_MAX_EXPERTS}), top_k {top_k} (<= {ROUTE_MAX_K}), method {method!r}")
    if weight.shape[1] != hidden or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: [T, H] and [E, H], unit last strides")
    require_triton()
    logits, counter = workspace
    width = top_k + num_shared
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, width, dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = logits.shape[1]
    block_t = next_pow2(num_tokens)
    block_k = max(16, min(next_pow2(hidden), _ROUTER_TILE_ELEMS // (block_t * _ROUTER_BLOCK_E)))
    _router_topk_kernel[(cdiv(num_experts, _ROUTER_BLOCK_E),)](
        x, weight, logits, counter, weights, ids, num_tokens, num_experts, hidden, x.stride(0), weight.stride(0),
        float(scaling), TOP_K=top_k, K_PAD=next_pow2(top_k), E_PAD=e_pad, BLOCK_T=block_t,
        BLOCK_E=_ROUTER_BLOCK_E, BLOCK_K=block_k, ROUND_LOGITS=weight.dtype != torch.float32,
        RENORMALIZE=bool(renormalize), NUM_SHARED=num_shared, num_warps=4, **pdl_args(pdl))
    return weights, ids


__all__ = ["ROUTER_FUSED_MAX_TOKENS", "ROUTE_MAX_EXPERTS", "ROUTE_MAX_K", "route_topk_triton", "router_fusable",
           "router_topk_triton", "router_workspace"]
