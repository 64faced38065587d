"""Sampler behaviour: seeds, top-k/top-p/min-p statistics, stops, lengths, penalties."""

from __future__ import annotations

import math

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.engine.sampler import Sampler
from metainfer.engine.sequence import Sequence
from tests.helpers.tiny_models import build_tiny_model, make_prompts


@pytest.fixture(scope="module")
def shared_llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3"))
    build_tiny_model(folder, "qwen3", initializer_range=0.1)
    return LLM(folder, device="cpu", dtype="float32")


@pytest.fixture
def llm(shared_llm):
    """After every test: all KV blocks free, no request left behind."""
    yield shared_llm
    bm = shared_llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not shared_llm.llm_engine.has_unfinished_requests()


PROMPTS = [{"prompt_token_ids": p} for p in make_prompts([5, 12, 30, 3])]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seed_reproducible_across_runs_and_batches(llm):
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=20, ignore_eos=True)
    alone = _tokens(llm.generate(PROMPTS[0], p, use_tqdm=False))
    again = _tokens(llm.generate(PROMPTS[0], p, use_tqdm=False))
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    # the seeded request sits in another row of a batch with unseeded neighbours
    mixed = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]], [unseeded, unseeded, p, unseeded],
                         use_tqdm=False)
    assert alone == again == [mixed[2].outputs[0].token_ids]
    other_seed = _tokens(llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=124, max_tokens=20,
                                                                 ignore_eos=True), use_tqdm=False))
    assert other_seed != alone


def test_top_k_one_equals_greedy(llm):
    greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False))
    topk1 = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=16,
                                                         ignore_eos=True), use_tqdm=False))
    assert greedy == topk1


def test_n_samples_differ_and_finish(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_stop_string_cuts_text(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids) or text.index(stop) + len(stop) > len(text) - 4


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[2]
    first = full.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == full[: first + 1]
    late = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=10,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 10 and stop_id not in late.token_ids[:10]


def test_logprobs_are_log_softmax(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        assert max(entry.values()) == pytest.approx(entry[token])  # greedy picks the top token
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


# -- statistics on a small vocabulary, sampler alone -------------------------------------
def _draw(params: SamplingParams, logits: torch.Tensor, n: int = 4000) -> torch.Tensor:
    torch.manual_seed(0)
    sampler = Sampler(vocab_size=logits.numel(), eos_token_ids=())
    seqs = [Sequence("r", 0, [0], params) for _ in range(n)]
    out = sampler(logits.expand(n, -1).clone(), seqs).to_host().result()
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).float() / n


LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def test_temperature_statistics():
    freq = _draw(SamplingParams(temperature=1.0), LOGITS)
    assert torch.allclose(freq, LOGITS.softmax(0), atol=0.03)
    hot = _draw(SamplingParams(temperature=2.0), LOGITS)
    assert torch.allclose(hot, (LOGITS / 2).softmax(0), atol=0.03)


def test_top_p_statistics():
    freq = _draw(SamplingParams(temperature=1.0, top_p=0.75), LOGITS)  # keeps 0.4 + 0.3 (+0.15 crosses it)
    assert freq[3:].sum() == 0 and freq[2] > 0
    assert math.isclose(freq[0].item(), 0.4 / 0.85, abs_tol=0.03)


def test_top_k_statistics():
    freq = _draw(SamplingParams(temperature=1.0, top_k=3), LOGITS)
    assert freq[3:].sum() == 0
    assert math.isclose(freq[2].item(), 0.15 / 0.85, abs_tol=0.03)


def test_min_p_statistics():
    freq = _draw(SamplingParams(temperature=1.0, min_p=0.3), LOGITS)  # keeps p >= 0.12
    assert freq[3:].sum() == 0
    assert math.isclose(freq[0].item(), 0.4 / 0.85, abs_tol=0.03)


def test_penalties_move_probability():
    sampler = Sampler(vocab_size=5, eos_token_ids=())
    seq = Sequence("r", 0, [4], SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                                                frequency_penalty=0.25))
    seq.token_ids += [0, 0]
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]])
    got = sampler._apply_penalties(logits.clone(), [seq])[0]
    assert got[0] == pytest.approx(2.0 / 2 - 0.5 - 0.25 * 2)
    assert got[4] == pytest.approx(0.5)  # prompt token: repetition penalty only
    assert got[1] == pytest.approx(1.9)
    assert sampler(logits, [seq]).to_host().result().token_ids == [1]
