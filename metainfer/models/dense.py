"""Dense decoder family: Qwen3, Qwen2 and Llama, switched by ModelSpec fields.

Qwen3 = per-head q/k RMSNorm, no qkv bias; Qwen2 = qkv bias; Llama = neither (rope
scaling "llama3" handled by the rotary cache). All use neox rotary, GQA and SwiGLU.
`DenseAttention` is also Qwen3-MoE's attention (models/qwen3_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import ModelSpec
from metainfer.layers.attention import Attention
from metainfer.layers.linear import QKVParallelLinear, RowParallelLinear
from metainfer.layers.mlp import GatedMLP
from metainfer.layers.norm import RMSNorm
from metainfer.layers.rotary import RotaryEmbedding
from metainfer.models.decoder import CausalLM, DecoderLayer


class DenseAttention(nn.Module):
    def __init__(self, spec: ModelSpec, ops, attn_backend, dtype, rotary: RotaryEmbedding):
        super().__init__()
        d = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias, dtype=dtype, ops=ops)
        self.q_size, self.kv_size = self.qkv_proj.num_heads * d, self.qkv_proj.num_kv_heads * d
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias=False, dtype=dtype, ops=ops)
        self.rotary_emb = rotary  # the model's one cos/sin table (CausalLM.shared_rotary)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, ops, dtype)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, ops, dtype)
        # the backend applies q/k norm (Qwen3) and rotary inside its K/V store (attention/paged.py)
        self.attn = Attention(attn_backend, spec.attention_scale, self.rotary_emb, getattr(self, "q_norm", None),
                              getattr(self, "k_norm", None), spec.rms_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class DenseForCausalLM(CausalLM):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        **CausalLM.packed_modules_mapping,
    }

    def make_layer(self, index: int) -> DecoderLayer:
        spec, ops, dtype = self.spec, self.ops, self.dtype
        rotary = self.shared_rotary(spec.head_dim, spec.rotary_dim)
        return DecoderLayer(DenseAttention(spec, ops, self.attn_backend, dtype, rotary),
                            GatedMLP(spec.hidden_size, spec.intermediate_size, ops, dtype), spec, ops, dtype)
