"""Vocabulary-parallel embedding and LM head.

Each rank holds `ceil(V / tp)` rows (the vocabulary padded to a multiple of tp). The
embedding masks ids outside its shard and all-reduces; the LM head computes its shard of
the logits and gathers them so rank 0 sees `[T, V]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer.distributed.communication import gatherer, reducer
from metainfer.distributed.parallel_state import get_tp_rank, get_tp_size
from metainfer.kernels import REF_OPS


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.reduce = reducer()
        self.forward = self._forward_sharded if self.tp_size > 1 else self._forward_whole

    def weight_loader(self, param, loaded, shard_id=None, name=""):
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, "
                             f"expected {(self.vocab_size, param.shape[1])}")
        rows = min(self.rows_per_rank, max(0, self.vocab_size - self.vocab_start))
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_start + rows])

    def _forward_whole(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def _forward_sharded(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        return self.reduce(out * in_shard.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits shard per rank, gathered along the vocabulary to rank 0 and cut to the true size.

    Only rank 0 samples, so only rank 0 gets `[T, V]`; the other ranks get their own shard
    back (they take part in the gather but their result is unused)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32, ops=REF_OPS):
        super().__init__(vocab_size, hidden_size, dtype)
        self.gather = gatherer()
        self.bind_ops(ops)
        self.forward = self.compute_logits

    def bind_ops(self, ops) -> None:
        self.matmul = ops.linear

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gather(self.matmul(hidden, self.weight, None))
        return logits[..., : self.vocab_size]
