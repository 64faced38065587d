"""DeepSeek-V2 (MLA + MoE) and Qwen3-MoE: greedy parity with HF transformers on tiny random checkpoints
(fp32, CPU: bf16 flips router choices), under batching, preemption, chunked prefill and prefix hits;
both checkpoint layouts of the experts; the latent cache's size from the config."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from metainfer import LLM, SamplingParams
from metainfer.config import ModelSpec
from tests.helpers.engine_checks import assert_drained, generate_drained, generate_ids, token_ids
from tests.helpers.processes import alive
from tests.helpers.tiny_models import (
    YARN_ROPE,
    assert_engine_matches_hf,
    assert_matches_hf,
    copy_model_files,
    hf_greedy,
    hf_reference,
    make_prompts,
)

LENGTHS = [1, 7, 16, 33, 64, 100]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {
    "deepseek_v2-plain": {},
    # q-LoRA, group-limited routing (4 groups of 2 experts, best 2 groups), routed_scaling_factor
    "deepseek_v2-qlora_grouped": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                      routed_scaling_factor=2.5, num_experts_per_tok=3),
    # YaRN with mscale / mscale_all_dim (softmax scale and cos/sin magnitudes), 2 shared experts
    "deepseek_v2-yarn": dict(rope_parameters=dict(YARN_ROPE), n_shared_experts=2),
    # biases on q_a / kv_a / o (attention_bias): the q and latent projections stay two GEMMs
    "deepseek_v2-qlora_bias": dict(q_lora_rank=24, attention_bias=True),
    "qwen3_moe-dense_layer": {},
    # the top-k weights left as softmax probabilities (not divided by their sum), as the config default has it
    "qwen3_moe-unnormed_topk": dict(norm_topk_prob=False),
}
FAST = ["deepseek_v2-plain", "qwen3_moe-dense_layer"]
EVERY_VARIANT = pytest.mark.parametrize(
    "reference", [v if v in FAST else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS], indirect=True)
BOTH_FAMILIES = pytest.mark.parametrize("reference", FAST, indirect=True)


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    arch = request.param.partition("-")[0]
    folder = str(tmp_path_factory.mktemp(request.param))
    model, prompts, expected = hf_reference(folder, arch, LENGTHS, NEW_TOKENS, **VARIANTS[request.param])
    return folder, prompts, expected, model


@EVERY_VARIANT
def test_batch_matches_hf(reference):
    assert_engine_matches_hf(reference, GREEDY)


def _summed_moe_path(llm) -> None:
    """Force the MoE path tensor parallelism takes (each block sums its slots, FusedExperts.forward ->
    ops.fused_moe, then the plain residual add + norm) on an engine built at tp = 1."""
    from metainfer.layers.moe import SparseMoeBlock
    from metainfer.layers.norm import RMSNorm

    runner = llm.llm_engine.runner
    modules = list(runner.model.modules())
    assert any(isinstance(m, SparseMoeBlock) and m.returns_slots for m in modules)
    for module in modules:
        if isinstance(module, SparseMoeBlock):
            module.returns_slots = False
        elif isinstance(module, RMSNorm) and module.sums_expert_slots:
            module.sums_expert_slots = False
            module.bind_ops(runner.ops)


@BOTH_FAMILIES
def test_summed_moe_path_matches_hf(reference):
    """The summed MoE path (what tp > 1 runs, forced at tp = 1: the engine otherwise hands the unsummed slots to
    the next norm): greedy tokens and the first token's log-probabilities equal HF's (logprobs catch a small
    change of the MoE output that moves no argmax)."""
    folder, prompts, expected, model = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_num_seqs=4)
    _summed_moe_path(llm)
    got = generate_ids(llm, prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert got == [e[:8] for e in expected[:4]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert logprob == pytest.approx(want[token].item(), abs=2e-4), (len(prompt), token)


@BOTH_FAMILIES
def test_first_token_logprobs_equal_hf(reference):
    """The prefill's last-position log-probabilities equal HF's within fp32 noise. Greedy parity alone misses a
    small change that moves no argmax (a 1% scaled attention output ahead of scale-invariant norms)."""
    folder, prompts, _, model = reference
    llm = LLM(folder, device="cpu", dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True), use_tqdm=False)
    assert_drained(llm)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        entry = out.outputs[0].logprobs[0]
        assert len(entry) >= 5
        for token, logprob in entry.items():
            assert logprob == pytest.approx(expected[token].item(), abs=2e-4), (len(prompt), token)

@EVERY_VARIANT
def test_preemption_and_chunked_prefill_keep_outputs(reference):
    # 20 blocks of 16 = 320 tokens for 6 sequences needing 221 + 144 tokens: must preempt
    llm = assert_engine_matches_hf(reference, GREEDY, num_kv_blocks=20, block_size=16, max_num_batched_tokens=48,
                                  kv_reserve_ratio=0.0)
    assert llm.llm_engine.scheduler.num_preemptions > 0


@BOTH_FAMILIES
def test_prefix_cache_hits(reference):
    folder, _, _, model = reference
    shared = make_prompts([80], seed=7)[0]
    prompts = [shared + tail for tail in make_prompts([3, 9, 20], seed=8)]
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    llm = LLM(folder, device="cpu", dtype="float32")
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    assert all(o.metrics["num_cached_tokens"] >= 64 for o in rest)
    assert_matches_hf(model, prompts, token_ids(first + rest), expected)


@BOTH_FAMILIES
def test_fused_expert_layout_loads(reference, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2N, H], experts.down_proj [E, H, N]) written
    as the checkpoint: the same outputs as the hub's one-tensor-per-expert layout."""
    folder, prompts, expected, model = reference
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers changed its expert layout"
    copy_model_files(folder, str(tmp_path), weights=False)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, got = generate_drained(str(tmp_path), prompts[:3], GREEDY)
    assert got == expected[:3]


