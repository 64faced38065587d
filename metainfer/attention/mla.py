"""Multi-head latent attention (DeepSeek-V2) over a paged latent cache.

Cache per layer: `[num_blocks, block_size, L + R]` (L = kv_lora_rank, R = qk_rope_head_dim), views of one
pool `[layers, N, S, L + R]` in the KV dtype (the model's, or fp8 with a unit scale like the dense cache):
one vector per token for all heads, so DeepSeek-V2-Lite keeps 27 x 576 x 2 = 31,104 bytes a token in bf16.

A step: `store` normalises c (kv_a_layernorm), rotates q_pe and k_pe (interleaved pairs) and writes
[c, k_pe] at the slots, one fused launch (kernels/mla_prep.py). `decode` runs absorbed: q_lat = q_nope @
W_UK per head (ops.mla_absorb, kernels/mla_absorb.py), attention of [q_lat, q_pe] over the cached
[c, k_pe] with values c (kernels/mla_ref.py, kernels/mla_attention.py), then out = o_lat @ W_UV^T per head
(ops.mla_value_up) -> [T, Hr * Dv] for o_proj. `prefill` takes the form that is faster at its length (H100, runs 74-75,
tools/bench_mla.py): absorbed below `expanded_min_q` new tokens, expanded from there: the step's context
latents (every prefill sequence's cached tokens, a prefix hit's and an earlier chunk's included) gathered from
the cache once a step, up-projected by kv_b_proj into per-head k_nope and v in one GEMM a layer, then one
varlen causal attention over them with the shared k_pe (ops.mla_expanded_attention: kernels/mla_expanded.py
on the GPU, kernels/mla_ref.py's SDPA on the CPU), each sequence's queries aligned to its context's end.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from metainfer.attention.backend import AttentionBackend

# prefill steps whose longest sequence has at least this many new tokens take the expanded form: the varlen
# kernel beat the absorbed one from 512 tokens (H100, run 74, tools/bench_mla: kernel 64 vs 136 us at 512, 200
# vs 1,048 us for 16 x 512 packed; 83 vs 103 us at 256, both launch-bound) and the throughput protocol gained
# 1.7-3.3% with 256 against 1,024 in one engine (run 75: 7,689 against 7,444 / 7,561 output tok/s)
EXPANDED_MIN_Q = 256


def context_rows(context_lens: torch.Tensor, block_tables: torch.Tensor, total: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache rows [S] of every sequence's context tokens in order, cu_seqlens_k i32[B+1]) from the block
    tables, on the device: S = `total`, the contexts' sum, is a host int, so nothing waits for the GPU."""
    lens = context_lens.long()
    cu_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=cu_k[1:])
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    pos = torch.arange(total, device=lens.device) - cu_k[:-1].long()[seq]
    return block_tables[seq, pos // block_size].long() * block_size + pos % block_size, cu_k


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
        self._expanded = ops.mla_expanded_attention
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
        """The expanded form from expanded_min_q new tokens in the step's longest sequence (host lengths
        known: meta.seq_lens); below it the absorbed form, whose per-row state is the whole latent."""
        return meta.seq_lens is not None and meta.max_seqlen_q >= self.expanded_min_q

    def _context_rows(self, meta, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """context_rows for the step's prefill sequences, once a step (kept in meta.launch_plans for the
        other layers)."""
        key = ("mla_context_rows", block_size)
        found = meta.launch_plans.get(key)
        if found is None:
            found = meta.launch_plans[key] = context_rows(meta.context_lens[: len(meta.seq_lens)], meta.block_tables,
                                                          sum(ctx for _, ctx in meta.seq_lens), block_size)
        return found

    def _prefill_expanded(self, layer, q: torch.Tensor, meta, out: torch.Tensor | None = None) -> torch.Tensor:
        """K/V of the step's contexts up-projected from the cached latents (as stored: normalised c, rotated
        k_pe), then one varlen causal attention -> [T, Hr * Dv] (into `out` when given)."""
        heads, lat = self.num_heads, self.kv_lora_rank
        cache = layer.latent_cache
        rows, cu_k = self._context_rows(meta, cache.shape[1])
        latent = cache.view(-1, cache.shape[-1]).index_select(0, rows).to(q.dtype)
        kv = F.linear(latent[:, :lat], layer.kv_b_weight).view(latent.shape[0], heads, -1)
        o = None if out is None else out.view(q.shape[0], heads, layer.v_head_dim)
        o = self._expanded(q, kv, latent[:, lat:], meta.cu_seqlens_q, cu_k, meta.max_seqlen_q, layer.scale, out=o,
                           plans=meta.launch_plans)
        return o.view(q.shape[0], -1)
