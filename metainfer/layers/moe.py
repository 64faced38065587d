"""Mixture-of-experts block: router, the routed experts as two stacked weights, optional shared experts.

Tensor parallelism shards every expert by its intermediate size (N/tp rows of gate and up, N/tp
columns of down on each rank), like a row/column-parallel MLP: each rank computes a partial sum of
every token's experts and the block all-reduces once, routed and shared parts together. The router is
replicated. Expert parallelism (whole experts per rank, tokens exchanged all-to-all) is the other
split: docs/CONTRACTS.md says what it would take.

DeepSeek's shared experts (one SwiGLU MLP of S * N intermediate channels) are S more stacked experts,
E..E+S-1, that the router appends to every token's choice with weight 1: an MLP's channels split in S
groups of N is the sum of S MLPs of N channels, so the fused MoE computes the shared part in the same
grouped GEMMs (no separate launches for it), and the block reduces once.

Checkpoint layouts: the hub's one tensor per expert (`experts.{i}.gate_proj.weight` [N, H],
`up_proj` [N, H], `down_proj` [H, N]) and transformers' fused one (`experts.gate_up_proj` [E, 2N, H],
`experts.down_proj` [E, H, N]); both load into the same parameters.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from metainfer.distributed.communication import reducer
from metainfer.distributed.parallel_state import get_tp_rank, get_tp_size
from metainfer.kernels.moe_ref import ExpertSlots
from metainfer.kernels.moe_routing import ROUTER_FUSED_MAX_TOKENS, router_fusable, router_workspace
from metainfer.layers.linear import ReplicatedLinear

_EXPERT_TENSOR = re.compile(r"\.(?:experts\.(\d+)|shared_experts)\.(gate|up|down)_proj\.weight$")


def expert_checkpoint_name(name: str) -> tuple[str, tuple[int | str, str]] | None:
    """A per-expert (or shared-experts) checkpoint name -> (the stacked parameter's name, (expert or
    "shared", part)); None otherwise."""
    match = _EXPERT_TENSOR.search(name)
    if match is None:
        return None
    stacked = "gate_up_proj" if match.group(2) in ("gate", "up") else "down_proj"
    expert = "shared" if match.group(1) is None else int(match.group(1))
    return name[: match.start()] + f".experts.{stacked}", (expert, match.group(2))


class FusedExperts(nn.Module):
    """E routed + S shared SwiGLU experts: gate_up_proj [E+S, 2N_r, H] (gate rows, then up rows), down_proj
    [E+S, H, N_r], N_r = moe_intermediate_size / tp. forward(x, weights, ids) runs them in one fused MoE call."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops, dtype, num_shared: int = 0):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({self.tp_size})")
        self.num_experts, self.num_shared, self.full_n = num_experts, num_shared, intermediate_size
        n, total = intermediate_size // self.tp_size, num_experts + num_shared
        self.gate_up_proj = nn.Parameter(torch.empty(total, 2 * n, hidden_size, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(total, hidden_size, n, dtype=dtype), requires_grad=False)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = functools.partial(self._load, parts=parts)
            param.expected_shards = tuple((e, p) for e in range(total) for p in parts)
        self.bind_ops(ops)

    def bind_ops(self, ops) -> None:
        self._fused_moe, self._fused_moe_slots = ops.fused_moe, ops.fused_moe_slots

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self._fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def slots(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> ExpertSlots:
        """The same before the sum over each token's K slots (kernels/moe_ref.py: ExpertSlots)."""
        return self._fused_moe_slots(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def _load(self, param, loaded, shard_id=None, name="", parts=()):
        """One expert's tensor (shard_id (expert, part)) or the fused [E, ...] tensor (shard_id None);
        returns the shard ids it filled."""
        full = self.full_n
        if shard_id is None:  # transformers' fused layout
            want = (self.num_experts, full * len(parts), param.shape[2]) if parts != ("down",) else \
                (self.num_experts, param.shape[1], full)
            if tuple(loaded.shape) != want:
                raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {want}")
            for e in range(self.num_experts):
                for part in parts:
                    index = parts.index(part)
                    rows = loaded[e, index * full:(index + 1) * full] if part != "down" else loaded[e]
                    self._copy_part(param, e, part, rows, name)
            return tuple((e, p) for e in range(self.num_experts) for p in parts)
        expert, part = shard_id
        if expert == "shared":  # [S*N, H] gate/up or [H, S*N] down: S experts of N channels each
            return self._load_shared(param, loaded, part, name)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"tensor {name!r}: expert {expert} out of range (num_experts {self.num_experts})")
        want = (param.shape[1], full) if part == "down" else (full, param.shape[2])
        if tuple(loaded.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {want}")
        self._copy_part(param, expert, part, loaded, name)
        return None

    def _load_shared(self, param, loaded, part: str, name: str):
        full, shared = self.full_n, self.num_shared
        want = (param.shape[1], shared * full) if part == "down" else (shared * full, param.shape[2])
        if tuple(loaded.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {want}")
        for j in range(shared):
            channels = loaded[:, j * full:(j + 1) * full] if part == "down" else loaded[j * full:(j + 1) * full]
            self._copy_part(param, self.num_experts + j, part, channels, name)
        return tuple((self.num_experts + j, part) for j in range(shared))

    def _copy_part(self, param, expert: int, part: str, full_tensor: torch.Tensor, name: str) -> None:
        """This rank's slice of one expert's [N, H] gate/up or [H, N] down tensor into its place."""
        n = self.full_n // self.tp_size
        start = self.tp_rank * n
        if part == "down":
            param.data[expert].copy_(full_tensor[:, start:start + n])
        else:
            offset = 0 if part == "gate" else n
            param.data[expert, offset:offset + n].copy_(full_tensor[start:start + n])


class TopKRouter(ReplicatedLinear):
    """Router logits (a replicated GEMM; fp32 weight and math where the family keeps them fp32) -> the
    K routing weights (fp32) and expert ids of every token, then the S shared experts' ids with weight 1
    (kernels/moe_ref.py: route_topk). A decode-sized batch (<= ROUTER_FUSED_MAX_TOKENS tokens) of a greedy
    router takes `router_topk`, GEMM and routing in one launch (the step's shape picks it, so each CUDA
    graph holds one form); larger ones the GEMM then `route_topk`."""

    def __init__(self, spec, ops, dtype):
        self.fp32 = spec.router_fp32
        self.routing = dict(top_k=spec.num_experts_per_tok, method=spec.topk_method, n_group=spec.n_group,
                            topk_group=spec.topk_group, renormalize=spec.norm_topk_prob,
                            scaling=spec.routed_scaling_factor, num_shared=spec.num_shared_experts)
        super().__init__(spec.hidden_size, spec.num_experts, bias=False,
                         dtype=torch.float32 if self.fp32 else dtype, ops=ops)
        self.fused_max_tokens = ROUTER_FUSED_MAX_TOKENS if router_fusable(
            spec.num_experts, spec.num_experts_per_tok, spec.topk_method) else 0
        logits, counter = router_workspace(spec.num_experts)  # buffers: they follow the module's device
        self.register_buffer("fused_logits", logits, persistent=False)
        self.register_buffer("fused_ticket", counter, persistent=False)

    def bind_ops(self, ops) -> None:
        super().bind_ops(ops)
        self.route = functools.partial(ops.route_topk, **self.routing)
        self.fused_route = functools.partial(ops.router_topk, **self.routing)

    def forward(self, x: torch.Tensor):
        if x.shape[0] <= self.fused_max_tokens:
            return self.fused_route(x, self.weight, (self.fused_logits, self.fused_ticket))
        logits = self.matmul(x.float() if self.fp32 else x, self.weight, None)
        return self.route(logits)


class SparseMoeBlock(nn.Module):
    """Routed (+ DeepSeek's shared) experts in one fused call, all-reduced once. Parameter names follow
    the checkpoint: `gate.weight` (router), `experts.*` (shared_experts.* load into experts E..E+S-1).

    At tp = 1 (nothing to all-reduce) the block returns the experts' unsummed slots (`returns_slots`): the
    decoder hands them to the next residual add + RMSNorm, which sums them in its own launch (one launch and a
    [T, H] round trip a layer fewer: DecoderModel wires the norm); under TP the sum comes first, then the
    all-reduce of [T, H]. Chosen here, at build."""

    def __init__(self, spec, ops, dtype):
        super().__init__()
        self.gate = TopKRouter(spec, ops, dtype)
        shared = spec.num_shared_experts
        self.experts = FusedExperts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, ops, dtype,
                                    num_shared=shared)
        for param in self.experts.parameters():  # what one token reads of them (bench/common.py's floor)
            param.active_fraction = (spec.num_experts_per_tok + shared) / (spec.num_experts + shared)
        self.reduce = reducer()
        self.returns_slots = get_tp_size() == 1

    def forward(self, x: torch.Tensor):
        """[T, H], or at tp = 1 the ExpertSlots the next norm sums."""
        weights, ids = self.gate(x)
        if self.returns_slots:
            return self.experts.slots(x, weights, ids)
        return self.reduce(self.experts(x, weights, ids))
