"""Torch references of the mixture-of-experts kernels: the CPU engine's path and the tests' oracle.

Contracts (docs/CONTRACTS.md, "MoE"):
- `route_topk(router_logits f32[T,E], top_k, method, n_group, topk_group, renormalize, scaling)
  -> (weights f32[T,K], ids i32[T,K])`: softmax over the E experts in fp32, then top-k: `greedy` over all
  experts, or `group_limited_greedy` (DeepSeek-V2): the experts split into `n_group` equal groups, a group
  scored by its best expert, top-k taken only inside the `topk_group` best groups. `renormalize`
  (norm_topk_prob) divides the K weights by their sum; `scaling` (routed_scaling_factor) multiplies them
  after that (transformers' DeepSeek-V2 applies it always; its router ignores norm_topk_prob, which is
  false in every DeepSeek-V2 config; with it true this follows vLLM: renormalise, then scale).
  `num_shared` S > 0 appends the ids E..E+S-1 (DeepSeek's shared experts, stacked after the routed ones:
  layers/moe.py) with weight 1 to every token: K + S columns.
- `fused_moe(x[T,H], w13[E,2N,H], w2[E,H,N], weights f32[T,K], ids i32[T,K]) -> y[T,H]` (x's dtype):
  y[t] = sum_k weights[t,k] * w2[e] @ (silu(g) * u), (g, u) = split(w13[e] @ x[t]), e = ids[t,k]. Rows
  0..N-1 of w13[e] are the gate projection, N..2N-1 the up projection (transformers' fused layout).
  Rounding: each GEMM's output is rounded to x's dtype (as a grouped GEMM writes it), the activation
  product too; each weighted term (the rounded down-GEMM output times its fp32 routing weight, an fp32
  product) is rounded to x's dtype; the K terms are summed in fp32 and rounded once. Ids outside [0, E)
  contribute nothing (a rank that holds a slice of the experts: none here, experts are sharded by N).
- `fused_moe_slots(x, w13, w2, weights, ids) -> ExpertSlots(out[T*K,H] in x's dtype, ids, num_experts)`: the
  same before the K-slot sum: row t*K+k holds slot k's weighted term, round(round(down GEMM) * weight) in x's
  dtype (rows of invalid ids are never read). Why x's dtype: half the bytes of fp32 slots in a bf16 model (the norm
  that sums them reads T*K*H of them; DeepSeek-V2-Lite throughput +1.2%, docs/PERFORMANCE.md run 100). HF transformers
  rounds these terms two ways: its default grouped_mm experts keep a term in the product's dtype (fp32 for
  DeepSeek-V2, whose routing weights are fp32: no rounding; bf16 for Qwen3-MoE, whose router casts them to bf16) and
  sum in it, its eager experts round each term to the model dtype and index_add them in it. So this is HF's default
  rounding for Qwen3-MoE and, for DeepSeek-V2, one rounding a term (2^-9 relative in bf16) more than HF's default and
  less than its eager path; teacher-forced agreement with HF is the check (PERFORMANCE). In an fp32 model nothing
  changes.
  `moe_sum(slots, dtype) -> y[T,H]` is the sum (in fp32 whatever the slots' dtype, rounded once to `dtype`);
  `fused_add_rms_norm_slots(slots, residual, weight, eps)` is
  `fused_add_rms_norm(moe_sum(slots, residual.dtype), residual, ...)` in one launch on the GPU (the MoE
  block at tp = 1 hands its slots to the next norm: layers/moe.py).
The Triton kernels: kernels/fused_moe.py (the norm over slots: kernels/rms_norm.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ExpertSlots(NamedTuple):
    """A fused MoE's output before the sum over each token's K slots (see the module docstring)."""

    out: torch.Tensor  # [T*K, H] in x's dtype: slot k of token t at row t*K + k, its routing weight applied
    ids: torch.Tensor  # int32 [T, K]: the slot's expert; ids outside [0, num_experts) contribute nothing
    num_experts: int


def route_topk_ref(router_logits: torch.Tensor, top_k: int, method: str = "greedy", n_group: int = 1,
                   topk_group: int = 1, renormalize: bool = False, scaling: float = 1.0, num_shared: int = 0):
    scores = router_logits.float().softmax(dim=-1)
    if method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        grouped = scores.view(num_tokens, n_group, num_experts // n_group)
        best_groups = grouped.max(dim=-1).values.topk(topk_group, dim=-1).indices
        keep = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(num_tokens, num_experts)
    elif method != "greedy":
        raise ValueError(f"unknown top-k method {method!r} (greedy, group_limited_greedy)")
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    if num_shared:
        num_tokens, num_experts = scores.shape
        shared_ids = torch.arange(num_experts, num_experts + num_shared, device=ids.device).expand(num_tokens, -1)
        ids = torch.cat([ids, shared_ids], dim=1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, num_shared)], dim=1)
    return weights, ids.to(torch.int32)



def router_topk_ref(x: torch.Tensor, weight: torch.Tensor, workspace=None, top_k: int = 1, method: str = "greedy",
                    n_group: int = 1, topk_group: int = 1, renormalize: bool = False, scaling: float = 1.0,
                    num_shared: int = 0):
    """A router whole: logits = x @ weight^T computed in the weight's dtype (fp32 for the routers HF keeps in
    fp32: x is cast up exactly), then route_topk_ref. `workspace` is the Triton kernel's scratch (unused)."""
    logits = F.linear(x.to(weight.dtype), weight)
    return route_topk_ref(logits, top_k, method, n_group, topk_group, renormalize, scaling, num_shared)

def fused_moe_slots_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> ExpertSlots:
    num_experts, n2, _ = w13.shape
    top_k = topk_ids.shape[1]
    out = torch.zeros(x.shape[0] * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < num_experts:
            continue
        token_idx, slot = torch.where(ids == expert)
        gate_up = F.linear(x[token_idx], w13[expert])
        hidden = (F.silu(gate_up[:, : n2 // 2].float()) * gate_up[:, n2 // 2:].float()).to(x.dtype)
        y = F.linear(hidden, w2[expert])
        # the down GEMM's output (rounded to x's dtype) times the weight in fp32, rounded once more
        out[token_idx * top_k + slot] = (y.float() * topk_weights[token_idx, slot, None].float()).to(x.dtype)
    return ExpertSlots(out, topk_ids.to(torch.int32), num_experts)


def moe_sum_ref(slots: ExpertSlots, dtype: torch.dtype) -> torch.Tensor:
    """y[t] = the fp32 sum of token t's slots with a valid id (slots of any float dtype), rounded once to `dtype`."""
    num_tokens, top_k = slots.ids.shape
    valid = (slots.ids >= 0) & (slots.ids < slots.num_experts)
    terms = slots.out.float().view(num_tokens, top_k, slots.out.shape[1])
    terms = torch.where(valid[..., None], terms, 0.0)  # the kernels leave invalid slots' rows unwritten (maybe NaN)
    return terms.sum(dim=1).to(dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    return moe_sum_ref(fused_moe_slots_ref(x, w13, w2, topk_weights, topk_ids), x.dtype)
