"""SamplingParams.prompt_logprobs (vLLM's): every prompt token after the first gets its logprob and the top-k from the
prompt's own forward, equal to HF transformers' teacher-forced log_softmax, under chunked prefill (chunks that sample
nothing), mixed steps, preemption, n > 1, prefix caching (such a request takes no hit), TP=2 (gloo) and MLX."""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import BACKENDS, assert_drained
from tests.helpers.tiny_models import build_tiny_model, make_prompts

LENGTHS = [1, 2, 9, 40, 70]
VOCAB = 509  # prime: the TP LM head pads it


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("prompt-logprobs"))
    model = build_tiny_model(folder, "qwen3", vocab_size=VOCAB)
    prompts = make_prompts(LENGTHS, vocab=VOCAB, seed=3)
    with torch.no_grad():
        scores = [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]
    return folder, prompts, scores


def _params(k, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k, **kw)


def assert_matches_hf(prompt, scored, hf, k):
    """scored[i] holds prompt[i]'s logprob and the top k of HF's row i - 1 (ties at the k-th aside)."""
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        row = hf[i - 1]
        assert scored[i][prompt[i]] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        top = row.topk(k).indices.tolist() if k else []
        assert set(top) <= set(scored[i]) and len(scored[i]) <= k + 1
        for t in top:
            assert scored[i][t] == pytest.approx(row[t].item(), abs=1e-4)




@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("k", [0, 3])
def test_chunked_mixed_batches_match_hf(reference, k, device):
    """A step budget of 24 tokens chunks the 40- and 70-token prompts (chunks that sample nothing) and mixes
    their chunks with the short ones' decode rows; a request without prompt_logprobs beside them gets None. Both
    backends (MLX scores the rows of its evaluated hidden states on the host)."""
    folder, prompts, scores = reference
    llm = LLM(folder, device=device, dtype="float32", max_model_len=128, max_num_batched_tokens=24)
    try:
        params = [_params(k) for _ in prompts[:-1]] + [SamplingParams(temperature=0.0, max_tokens=3)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out, hf in zip(prompts[:-1], outs, scores):
            assert_matches_hf(prompt, out.prompt_logprobs, hf, k)
        assert outs[-1].prompt_logprobs is None
        assert_drained(llm)
    finally:
        llm.close()


def test_prefix_cache_hit_is_not_taken_and_n_samples_share_the_scores(reference):
    folder, prompts, scores = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128)
    try:
        prompt = {"prompt_token_ids": prompts[4]}
        plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
        assert plain.num_cached_tokens == 0
        again = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
        assert again.num_cached_tokens > 0  # the cache holds the prompt
        hits = _prefix_hits(llm)
        scored = llm.generate(prompt, _params(2, n=2), use_tqdm=False)[0]
        assert scored.num_cached_tokens == 0  # ... but a scored prompt computes every token
        assert _prefix_hits(llm) > hits  # the second sample, which scores nothing, took the first's blocks
        assert_matches_hf(prompts[4], scored.prompt_logprobs, scores[4], 2)
        assert [c.token_ids[:2] for c in scored.outputs] == [again.outputs[0].token_ids] * 2
    finally:
        llm.close()


def _prefix_hits(llm) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "metainfer:prefix_cache_hits_total")


def test_each_request_gets_its_own_k_in_a_shared_step(reference):
    """Requests with prompt_logprobs 0, 1 and 5 scored in one step: each position holds the prompt token and that
    request's own top k (the step computes the largest k for all)."""
    folder, prompts, scores = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128)
    try:
        ks = [0, 5, 1]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:5]], [_params(k) for k in ks],
                            use_tqdm=False)
        for prompt, out, hf, k in zip(prompts[2:5], outs, scores[2:5], ks):
            assert_matches_hf(prompt, out.prompt_logprobs, hf, k)
            assert all(len(d) in (k, k + 1) and len(d) >= 1 for d in out.prompt_logprobs[1:])
    finally:
        llm.close()


def test_preemption_rescoring_gives_the_same(reference):
    """A pool too small for the batch preempts and recomputes; the scores stay HF's."""
    folder, prompts, scores = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=10, block_size=16,
              kv_reserve_ratio=0.0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        for prompt, out, hf in zip(prompts[2:], outs, scores[2:]):
            assert_matches_hf(prompt, out.prompt_logprobs, hf, 1)
    finally:
        llm.close()


def test_streamed_outputs_carry_the_scores_once_complete(reference):
    folder, prompts, scores = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    try:
        engine = llm.llm_engine
        engine.add_request("s", {"prompt_token_ids": prompts[3]}, _params(1), stream=True)
        seen = []
        while engine.has_unfinished_requests():
            seen += [o.prompt_logprobs for o in engine.step()]
        assert seen and all(s is not None for s in seen)  # the first output comes after the last chunk
        assert_matches_hf(prompts[3], seen[-1], scores[3], 1)
    finally:
        llm.close()


def test_bad_values_name_the_field(reference):
    folder, prompts, _ = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, max_logprobs=5)
    try:
        for k in (-1, 6, 1.5, True):
            with pytest.raises(ValueError, match="prompt_logprobs"):
                llm.generate({"prompt_token_ids": prompts[2]}, _params(k), use_tqdm=False)
        assert llm.generate({"prompt_token_ids": prompts[2]}, _params(5), use_tqdm=False)[0].prompt_logprobs
    finally:
        llm.close()


@pytest.mark.tp
def test_tp2_scores_equal_tp1(reference):
    """The workers join the LM head's gather for the scored rows (a chunked prompt beside short ones)."""
    folder, prompts, scores = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=24,
              tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(2), use_tqdm=False)
        for prompt, out, hf in zip(prompts, outs, scores):
            assert_matches_hf(prompt, out.prompt_logprobs, hf, 2)
    finally:
        llm.close()
