"""DeepSeek-V2 (and -Lite): multi-head latent attention (MLA) and a DeepSeek MoE on every layer from
`first_k_dense_replace` on (every `moe_layer_freq`-th), the dense SwiGLU MLP before.

MLA per token: q from `q_proj` (or the q-LoRA chain q_a_proj -> q_a_layernorm -> q_b_proj), split per head
into a non-rotary part (qk_nope_head_dim) and a rotary part (qk_rope_head_dim); `kv_a_proj_with_mqa` gives
the latent c (kv_lora_rank, then kv_a_layernorm) and one shared k_pe (rotary, interleaved pairs as
transformers applies them). The cache keeps [c, k_pe] per token (attention/mla.py); kv_b_proj's per-head
K-up and V-up halves are applied by the backend, absorbed. The softmax scale carries YaRN's mscale^2
(ModelSpec.attention_scale). Tensor parallelism: heads split (q, kv_b, o), the latent replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer.config import ModelSpec
from metainfer.distributed.parallel_state import get_tp_size
from metainfer.layers.attention import LatentAttention
from metainfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, StackedLinear
from metainfer.layers.norm import RMSNorm
from metainfer.layers.rotary import RotaryEmbedding
from metainfer.models.decoder import CausalLM, DecoderLayer, mlp_for_layer

# transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, spec: ModelSpec, ops, attn_backend, dtype, rotary: RotaryEmbedding):
        super().__init__()
        heads, hidden, bias = spec.num_heads, spec.hidden_size, bool(spec.raw.get("attention_bias", False))
        self.num_heads = heads // get_tp_size()
        self.qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        self.kv_lora_rank = spec.kv_lora_rank
        self.q_lora = spec.q_lora_rank is not None
        # the two projections of the hidden state (q or q-LoRA's down-projection, and the latent) as one
        # GEMM; with biases (attention_bias) they stay apart
        q_rows = spec.q_lora_rank if self.q_lora else heads * self.qk_head_dim
        self.fused = not bias
        if self.fused:
            self.fused_qkv_a_proj = StackedLinear(hidden, [("q", q_rows, not self.q_lora),
                                                           ("kv_a", spec.latent_dim, False)], dtype=dtype, ops=ops)
            self.split_sizes = self.fused_qkv_a_proj.output_sizes
        elif self.q_lora:
            self.q_a_proj = ReplicatedLinear(hidden, spec.q_lora_rank, bias=bias, dtype=dtype, ops=ops)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.qk_head_dim, dtype=dtype, ops=ops)
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS, ops, dtype)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, heads * self.qk_head_dim, dtype=dtype, ops=ops)
        if not self.fused:
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, spec.latent_dim, bias=bias, dtype=dtype, ops=ops)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS, ops, dtype)
        self.kv_b_proj = ColumnParallelLinear(spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim),
                                              dtype=dtype, ops=ops)
        self.o_proj = RowParallelLinear(heads * spec.v_head_dim, hidden, bias=bias, dtype=dtype, ops=ops)
        self.rotary_emb = rotary  # the model's one cos/sin table (CausalLM.shared_rotary)
        # the backend applies kv_a_layernorm and the rotary inside its latent store (attention/mla.py)
        self.attn = LatentAttention(attn_backend, spec.attention_scale, self.rotary_emb, self.kv_b_proj,
                                    self.kv_a_layernorm, self.num_heads, spec.qk_nope_head_dim, spec.v_head_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused:
            q, latent = self.fused_qkv_a_proj(hidden).split(self.split_sizes, dim=-1)
        else:
            q = self.q_a_proj(hidden) if self.q_lora else self.q_proj(hidden)
            latent = self.kv_a_proj_with_mqa(hidden)  # [T, L + R]: c, then k_pe
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        out = self.attn(q.view(-1, self.num_heads, self.qk_head_dim), latent, None)
        return self.o_proj(out)


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, spec: ModelSpec, *args, **kwargs):
        if not spec.raw.get("attention_bias"):  # the stacked q / latent projection (MLAAttention)
            self.packed_modules_mapping = {**CausalLM.packed_modules_mapping, "q_proj": ("fused_qkv_a_proj", "q"),
                                           "q_a_proj": ("fused_qkv_a_proj", "q"),
                                           "kv_a_proj_with_mqa": ("fused_qkv_a_proj", "kv_a")}
        super().__init__(spec, *args, **kwargs)

    def make_layer(self, index: int) -> DecoderLayer:
        spec, ops, dtype = self.spec, self.ops, self.dtype
        rotary = self.shared_rotary(spec.qk_rope_head_dim, spec.qk_rope_head_dim)
        return DecoderLayer(MLAAttention(spec, ops, self.attn_backend, dtype, rotary),
                            mlp_for_layer(spec, index, ops, dtype), spec, ops, dtype)
