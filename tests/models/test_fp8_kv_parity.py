"""The engine with an fp8 KV cache (`kv_cache_dtype="fp8"`) against HF transformers whose attention
sees its cached K/V rounded to float8_e4m3fn (clamped to +-448, as the cache stores them): the same
greedy tokens (fp32, CPU), under batching, chunked prefill, prefix-cache hits and preemption. The
fp8 cache holds 4x the blocks of the fp32 cache in the same bytes. (The kv_cache_dtype option itself:
tests/config/test_kv_cache_dtype.py.)"""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.kernels.kv_cache import is_token_major
from tests.helpers.engine_checks import generate_ids
from tests.helpers.kernel_devices import ON_GPU
from tests.helpers.tiny_models import assert_matches_hf, hf_greedy, hf_reference
from tools.agreement import use_fp8_kv_attention

LENGTHS = [1, 7, 16, 33, 64, 100]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-fp8kv"))
    model, prompts, unrounded = hf_reference(folder, "qwen3", LENGTHS, NEW_TOKENS)
    use_fp8_kv_attention(model)  # HF's SDPA over fp8-rounded K/V: HF and torch only, no engine code
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    # the oracle must tell an fp8 cache from a full-precision one, or the parity below proves nothing
    assert sum(a != b for a, b in zip(unrounded, expected)) >= 3
    return folder, prompts, expected, model


def _generate(folder, prompts, **engine_kw):
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_dtype="fp8", **engine_kw)
    runner = llm.llm_engine.runner
    assert runner.attn_backend.pool.dtype == FP8
    # K block-major, V token-major (CONTRACTS: KV cache): the parity below runs on that layout
    for layer in runner.attention_layers:
        _, s, _, d = layer.k_cache.shape
        assert is_token_major(layer.v_cache) and layer.k_cache.stride()[1:] == (d, s * d, 1)
    return llm, generate_ids(llm, prompts, GREEDY)


def test_fp8_cache_matches_hf_over_fp8_kv(reference):
    folder, prompts, expected, model = reference
    _, got = _generate(folder, prompts)
    assert_matches_hf(model, prompts, got, expected)


def test_fp8_cache_chunked_prefill_and_preemption(reference):
    folder, prompts, expected, model = reference
    llm, got = _generate(folder, prompts, max_num_batched_tokens=24, num_kv_blocks=20, kv_reserve_ratio=0.0)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_matches_hf(model, prompts, got, expected)


def test_fp8_cache_prefix_hits(reference):
    folder, prompts, expected, model = reference
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    first = llm.generate([{"prompt_token_ids": prompts[4]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": prompts[4]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.block_manager.prefix_hit_tokens >= 64 // 16 * 16 - 16, "the second run must hit the cache"
    assert_matches_hf(model, [prompts[4]] * 2, [first, again], [expected[4]] * 2)


def test_fp8_cache_has_four_times_the_fp32_blocks(reference):
    folder = reference[0]
    budget = dict(device="cpu", dtype="float32", cpu_kv_cache_gib=2**-12, max_num_seqs=64)
    full = LLM(folder, **budget).llm_engine.runner
    fp8 = LLM(folder, kv_cache_dtype="fp8", **budget).llm_engine.runner
    assert full.attn_backend.pool.dtype == torch.float32 and fp8.attn_backend.pool.dtype == FP8
    assert not any(is_token_major(layer.v_cache) for layer in full.attention_layers)
    assert all(is_token_major(layer.v_cache) for layer in fp8.attention_layers)
    assert fp8.num_blocks == 4 * full.num_blocks
    assert fp8.attn_backend.pool.nbytes == full.attn_backend.pool.nbytes


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="a CPU engine running the Triton kernels in the interpreter")
def test_fp8_cache_triton_kernels_in_the_engine(reference, monkeypatch):
    """The engine with the Triton kernels (the interpreter) over the fp8 cache: the GPU path's
    composition (qk prep + store, decode with its tile rule, prefill), which the tests above run through
    the torch references only."""
    import metainfer.worker.model_runner as model_runner

    folder, prompts, expected, model = reference
    real_select = model_runner.select_ops
    monkeypatch.setattr(model_runner, "select_ops", lambda device, **kw: real_select(device, use_triton=True, **kw))
    picks = (0, 3)  # a 1-token and a 33-token prompt: prefill, a partial block, decode over block boundaries
    few = [prompts[i] for i in picks]
    llm, got = _generate(folder, few, enforce_eager=True)
    assert llm.llm_engine.runner.ops.paged_decode_attention is not real_select("cpu").paged_decode_attention
    assert_matches_hf(model, few, got, [expected[i] for i in picks])
