"""Dense decoder family: Qwen3, Qwen2 and Llama, switched by ModelSpec fields.

Qwen3 = per-head q/k RMSNorm, no qkv bias; Qwen2 = qkv bias; Llama = neither (rope
scaling "llama3" handled by the rotary cache). All use neox rotary, GQA and SwiGLU.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import ModelSpec
from metainfer.layers.attention import Attention, get_attention_metadata
from metainfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from metainfer.layers.norm import RMSNorm
from metainfer.layers.rotary import RotaryEmbedding


class DenseAttention(nn.Module):
    def __init__(self, spec: ModelSpec, ops, dtype, max_position: int):
        super().__init__()
        d = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias=False, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(d, spec.rotary_dim, max_position, spec.rope_theta,
                                          spec.rope_scaling, ops)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5, ops)
        self.qk_norm = spec.qk_norm
        self.eps = spec.rms_norm_eps
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, ops, dtype)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, ops, dtype)
        self._prep = ops.qk_norm_rope_store

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, norm):
        """(o_proj output, residual): `norm` (the layer's input RMSNorm) is applied through
        qkv_proj.forward_normed (its own kernel, or folded into the GEMV where the op set says so)."""
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        attn, meta = self.attn, get_attention_metadata()
        if not meta.is_prefill:  # per-head q/k RMSNorm (Qwen3), rotary, K/V store and attention in one op
            return self.o_proj(attn.decode_qkv(qkv, positions, self.rotary_emb.cos_sin_cache, q_w, k_w,
                                               self.eps)), residual
        # prefill: one fused op for per-head q/k RMSNorm -> rotary -> K/V into the paged cache (q
        # comes back normed and rotated as a view of qkv), then attention reads the cache
        q, _, _ = self._prep(qkv, positions, self.rotary_emb.cos_sin_cache, q_w, k_w, self.eps,
                             attn.k_cache, attn.v_cache, meta.slot_mapping,
                             self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn.attend(q)), residual


class DenseMLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops, dtype):
        super().__init__()
        i = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [i, i], bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(i, spec.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual): `norm` is applied through gate_up_proj.forward_normed, SiLU-and-mul
        through down_proj.forward_gated (folded into the GEMVs where the op set says so)."""
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj.forward_gated(gate_up), residual


class DenseDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, ops, dtype, max_position: int):
        super().__init__()
        self.self_attn = DenseAttention(spec, ops, dtype, max_position)
        self.mlp = DenseMLP(spec, ops, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)

    def forward(self, positions, hidden, residual):
        """Residual flow: residual carries the un-normed stream (None before the first layer: the
        embedding is the stream); hidden is the block output. Each norm is applied by the linear
        after it (LinearBase.forward_normed), which hands back the updated stream."""
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class DenseModel(nn.Module):
    def __init__(self, spec: ModelSpec, ops, dtype, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype)
        self.layers = nn.ModuleList(DenseDecoderLayer(spec, ops, dtype, max_position)
                                    for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DenseForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that are legitimately not parameters here
    ignored_checkpoint_keys = ("rotary_emb.inv_freq",)

    def __init__(self, spec: ModelSpec, ops, dtype=torch.float32, max_position: int | None = None):
        super().__init__()
        max_position = max(max_position or 0, spec.max_position_embeddings)
        self.spec = spec
        self.model = DenseModel(spec, ops, dtype, max_position)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
