"""The decoder skeleton every family shares: embedding, N x (norm, attention, norm, MLP or MoE), norm,
LM head. A family supplies its attention and MLP per layer (models/dense.py, qwen3_moe.py, deepseek_v2.py).

Residual flow: `residual` carries the un-normed stream (None before the first layer: the embedding is the
stream); `hidden` is the block output; the fused add+norm hands back both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from metainfer.config import ModelSpec
from metainfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer.layers.mlp import GatedMLP
from metainfer.layers.moe import SparseMoeBlock, expert_checkpoint_name
from metainfer.layers.norm import RMSNorm
from metainfer.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, spec: ModelSpec, ops, dtype):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)

    def forward(self, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, ops, dtype, make_layer: Callable[[int], DecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype)
        self.layers = nn.ModuleList(make_layer(i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)
        # a MoE block that returns unsummed expert slots hands them to the norm after it (layers/moe.py)
        for layer, next_norm in zip(self.layers, [*(layer.input_layernorm for layer in self.layers[1:]), self.norm]):
            if getattr(layer.mlp, "returns_slots", False):
                next_norm.take_expert_slots(ops)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Positions reach the attention backend through the forward context (AttentionMetadata)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def mlp_for_layer(spec: ModelSpec, index: int, ops, dtype) -> nn.Module:
    """The layer's feed-forward: the MoE block on the spec's sparse layers, else the dense SwiGLU MLP."""
    if index in spec.moe_layers:
        return SparseMoeBlock(spec, ops, dtype)
    return GatedMLP(spec.hidden_size, spec.intermediate_size, ops, dtype)


class CausalLM(nn.Module):
    """A decoder with its LM head. Subclasses set `packed_modules_mapping` (checkpoint name fragment ->
    (fused parameter fragment, shard id)) and build their layers in `make_layer`."""

    packed_modules_mapping: dict = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # checkpoint tensors that are legitimately not parameters here
    ignored_checkpoint_keys = ("rotary_emb.inv_freq",)

    def __init__(self, spec: ModelSpec, ops, attn_backend=None, dtype=torch.float32, max_position: int | None = None):
        """`attn_backend` None builds a model for shape and loading checks only (it cannot attend)."""
        super().__init__()
        self.spec, self.ops, self.attn_backend, self.dtype = spec, ops, attn_backend, dtype
        self.max_position = max(max_position or 0, spec.max_position_embeddings)
        self.rotary_emb = None  # built by the first layer that asks (shared_rotary)
        self.model = DecoderModel(spec, ops, dtype, self.make_layer)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype, ops)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, index: int) -> DecoderLayer:
        raise NotImplementedError

    def shared_rotary(self, head_dim: int, rotary_dim: int) -> RotaryEmbedding:
        """The one cos/sin table every layer reads: a table per layer cost 27-48 copies of
        [max_position, rot_dim] fp32 (~1.1 GB for DeepSeek-V2-Lite's 163,840 positions)."""
        if self.rotary_emb is None:
            self.rotary_emb = RotaryEmbedding(head_dim, rotary_dim, self.max_position, self.spec.rope_theta,
                                              self.spec.rope_scaling, self.ops)
        return self.rotary_emb

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @staticmethod
    def map_checkpoint_name(name: str):
        """Per-expert tensors onto the stacked expert parameters (None: the packed mapping decides)."""
        return expert_checkpoint_name(name)
