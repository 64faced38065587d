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
