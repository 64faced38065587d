"""The sampler alone on a small vocabulary: temperature, top-p, top-k and min-p as frequencies over many
draws, and the repetition / presence / frequency penalties. (Sampling through the engine: test_sampling.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from metainfer.engine.sequence import Sequence
from metainfer.sampling_params import SamplingParams
from metainfer.worker.sampler import Sampler


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


# -- the logits processors against their formulas, value for value ------------------------------------------


def _seq_with_output(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence("r", 0, prompt, params)
    seq.token_ids += output
    return seq


def test_penalties_equal_the_formula():
    """vLLM's / OpenAI's definitions: repetition over prompt and output tokens (positive logits divided,
    negative multiplied), frequency times each output token's count, presence once per output token."""
    g = torch.Generator().manual_seed(0)
    vocab = 12
    logits = torch.randn(2, vocab, generator=g) * 2
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-0.4, frequency_penalty=0.75)]
    seqs = [_seq_with_output([1, 2, 3], [3, 5, 5, 7], params[0]), _seq_with_output([4, 9], [9, 9, 0], params[1])]
    got = Sampler(vocab_size=vocab, eos_token_ids=())._apply_penalties(logits.clone(), seqs)
    want = logits.clone().double()
    for row, (seq, p) in enumerate(zip(seqs, params)):
        output = seq.token_ids[seq.num_prompt_tokens:]
        for token in range(vocab):
            value = want[row, token]
            if p.repetition_penalty != 1.0 and token in seq.token_ids:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = output.count(token)
            want[row, token] = value - p.frequency_penalty * count - p.presence_penalty * (count > 0)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_token_constraints_equal_the_formula():
    """logit_bias added to its ids (a repeated application of the cached row changes nothing), every id outside
    allowed_token_ids at -inf, rows without either untouched (vLLM's / OpenAI's definitions)."""
    vocab = 12
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(logit_bias={1: 2.5, 7: -100.0}), SamplingParams(), SamplingParams(
        logit_bias={4: 1.5, 9: -3.0}, allowed_token_ids=[0, 4, 5])]
    seqs = [_seq_with_output([1, 2], [3], p) for p in params]
    sampler = Sampler(vocab_size=vocab, eos_token_ids=())
    for _ in range(2):  # the second step reads the rows cached on the sequences
        got = sampler._apply_token_constraints(logits.clone(), seqs)
        want = logits.clone().double()
        want[0, 1] += 2.5
        want[0, 7] -= 100.0
        want[2, 4] += 1.5
        want[2, [i for i in range(vocab) if i not in (0, 4, 5)]] = float("-inf")
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_min_tokens_masks_exactly_the_stop_ids_and_eos():
    vocab = 10
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    seqs = [_seq_with_output([1], [4], SamplingParams(min_tokens=3, stop_token_ids=[2, 6])),
            _seq_with_output([1], [4, 4, 4], SamplingParams(min_tokens=3, stop_token_ids=[2]))]  # reached: no mask
    got = Sampler(vocab_size=vocab, eos_token_ids=(9,))._mask_stop_tokens(logits.clone(), seqs)
    want = logits.clone()
    want[0, [2, 6, 9]] = float("-inf")
    assert torch.equal(got, want)


def test_top_k_top_p_keep_exactly_the_nucleus_and_its_logits():
    """top-k first, then the smallest prefix of the sorted probabilities whose mass reaches top_p; the kept
    logits unchanged, every other one -inf."""
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15], [0.05, 0.4, 0.1, 0.3, 0.15]]))
    params = [SamplingParams(temperature=1.0, top_p=0.75), SamplingParams(temperature=1.0, top_k=2)]
    got = Sampler(vocab_size=5, eos_token_ids=())._top_k_top_p(logits.clone(), params)
    keep = [[1, 3, 4], [1, 3]]  # 0.4 + 0.3 < 0.75 so 0.15 is kept too; the two largest
    for row, kept in enumerate(keep):
        want = torch.full((5,), float("-inf"))
        want[kept] = logits[row, kept]
        assert torch.equal(got[row], want), (row, got[row])


def test_logprob_ranks_count_the_tokens_at_least_as_likely():
    """vLLM's rank: the sampled token's rank is the number of vocabulary tokens whose raw logprob is at least its own
    (1 for the argmax; counted here from a sort), the top-k are ranked 1..k; the values are log_softmax's."""
    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 2
    seqs = [Sequence(f"r{i}", 0, [0], SamplingParams(temperature=1.0, logprobs=k)) for i, k in enumerate((0, 1, 3, 5))]
    out = Sampler(vocab_size=50, eos_token_ids=())(logits.clone(), seqs).to_host().result()
    reference = logits.log_softmax(-1)
    for row, (token, (chosen, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        order = reference[row].argsort(descending=True).tolist()
        assert chosen.rank == order.index(token) + 1  # no ties in random fp32 logits
        assert chosen.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
        k = seqs[row].params.logprobs
        assert list(top) == order[:k] and [v.rank for v in top.values()] == list(range(1, k + 1))
