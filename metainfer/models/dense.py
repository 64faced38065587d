"""Dense decoder family: Qwen3, Qwen2 and Llama, switched by ModelSpec fields.

Qwen3 = per-head q/k RMSNorm, no qkv bias; Qwen2 = qkv bias; Llama = neither (rope
scaling "llama3" handled by the rotary cache). All use neox rotary, GQA and SwiGLU.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import ModelSpec
from metainfer.layers.attention import Attention
from metainfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from metainfer.layers.norm import RMSNorm
from metainfer.layers.rotary import RotaryEmbedding


class DenseAttention(nn.Module):
    def __init__(self, spec: ModelSpec, ops, attn_backend, dtype, max_position: int):
        super().__init__()
        d = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias, dtype=dtype, ops=ops)
        self.q_size, self.kv_size = self.qkv_proj.num_heads * d, self.qkv_proj.num_kv_heads * d
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias=False, dtype=dtype, ops=ops)
        self.rotary_emb = RotaryEmbedding(d, spec.rotary_dim, max_position, spec.rope_theta,
                                          spec.rope_scaling, ops)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, ops, dtype)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, ops, dtype)
        # the backend applies q/k norm (Qwen3) and rotary inside its K/V store (attention/paged.py)
        self.attn = Attention(attn_backend, d ** -0.5, self.rotary_emb, getattr(self, "q_norm", None),
                              getattr(self, "k_norm", None), spec.rms_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class DenseMLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops, dtype):
        super().__init__()
        i = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [i, i], bias=False, dtype=dtype, ops=ops)
        self.down_proj = RowParallelLinear(i, spec.hidden_size, bias=False, dtype=dtype, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul is applied by down_proj.forward_gated (folded into its GEMV where the op set says so)."""
        return self.down_proj.forward_gated(self.gate_up_proj(x))


class DenseDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, ops, attn_backend, dtype, max_position: int):
        super().__init__()
        self.self_attn = DenseAttention(spec, ops, attn_backend, dtype, max_position)
        self.mlp = DenseMLP(spec, ops, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)

    def forward(self, hidden, residual):
        """Residual flow: residual carries the un-normed stream (None before the first layer: the
        embedding is the stream); hidden is the block output. The fused add+norm hands back both."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DenseModel(nn.Module):
    def __init__(self, spec: ModelSpec, ops, attn_backend, dtype, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype)
        self.layers = nn.ModuleList(DenseDecoderLayer(spec, ops, attn_backend, dtype, max_position)
                                    for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Positions reach the attention backend through the forward context (AttentionMetadata)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
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

    def __init__(self, spec: ModelSpec, ops, attn_backend=None, dtype=torch.float32, max_position: int | None = None):
        """`attn_backend` None builds a model for shape and loading checks only (it cannot attend)."""
        super().__init__()
        max_position = max(max_position or 0, spec.max_position_embeddings)
        self.spec = spec
        self.model = DenseModel(spec, ops, attn_backend, dtype, max_position)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype, ops)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
