"""The paged attention backend behind `self.attn(q, k, v)` (attention/paged.py): a dense attention layer
run through it equals the un-fused chain written out with the torch references (per-head q/k RMSNorm,
neox rotary, K/V store, then attention over the cache), for a prefill then a decode step, with the
reference kernels and with the Triton q/k prep and decode (interpreted on the CPU). The decode launches
write their split partials into the backend's own workspace."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from metainfer.attention import AttentionMetadata, PagedAttentionBackend, forward_context
from metainfer.config import ModelSpec
from metainfer.kernels import (
    REF_OPS,
    TRITON_OPS,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    rotary_neox_ref,
    store_kv_ref,
)
from metainfer.layers.rotary import RotaryEmbedding
from metainfer.models.dense import DenseAttention
from tests.helpers.kernel_devices import ON_GPU

pytest.importorskip("triton")

HQ, HK, D = 4, 2, 32


def _spec(qk_norm: bool, rotary_factor: float) -> ModelSpec:
    return ModelSpec(architecture="Qwen3ForCausalLM", model_type="qwen3", vocab_size=64, hidden_size=64,
                     intermediate_size=128, num_layers=1, num_heads=HQ, num_kv_heads=HK, head_dim=D,
                     rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=1024,
                     tie_word_embeddings=False, qkv_bias=False, qk_norm=qk_norm,
                     partial_rotary_factor=rotary_factor)


def _backend(ops, num_blocks=80, block_size=4):
    backend = PagedAttentionBackend(ops, HQ, HK, D, torch.float32, torch.device("cpu"), max_num_seqs=4,
                                    max_model_len=num_blocks * block_size, block_size=block_size)
    return backend


def _rotary(spec: ModelSpec) -> RotaryEmbedding:
    return RotaryEmbedding(spec.head_dim, spec.rotary_dim, 1024, spec.rope_theta, spec.rope_scaling, REF_OPS)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("qk_norm,rotary_factor", [(True, 1.0), (False, 0.5)], ids=["qwen3", "partial-rotary"])
@pytest.mark.parametrize("ops", ["ref", pytest.param("triton", marks=pytest.mark.skipif(
    ON_GPU, reason="CPU tensors through the interpreter; compiled, the engine's GPU tests run this backend"))])
def test_dense_attention_through_the_backend_equals_the_unfused_chain(qk_norm, rotary_factor, ops):
    ops = REF_OPS if ops == "ref" else dataclasses.replace(  # the Triton q/k prep and decode: the GPU's path
        REF_OPS, qk_norm_rope_store=TRITON_OPS.qk_norm_rope_store,
        paged_decode_attention=TRITON_OPS.paged_decode_attention, backend="triton")
    spec = _spec(qk_norm, rotary_factor)
    gen = torch.Generator().manual_seed(5)
    backend = _backend(ops)
    layer = DenseAttention(spec, REF_OPS, backend, torch.float32, _rotary(spec))
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3 + (0.8 if p.dim() == 1 else 0.0)
    backend.allocate([layer.attn], num_blocks=80, block_size=4)
    ref_k, ref_v = torch.zeros_like(layer.attn.k_cache), torch.zeros_like(layer.attn.v_cache)
    # one sequence: 200 prompt tokens over shuffled blocks (a decode context long enough to split), then one token
    table = torch.randperm(80, generator=gen)[:51].to(torch.int32)
    prompt = 200
    steps = [(torch.arange(prompt), True), (torch.tensor([prompt]), False)]
    for positions, is_prefill in steps:
        n = positions.numel()
        slots = (table[positions // 4] * 4 + positions % 4).to(torch.int32)
        ctx = _i32(int(positions[-1]) + 1)
        meta = AttentionMetadata(is_prefill, slots, ctx, table[None], _i32(0, n), n, positions)
        x = torch.randn(n, 64, generator=gen)
        if not is_prefill and backend.decode_workspace is not None:
            backend.decode_workspace.fill_(float("nan"))
        with forward_context(meta):
            out = layer(x)
        # the un-fused chain, written out with the references
        q, k, v = layer.qkv_proj(x).split([HQ * D, HK * D, HK * D], dim=-1)
        if qk_norm:
            q = rms_norm_ref(q.reshape(-1, D), layer.q_norm.weight, 1e-6).view(n, -1)
            k = rms_norm_ref(k.reshape(-1, D), layer.k_norm.weight, 1e-6).view(n, -1)
        q, k = rotary_neox_ref(positions, q.contiguous(), k.contiguous(), layer.rotary_emb.cos_sin_cache, D)
        store_kv_ref(k.view(n, HK, D), v.contiguous().view(n, HK, D), ref_k, ref_v, slots)
        if is_prefill:
            attn = paged_prefill_attention_ref(q.view(n, HQ, D), ref_k, ref_v, _i32(0, n), ctx, table[None], n,
                                               D ** -0.5)
        else:
            attn = paged_decode_attention_ref(q.view(n, HQ, D), ref_k, ref_v, table[None], ctx, D ** -0.5)
        expected = layer.o_proj(attn.reshape(n, -1))
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(layer.attn.k_cache, ref_k, atol=1e-5, rtol=1e-5)
        assert torch.equal(layer.attn.v_cache, ref_v)
        if not is_prefill and backend.decode_workspace is not None:  # the 201-token context split there
            assert not bool(torch.isnan(backend.decode_workspace).all())


def test_backend_sizes_its_pool_and_views():
    backend = _backend(REF_OPS)
    assert backend.bytes_per_block(num_layers=3, block_size=4) == 2 * 3 * 4 * HK * D * 4
    layers = [type("L", (), {})() for _ in range(3)]
    backend.allocate(layers, num_blocks=5, block_size=4)
    assert backend.pool.shape == (2, 3, 5, 4, HK, D)
    assert all(layer.k_cache.shape == (5, 4, HK, D) for layer in layers)
    backend.release(layers)
    assert backend.pool is None and layers[0].k_cache.numel() == 0


def test_attention_rejects_q_k_v_that_are_not_one_projection():
    backend = _backend(REF_OPS)
    spec = _spec(True, 1.0)
    layer = DenseAttention(spec, REF_OPS, backend, torch.float32, _rotary(spec))
    backend.allocate([layer.attn], num_blocks=4, block_size=4)
    q, k, v = torch.zeros(2, HQ * D), torch.zeros(2, HK * D), torch.zeros(2, HK * D)
    meta = AttentionMetadata(True, _i32(0, 1), _i32(2), _i32(0)[None], _i32(0, 2), 2, torch.arange(2))
    with forward_context(meta), pytest.raises(ValueError, match="one packed projection"):
        layer.attn(q, k, v)
