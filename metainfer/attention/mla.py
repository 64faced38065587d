"""Multi-head latent attention (DeepSeek-V2) over a paged latent cache.

Cache per layer: `[num_blocks, block_size, L + R]` (L = kv_lora_rank, R = qk_rope_head_dim), views of one
pool `[layers, N, S, L + R]` in the KV dtype (the model's, or fp8 with a unit scale like the dense cache):
one vector per token for all heads, so DeepSeek-V2-Lite keeps 27 x 576 x 2 = 31,104 bytes a token in bf16.

A step: `store` normalises c (kv_a_layernorm), rotates q_pe and k_pe (interleaved pairs) and writes
[c, k_pe] at the slots, one fused launch (kernels/mla_prep.py). `decode` runs absorbed: q_lat = q_nope @
W_UK per head (ops.mla_absorb, kernels/mla_absorb.py), attention of [q_lat, q_pe] over the cached
[c, k_pe] with values c (kernels/mla_ref.py, kernels/mla_attention.py), then out = o_lat @ W_UV^T per head
(ops.mla_value_up) -> [T, Hr * Dv] for o_proj. `prefill` takes the form that is faster at its length (H200, run 49,
tools/bench_mla.py): absorbed below `expanded_min_q` new tokens (512: 171 vs 244 us a layer), expanded
from there (1,024: 247 vs 349 us; 8,192: 0.93 vs 12.0 ms) when every sequence of the step is a plain
prefill (`_expanded_wins`): each sequence's context latents gathered
from the cache, up-projected by kv_b_proj into per-head K (with the shared k_pe) and V, then causal SDPA
(flash attention on the GPU) with the context's end aligned to the last query.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from metainfer.attention.backend import AttentionBackend

# prefill steps whose longest sequence has at least this many new tokens take the expanded form
EXPANDED_MIN_Q = 1024


class MLABackend(AttentionBackend):
    name = "mla"

    def __init__(self, ops, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int,
                 kv_dtype: torch.dtype, device: torch.device, max_num_seqs: int, max_model_len: int,
                 block_size: int):
        """num_heads: this rank's heads (heads / tp); the latent is the same on every rank."""
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim = num_heads, kv_lora_rank, rope_dim, nope_dim
        self.kv_dtype, self.device = kv_dtype, device
        self._table_tokens = -(-max_model_len // block_size) * block_size
        self._max_num_seqs = max_num_seqs
        self.decode_workspace: torch.Tensor | None = None
        self.pool: torch.Tensor | None = None
        self.expanded_min_q = EXPANDED_MIN_Q
        self.bind_ops(ops)

    def bind_ops(self, ops) -> None:
        """The kernels; on the Triton path one split-KV scratch for every decode launch this engine can make
        (sized before the KV pool, so the memory profile sees it), so no step allocates."""
        self._prep = ops.mla_latent_prep
        self._prefill = ops.mla_prefill_attention
        self._decode = ops.mla_decode_attention
        self._absorb, self._value_up = ops.mla_absorb, ops.mla_value_up
        if ops.backend == "triton":
            if self.decode_workspace is None:
                numel = ops.mla_decode_workspace_numel(self._max_num_seqs, self.num_heads, self.kv_lora_rank,
                                                       self._table_tokens)
                self.decode_workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=self.device)
            self._decode = functools.partial(self._decode, workspace=self.decode_workspace)

    def bytes_per_block(self, num_layers: int, block_size: int) -> int:
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return num_layers * block_size * (self.kv_lora_rank + self.rope_dim) * elem

    def allocate(self, layers: list, num_blocks: int, block_size: int) -> None:
        shape = (len(layers), num_blocks, block_size, self.kv_lora_rank + self.rope_dim)
        self.pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.latent_cache = self.pool[i]

    def release(self, layers: list) -> None:
        for layer in layers:
            layer.latent_cache = torch.empty(0)
        self.pool = None

    def store(self, layer, q: torch.Tensor, latent: torch.Tensor, v, meta) -> torch.Tensor:
        """q [T, Hr, Dn+R] and latent [T, L+R] (c and k_pe as projected): [norm(c), rope(k_pe)] into the cache,
        q[..., Dn:] rotated in place. Returns q."""
        self._prep(latent, layer.norm_weight, layer.norm_eps, meta.positions, q[..., self.nope_dim:], layer.cos_sin,
                   layer.latent_cache, meta.slot_mapping)
        return q

    def prefill(self, layer, q: torch.Tensor, meta, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._expanded_wins(meta):
            return self._prefill_expanded(layer, q, meta, out)
        q_lat = self._absorb(q[..., : self.nope_dim], layer.w_uk)
        o_lat = self._prefill(q_lat, q[..., self.nope_dim:], layer.latent_cache, meta.cu_seqlens_q,
                              meta.context_lens, meta.block_tables, meta.max_seqlen_q, layer.scale,
                              plans=meta.launch_plans)
        return self._value_up(o_lat, layer.w_uv, out)

    def decode(self, layer, q: torch.Tensor, meta, out: torch.Tensor | None = None) -> torch.Tensor:
        q_lat = self._absorb(q[..., : self.nope_dim], layer.w_uk)
        o_lat = self._decode(q_lat, q[..., self.nope_dim:], layer.latent_cache, meta.block_tables,
                             meta.context_lens, layer.scale, plans=meta.launch_plans)
        return self._value_up(o_lat, layer.w_uv, out)

    def _expanded_wins(self, meta) -> bool:
        """The expanded form where it was measured faster: a step of plain prefills (no cached prefix, no
        earlier chunk) whose longest is >= expanded_min_q tokens. Steps with a chunk's continuation or a
        prefix hit stay absorbed: with them (the throughput protocol's 8,192-token steps) the expanded form
        took 6.2 s of prefill against 2.5 s absorbed (H200, runs 50-51)."""
        return (meta.seq_lens is not None and meta.max_seqlen_q >= self.expanded_min_q
                and all(q_len == ctx for q_len, ctx in meta.seq_lens))

    def _prefill_expanded(self, layer, q: torch.Tensor, meta, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per sequence of a step of plain prefills (host lengths from meta.seq_lens): K = [c @ W_UK^T, k_pe],
        V = c @ W_UV^T over its tokens (read back from the cache, as stored), causal SDPA -> [T, Hr * Dv]
        (into `out` when given)."""
        heads, nope, lat = self.num_heads, self.nope_dim, self.kv_lora_rank
        kv_b = layer.kv_b_weight  # [Hr * (Dn + Dv), L]
        block_size = layer.latent_cache.shape[1]
        out = (q.new_empty(q.shape[0], heads * layer.v_head_dim) if out is None else out).view(q.shape[0], heads, -1)
        start = meta.first_row  # a mixed step's prefill part starts after its decode rows
        for b, (length, _) in enumerate(meta.seq_lens):
            blocks = meta.block_tables[b, : -(-length // block_size)].long()
            cached = layer.latent_cache.index_select(0, blocks).flatten(0, 1)[:length].to(q.dtype)
            kv = F.linear(cached[:, :lat], kv_b).view(length, heads, -1)
            k = torch.cat([kv[..., :nope], cached[:, None, lat:].expand(length, heads, -1)], dim=-1)
            o = F.scaled_dot_product_attention(q[start:start + length].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               kv[..., nope:].transpose(0, 1)[None], is_causal=True, scale=layer.scale)
            out[start:start + length] = o[0].transpose(0, 1)
            start += length
        return out.view(q.shape[0], -1)