@pytest.mark.tp
@BOTH_FAMILIES
def test_fused_expert_layout_shards_at_tp2(reference, tmp_path):
    """The fused layout split over 2 ranks (gloo, CPU): each rank slices its gate and up halves out of
    gate_up_proj [E, 2N, H] and its columns of down_proj [E, H, N]. Equals HF's greedy tokens, and every
    worker is gone after close()."""
    folder, prompts, expected, model = reference
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers changed its expert layout"
    copy_model_files(folder, str(tmp_path), weights=False)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        pids = llm.llm_engine.tp_driver.worker_pids
        assert len(pids) == 1 and all(alive(p) for p in pids)
        got = generate_ids(llm, prompts, GREEDY)
        assert_drained(llm)
    finally:
        llm.close()
    assert not [p for p in pids if alive(p)], "a worker outlived close()"
    assert_matches_hf(model, prompts, got, expected)


@BOTH_FAMILIES
def test_missing_expert_is_named(reference, tmp_path):
    folder, _, _, model = reference
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    gone = next(k for k in tensors if ".experts.5.up_proj" in k)
    del tensors[gone]
    copy_model_files(folder, str(tmp_path), weights=False)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        LLM(str(tmp_path), device="cpu", dtype="float32")


@pytest.mark.parametrize("kv_dtype,expected", [("auto", 27 * 576 * 2), ("fp8", 27 * 576)])
def test_latent_cache_bytes_per_token_from_config(kv_dtype, expected):
    """DeepSeek-V2-Lite: one [kv_lora_rank + qk_rope_head_dim] vector a token and layer; Qwen3-8B's dense
    cache for contrast (2 x 36 layers x 8 KV heads x 128 x 2 bytes)."""
    from metainfer.attention import MLABackend, PagedAttentionBackend
    from metainfer.kernels import FP8_KV_DTYPE, REF_OPS

    spec = ModelSpec.from_file(os.path.join(ROOT, "benchmarks", "configs", "deepseek-v2-lite.json"))
    dtype = FP8_KV_DTYPE if kv_dtype == "fp8" else torch.bfloat16
    backend = MLABackend(REF_OPS, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim,
                         dtype, torch.device("cpu"), 4, 256, 16)
    assert backend.bytes_per_block(spec.num_layers, 16) == 16 * expected
    dense = ModelSpec.from_file(os.path.join(ROOT, "benchmarks", "configs", "qwen3-8b.json"))
    paged = PagedAttentionBackend(REF_OPS, dense.num_heads, dense.num_kv_heads, dense.head_dim, torch.bfloat16,
                                  torch.device("cpu"), 4, 256, 16)
    assert paged.bytes_per_block(dense.num_layers, 1) == 147_456


def test_real_configs_route_and_shape():
    ds = ModelSpec.from_file(os.path.join(ROOT, "benchmarks", "configs", "deepseek-v2-lite.json"))
    assert (ds.family, ds.latent_dim, ds.moe_layers[0], len(ds.moe_layers)) == ("deepseek_v2", 576, 1, 26)
    # yarn factor 40, mscale_all_dim 0.707: (0.1 * 0.707 * ln 40 + 1)^2 / sqrt(192)
    assert ds.attention_scale == pytest.approx((0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1) ** 2
                                               / 192 ** 0.5)
    qm = ModelSpec.from_file(os.path.join(ROOT, "benchmarks", "configs", "qwen3-30b-a3b.json"))
    assert (qm.family, qm.num_experts, qm.num_experts_per_tok, len(qm.moe_layers)) == ("qwen3_moe", 128, 8, 48)
    cfg = json.load(open(os.path.join(ROOT, "benchmarks", "configs", "qwen3-30b-a3b.json")))
    sparse = ModelSpec.from_dict({**cfg, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3]})
    assert sparse.moe_layers[:4] == (5, 7, 9, 11)


