"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention (GQA, per-head q/k RMSNorm, neox rope) with a sparse
MoE block on the layers the config names (`decoder_sparse_step`, `mlp_only_layers`: ModelSpec.moe_layers)
and the dense SwiGLU MLP elsewhere. Routing: softmax, greedy top-k, `norm_topk_prob`; no shared experts.
"""

from __future__ import annotations

from metainfer.models.decoder import DecoderLayer, mlp_for_layer
from metainfer.models.dense import DenseAttention, DenseForCausalLM


class Qwen3MoeForCausalLM(DenseForCausalLM):
    def make_layer(self, index: int) -> DecoderLayer:
        spec, ops, dtype = self.spec, self.ops, self.dtype
        rotary = self.shared_rotary(spec.head_dim, spec.rotary_dim)
        return DecoderLayer(DenseAttention(spec, ops, self.attn_backend, dtype, rotary),
                            mlp_for_layer(spec, index, ops, dtype), spec, ops, dtype)
