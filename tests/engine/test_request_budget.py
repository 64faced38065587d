"""A request's token budget, by hand (engine/request_validation.py): max_tokens clamped to the context left after
the prompt, and the KV tokens its n samples hold together (the prompt's blocks shared under prefix caching)."""

from __future__ import annotations

from metainfer.engine.request_validation import RequestLimits, kv_tokens_needed, max_new_tokens
from metainfer.sampling_params import SamplingParams


def test_max_new_tokens_is_max_tokens_clamped_to_the_context_left():
    assert max_new_tokens(SamplingParams(max_tokens=10), prompt_len=5, max_model_len=64) == 10
    assert max_new_tokens(SamplingParams(max_tokens=100), prompt_len=5, max_model_len=64) == 59
    assert max_new_tokens(SamplingParams(max_tokens=None), prompt_len=60, max_model_len=64) == 4


def test_kv_tokens_needed_counts_every_sample():
    limits = RequestLimits(vocab_size=100, max_model_len=64, max_n=8, max_logprobs=5)
    params = SamplingParams(n=3, max_tokens=10)
    assert kv_tokens_needed(params, 20, limits) == 20 + 3 * 10  # one copy of the prompt, shared
    unshared = RequestLimits(vocab_size=100, max_model_len=64, max_n=8, max_logprobs=5, shared_prompt=False)
    assert kv_tokens_needed(params, 20, unshared) == 3 * (20 + 10)
    assert kv_tokens_needed(SamplingParams(n=2, max_tokens=100), 60, limits) == 60 + 2 * 4  # clamped
