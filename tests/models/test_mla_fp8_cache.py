"""DeepSeek-V2's fp8 latent cache (`kv_cache_dtype="fp8"`) against HF transformers whose attention
up-projects from the latent rounded as the cache stores it: [kv_a_layernorm(c), rope(k_pe)] clamped to
+-448 and cast to float8_e4m3fn (kernels/mla_prep.py). The reference is HF and torch alone: its
`DeepseekV2Attention.expand_kv` (the step that turns the cached latent into per-head K/V) sees both
parts rounded. Greedy tokens (fp32, CPU) under batching, chunked prefill, preemption and prefix hits, and
teacher-forced logits through the absorbed decode, absorbed prefill and expanded prefill; latents past
+-448 stored saturated; the Triton MLA kernels (slow). The dense family's counterpart:
tests/models/test_fp8_kv_parity.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.kernels import FP8_KV_DTYPE
from tests.helpers.engine_checks import assert_drained, generate_ids, token_ids
from tests.helpers.tiny_models import assert_matches_hf, build_tiny_model, hf_greedy, make_prompts
from tools.agreement import hf_logits, teacher_forced_logits, teacher_forced_prefill_logits

LENGTHS = [1, 7, 16, 33, 64, 100]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Log-probability tolerance. fp32 noise upstream of a latent (in HF or the engine, which order their sums
# differently) can put a value on the other side of an fp8 rounding midpoint: one element moves by an fp8
# step and the log-probs by up to ~1e-2 (HF fp32 against HF fp64, both rounded, a 100-token prompt: 1.1e-2;
# the engine against HF fp32, 5 seeds x 3 prompts x 3 paths: at most 6.3e-3, usually ~1e-4). The rounding
# itself moves them by 4-10 (HF unrounded, or rounding only one of the two parts). 5e-2 sits between, 100x
# below the effect under test; greedy parity allows a divergence where HF's top-2 margin is below it, for
# the same reason.
LOGPROB_ATOL = 5e-2


def _fp8(t: torch.Tensor) -> torch.Tensor:
    return t.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(t.dtype)


@contextlib.contextmanager
def fp8_latent(hf_model, latent: bool = True, k_pe: bool = True):
    """Within the block, every DeepseekV2Attention up-projects (kv_b_proj) from its cached latent and
    concatenates its k_pe rounded to fp8, as the engine's fp8 latent cache holds them. HF caches the
    normalised latent and the rotated k_pe and passes both to `expand_kv` (transformers 5.x), so rounding
    there is the latent cache's rounding; rounding is idempotent, so re-reading a rounded value is exact."""
    layers = [m for m in hf_model.modules() if type(m).__name__ == "DeepseekV2Attention"]
    assert layers and all(hasattr(m, "expand_kv") for m in layers), "transformers' DeepSeek-V2 attention changed"
    calls = []

    def patched(original):
        def expand_kv(kv_nope, k_rot):
            calls.append(1)
            return original(_fp8(kv_nope) if latent else kv_nope, _fp8(k_rot) if k_pe else k_rot)
        return expand_kv

    for m in layers:
        m.expand_kv = patched(m.expand_kv)
    try:
        yield calls
    finally:
        for m in layers:
            del m.expand_kv  # the instance attribute: the class's method again


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("deepseek_v2-fp8-latent"))
    model = build_tiny_model(folder, "deepseek_v2")
    prompts = make_prompts(LENGTHS)
    unrounded = hf_greedy(model, prompts, NEW_TOKENS)
    with fp8_latent(model) as calls:
        expected = hf_greedy(model, prompts, NEW_TOKENS)
    assert calls, "HF's forward no longer calls expand_kv: the reference was not rounded"
    # the oracle must tell an fp8 latent cache from a full-precision one, or the parity below proves nothing
    assert sum(a != b for a, b in zip(unrounded, expected)) >= 3
    return folder, prompts, expected, model


def _llm(folder, **engine_kw):
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_dtype="fp8", **engine_kw)
    assert llm.llm_engine.runner.attn_backend.name == "mla"
    assert llm.llm_engine.runner.attn_backend.pool.dtype == FP8_KV_DTYPE
    return llm


