"""Linear layers that own their tensor-parallel sharding.

Each parameter carries a `weight_loader(param, full_tensor[, shard_id])` that slices this
rank's part out of the full checkpoint tensor, so the loader needs no model knowledge.
Per-rank dims (see docs/CONTRACTS.md): column layers split the output dim, row layers the
input dim and all-reduce their output.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.distributed.communication import reducer
from metainfer.distributed.parallel_state import get_tp_rank, get_tp_size
from metainfer.kernels import REF_OPS


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    _check_shape(param, loaded, name)
    param.data.copy_(loaded)


def _load_rank_slice(param: nn.Parameter, loaded: torch.Tensor, dim: int, rank: int, size: int, name: str) -> None:
    """Copy this rank's 1/size of `loaded` along `dim` (rows: column-parallel, columns: row-parallel)."""
    part = param.shape[dim]
    if loaded.shape[dim] != part * size:
        what = "rows" if dim == 0 else "columns"
        raise ValueError(f"tensor {name!r} has {loaded.shape[dim]} {what}, expected {part * size}")
    shard = loaded.narrow(dim, rank * part, part)
    _check_shape(param, shard, name)
    param.data.copy_(shard)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by tensor_parallel_size ({b})")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, ops=REF_OPS):
        super().__init__()
        self.bind_ops(ops)
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        raise NotImplementedError

    def bind_ops(self, ops) -> None:
        """The device's GEMM (KernelOps.linear: cuBLAS, or a tuned Triton GEMV / skinny GEMM by shape)."""
        self.matmul = ops.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (MLA's latent projections, the MoE router): no split, no reduce."""

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        default_weight_loader(param, loaded, name)


class StackedLinear(LinearBase):
    """Projections of one input stacked along the output rows, each split across ranks (column-parallel)
    or replicated, so they run as one GEMM: MLA's q projection (split by heads) with its latent
    projection (replicated). `parts`: [(shard id, full rows, split)]; rows of a split part / tp per rank."""

    def __init__(self, in_features, parts: list[tuple[str, int, bool]], dtype=torch.float32, ops=REF_OPS):
        tp = get_tp_size()
        self.parts = {}
        offset = 0
        for shard_id, rows, split in parts:
            local = _divide(rows, tp, f"output features of {shard_id}") if split else rows
            self.parts[shard_id] = (offset, local, rows, split)
            offset += local
        super().__init__(in_features, offset, False, dtype, ops)

    @property
    def output_sizes(self) -> list[int]:
        return [local for _, local, _, _ in self.parts.values()]

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        if shard_id not in self.parts:
            raise ValueError(f"tensor {name!r}: stacked projection needs a shard id in {list(self.parts)}")
        offset, local, rows, split = self.parts[shard_id]
        if loaded.shape[0] != rows:
            raise ValueError(f"tensor {name!r} has {loaded.shape[0]} rows, expected {rows}")
        shard = loaded.narrow(0, self.tp_rank * local, local) if split else loaded
        dst = param.data.narrow(0, offset, local)
        _check_shape(dst, shard, name)
        dst.copy_(shard)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; no communication."""

    def __init__(self, in_features, out_features, bias=False, dtype=torch.float32, ops=REF_OPS):
        super().__init__(in_features, _divide(out_features, get_tp_size(), "output features"), bias, dtype, ops)

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        _load_rank_slice(param, loaded, 0, self.tp_rank, self.tp_size, name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers fused along the output dim (gate_up); shard_id = index."""

    def __init__(self, in_features, output_sizes: list[int], bias=False, dtype=torch.float32, ops=REF_OPS):
        for size in output_sizes:  # each part is split on its own, so each must divide
            _divide(size, get_tp_size(), "output features of a merged part")
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, dtype, ops)

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        if shard_id is None:
            raise ValueError(f"tensor {name!r}: fused gate_up needs a shard id")
        part = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if loaded.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(f"tensor {name!r} has {loaded.shape[0]} rows, expected {self.output_sizes[shard_id]}")
        shard = loaded.narrow(0, self.tp_rank * part, part)
        dst = param.data.narrow(0, offset, part)
        _check_shape(dst, shard, name)
        dst.copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are replicated when there are fewer than ranks."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, dtype=torch.float32, ops=REF_OPS):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        else:  # fewer KV heads than ranks: each rank holds one replicated KV head
            if tp % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp}) is not a multiple of num_key_value_heads "
                                 f"({num_kv_heads}); KV heads can only be replicated evenly")
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, dtype, ops)

    def kv_head_for_rank(self) -> int:
        """Index of the first global KV head this rank holds (replication when Hkv < tp)."""
        if self.total_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        return self.tp_rank * self.total_kv_heads // self.tp_size

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        d = self.head_dim
        if shard_id == "q":
            size, start, dst_off = self.num_heads * d, self.tp_rank * self.num_heads * d, 0
            expected = self.num_heads * d * self.tp_size
        elif shard_id in ("k", "v"):
            size, start = self.num_kv_heads * d, self.kv_head_for_rank() * d
            dst_off = self.num_heads * d + (0 if shard_id == "k" else self.num_kv_heads * d)
            expected = self.total_kv_heads * d
        else:
            raise ValueError(f"tensor {name!r}: fused qkv needs shard id q, k or v")
        if loaded.shape[0] != expected:
            raise ValueError(f"tensor {name!r} has {loaded.shape[0]} rows, expected {expected}")
        dst = param.data.narrow(0, dst_off, size)
        shard = loaded.narrow(0, start, size)
        _check_shape(dst, shard, name)
        dst.copy_(shard)


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial outputs all-reduced; bias added once."""

    def __init__(self, in_features, out_features, bias=False, dtype=torch.float32, ops=REF_OPS):
        super().__init__(_divide(in_features, get_tp_size(), "input features"), out_features, bias, dtype, ops)
        self.reduce = reducer()

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        if param.dim() == 1:  # bias: full on every rank, added after the reduce
            default_weight_loader(param, loaded, name)
            return
        _load_rank_slice(param, loaded, 1, self.tp_rank, self.tp_size, name)

    def bind_ops(self, ops) -> None:
        """Also the SiLU-and-mul -> GEMM of the MLP's down projection (folded into the GEMV where tuned)."""
        super().bind_ops(ops)
        self.silu_matmul = ops.silu_mul_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.matmul(x, self.weight, None))
        return y if self.bias is None else y + self.bias

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)): the SwiGLU activation folded into this layer's GEMM."""
        y = self.reduce(self.silu_matmul(gate_up, self.weight, None))
        return y if self.bias is None else y + self.bias