@BOTH_FAMILIES
def test_triton_kernels_in_the_engine_match_hf(reference):
    """The GPU path's MoE and MLA kernels (routing, fused MoE and its slots summed in the next norm, latent norm +
    rope + store, split-KV latent decode, absorbed prefill; interpreted on the CPU) bound into a running engine:
    still HF's tokens."""
    import dataclasses

    from metainfer.kernels import REF_OPS, TRITON_OPS

    folder, prompts, expected, model = reference
    names = ("route_topk", "fused_moe", "fused_moe_slots", "fused_add_rms_norm_slots", "mla_latent_prep",
             "mla_decode_attention", "mla_prefill_attention", "mla_decode_workspace_numel")
    ops = dataclasses.replace(REF_OPS, backend="triton", **{n: getattr(TRITON_OPS, n) for n in names})
    llm = LLM(folder, device="cpu", dtype="float32", max_num_seqs=4)
    llm.llm_engine.runner.swap_kernels(ops)
    got = generate_ids(llm, prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert got == [e[:8] for e in expected[:4]]


@pytest.mark.slow  # ~15 s a family here: the kernels' own tests (tests/kernels) hold the fast tier
@BOTH_FAMILIES
def test_triton_moe_and_mla_kernels_in_the_engine_match_hf(reference):
    """The fused MoE and MLA's Triton kernels as the GPU engine binds them (TRITON_OPS: the K-up / V-up in
    Triton up to mla_absorb.MAX_ROWS rows, adopted by the H200 A/B of run 62), swapped into a running engine
    (interpreted on the CPU): still HF's tokens."""
    import dataclasses

    from metainfer.kernels import REF_OPS, TRITON_OPS

    folder, prompts, expected, model = reference
    ops = dataclasses.replace(
        REF_OPS, backend="triton",
        **{n: getattr(TRITON_OPS, n) for n in ("route_topk", "fused_moe", "fused_moe_slots",
                                               "fused_add_rms_norm_slots", "mla_absorb", "mla_value_up",
                                               "mla_latent_prep", "mla_decode_attention", "mla_prefill_attention",
                                               "mla_decode_workspace_numel")})
    llm = LLM(folder, device="cpu", dtype="float32", max_num_seqs=4)
    llm.llm_engine.runner.swap_kernels(ops)
    got = generate_ids(llm, prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert got == [e[:8] for e in expected[:4]]


@pytest.mark.parametrize("reference", ["deepseek_v2-plain"], indirect=True)
@pytest.mark.parametrize("attention", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_expanded_prefill_form_matches_hf(reference, attention, monkeypatch):
    """MLA's expanded prefill (the step's context latents gathered once, K/V up-projected per layer, one varlen
    causal attention), taken here by every prefill step: plain prompts, chunks of 40 tokens (continuations over
    an earlier chunk's cache) and a prefix hit; with the torch reference's attention and with the Triton kernel
    (interpreted) swapped in. HF's tokens each time."""
    import dataclasses

    from metainfer.attention.mla import MLABackend
    from metainfer.kernels import TRITON_OPS

    folder, prompts, expected, model = reference
    calls = []
    expanded = MLABackend._prefill_expanded
    monkeypatch.setattr(MLABackend, "_prefill_expanded", lambda *a: calls.append(1) or expanded(*a))
    for kw in ({}, {"max_num_batched_tokens": 40}):
        llm = LLM(folder, device="cpu", dtype="float32", **kw)
        runner = llm.llm_engine.runner
        if attention == "triton":
            triton_attention = TRITON_OPS.mla_expanded_attention
            runner.swap_kernels(dataclasses.replace(runner.ops, mla_expanded_attention=triton_attention))
        runner.attn_backend.expanded_min_q = 1
        assert_matches_hf(model, prompts, generate_ids(llm, prompts, GREEDY), expected)
        assert calls, "no step took the expanded form"
        calls.clear()
        again = generate_ids(llm, prompts[-1:], GREEDY)  # a prefix hit: the expanded form over the cached prefix
        assert again == expected[-1:] and calls