def test_fp8_latent_cache_matches_hf_over_fp8_latent(reference):
    folder, prompts, expected, model = reference
    llm = _llm(folder)
    got = generate_ids(llm, prompts, GREEDY)
    assert_drained(llm)
    with fp8_latent(model):
        assert_matches_hf(model, prompts, got, expected, LOGPROB_ATOL)


def test_fp8_latent_cache_chunked_prefill_and_preemption(reference):
    folder, prompts, expected, model = reference
    # 20 blocks of 16 = 320 tokens for 6 sequences needing 221 + 144 tokens: must preempt and recompute
    llm = _llm(folder, num_kv_blocks=20, block_size=16, max_num_batched_tokens=48, kv_reserve_ratio=0.0)
    got = generate_ids(llm, prompts, GREEDY)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_drained(llm)
    with fp8_latent(model):
        assert_matches_hf(model, prompts, got, expected, LOGPROB_ATOL)


def test_fp8_latent_cache_prefix_hits(reference):
    """Prompts sharing an 80-token prefix: the later ones read the first one's fp8 latents from the cache."""
    folder, _, _, model = reference
    shared = make_prompts([80], seed=7)[0]
    prompts = [shared + tail for tail in make_prompts([3, 9, 20], seed=8)]
    with fp8_latent(model):
        expected = hf_greedy(model, prompts, NEW_TOKENS)
    llm = _llm(folder)
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    assert all(o.metrics["num_cached_tokens"] >= 64 for o in rest)
    with fp8_latent(model):
        assert_matches_hf(model, prompts, token_ids(first + rest), expected, LOGPROB_ATOL)


def _max_logprob_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()


@pytest.mark.parametrize("path", ["decode", "prefill-absorbed", "prefill-expanded"])
def test_fp8_latent_cache_teacher_forced_logits(reference, path):
    """Every position's log-probabilities (a 33- and a 100-token prompt, then their 24 reference tokens fed one
    at a time through the decode path, or all in one prefill) equal the rounded reference's within
    LOGPROB_ATOL, and are far (> 10x that) from HF unrounded and from a reference that rounds only one of the
    two cached parts: the comparison sees the rounding of the normalised latent and of the rotated k_pe."""
    folder, prompts, expected, model = reference
    for i in (3, 5):
        tokens = torch.tensor(prompts[i] + expected[i])
        prompt_len, positions = len(prompts[i]), NEW_TOKENS
        llm = _llm(folder)
        if path == "decode":
            ours = teacher_forced_logits(llm, tokens, prompt_len, positions)
        else:
            llm.llm_engine.runner.attn_backend.expanded_min_q = 1 if path == "prefill-expanded" else 10**9
            ours = teacher_forced_prefill_logits(llm, tokens, prompt_len, positions)
        with fp8_latent(model):
            rounded = hf_logits(model, tokens, prompt_len, positions)
        with fp8_latent(model, k_pe=False):
            latent_only = hf_logits(model, tokens, prompt_len, positions)
        with fp8_latent(model, latent=False):
            k_pe_only = hf_logits(model, tokens, prompt_len, positions)
        unrounded = hf_logits(model, tokens, prompt_len, positions)
        err = _max_logprob_error(ours, rounded)
        assert err < LOGPROB_ATOL, (len(prompts[i]), err)
        for name, other in (("unrounded", unrounded), ("latent only", latent_only), ("k_pe only", k_pe_only)):
            off = _max_logprob_error(ours, other)
            assert off > 10 * LOGPROB_ATOL, f"as close to HF with {name} rounding ({off:.3g}) as to fp8 ({err:.3g})"


@pytest.fixture(scope="module")
def saturating(tmp_path_factory):
    """The tiny checkpoint with latents past fp8's range: kv_a_layernorm's weight x150 (kv_b_proj / 150, so
    K and V keep their size) and k_pe's rows of kv_a_proj_with_mqa x60, so both cached parts reach +-448."""
    folder = str(tmp_path_factory.mktemp("deepseek_v2-fp8-saturating"))
    model = build_tiny_model(folder, "deepseek_v2")
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kv_a_layernorm.weight.mul_(150.0)
            attn.kv_b_proj.weight.div_(150.0)
            attn.kv_a_proj_with_mqa.weight[attn.kv_lora_rank:].mul_(60.0)
    model.save_pretrained(folder)
    prompts = make_prompts(LENGTHS)
    with fp8_latent(model):
        expected = hf_greedy(model, prompts, NEW_TOKENS)
    return folder, prompts, expected, model


def test_fp8_latent_cache_clamps_like_hf_over_saturated_latent(saturating):
    """Latent and k_pe values beyond +-448 are stored saturated, as the reference's clamp does: the same greedy
    tokens and teacher-forced log-probabilities. (torch 2.13's CPU fp8 cast saturates by itself, so on the
    torch path this checks the stored values, not the clamp; the Triton test below checks the kernels' clamp.)"""
    folder, prompts, expected, model = saturating
    llm = _llm(folder)
    got = generate_ids(llm, prompts, GREEDY)
    with fp8_latent(model):
        assert_matches_hf(model, prompts, got, expected, LOGPROB_ATOL)
    tokens = torch.tensor(prompts[5] + expected[5])
    ours = teacher_forced_logits(llm, tokens, len(prompts[5]), NEW_TOKENS)
    cache = llm.llm_engine.runner.attn_backend.pool.float()
    lat = llm.llm_engine.runner.attn_backend.kv_lora_rank
    assert (cache[..., :lat].abs() == 448).sum() > 10 and (cache[..., lat:].abs() == 448).sum() > 10
    with fp8_latent(model):
        rounded = hf_logits(model, tokens, len(prompts[5]), NEW_TOKENS)
    err = _max_logprob_error(ours, rounded)
    assert err < LOGPROB_ATOL < 10 * LOGPROB_ATOL < _max_logprob_error(ours, hf_logits(model, tokens, len(prompts[5]),
                                                                                      NEW_TOKENS)), err


@pytest.mark.slow  # the Triton interpreter: 8-22 s a model here
@pytest.mark.parametrize("model_fixture", ["reference", "saturating"])
def test_fp8_latent_cache_triton_kernels_match_hf_over_fp8_latent(model_fixture, request):
    """The GPU path's MLA kernels (the fused latent norm + rope + fp8 store with its clamp, split-KV latent
    decode, absorbed prefill, the K-up / V-up; interpreted on the CPU) over the fp8 latent cache: still the
    rounded reference's tokens and log-probabilities. The tests above run the torch references only."""
    import dataclasses

    from metainfer.kernels import REF_OPS, TRITON_OPS

    folder, prompts, expected, model = request.getfixturevalue(model_fixture)
    names = ("mla_absorb", "mla_value_up", "mla_latent_prep", "mla_decode_attention", "mla_prefill_attention",
             "mla_decode_workspace_numel")
    ops = dataclasses.replace(REF_OPS, backend="triton", **{n: getattr(TRITON_OPS, n) for n in names})
    llm = _llm(folder, max_num_seqs=4)
    llm.llm_engine.runner.swap_kernels(ops)
    assert llm.llm_engine.runner.attn_backend._prep is TRITON_OPS.mla_latent_prep
    few = prompts[:4]
    got = generate_ids(llm, few, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with fp8_latent(model):
        assert_matches_hf(model, few, got, [e[:8] for e in expected[:4]], LOGPROB_ATOL)
    tokens = torch.tensor(prompts[3] + expected[3])
    ours = teacher_forced_logits(llm, tokens, len(prompts[3]), 8)
    with fp8_latent(model):
        rounded = hf_logits(model, tokens, len(prompts[3]), 8)
    unrounded = hf_logits(model, tokens, len(prompts[3]), 8)
    err = _max_logprob_error(ours, rounded)
    assert err < LOGPROB_ATOL < 10 * LOGPROB_ATOL < _max_logprob_error(ours, unrounded), err
