"""The one-pass Gumbel-max sampling kernel (kernels/sampling.py) against its references: with given
uniforms, the token of every row equals the torch formula's (greedy rows: torch.argmax, ties to the
first index); with its own Philox noise, draws follow softmax(logits / T) (chi-square), also when the
vocabulary is split over several programs; and the Sampler takes it only for plain batches."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels.sampling import GumbelSampler, gumbel_sample_ref, sample_splits
from tests.helpers.kernel_devices import DEVICE


def _uniform(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g).clamp_(1e-7, 1 - 1e-7).to(DEVICE)


@pytest.mark.parametrize("vocab, pad", [(100, 0), (3000, 13)])  # one split; 3 splits, padded LM-head rows
@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gumbel_sample_matches_the_formula_with_given_noise(vocab, pad, batch, dtype):
    g = torch.Generator().manual_seed(vocab + batch)
    logits = (torch.randn(batch, vocab + pad, generator=g) * 3).to(dtype).to(DEVICE)
    temps = torch.tensor([0.0, 0.5, 1.3, 0.0, 2.0, 0.7, 1.0][:batch], device=DEVICE)
    noise = _uniform((batch, vocab), seed=batch)
    sampler = GumbelSampler(8, vocab, DEVICE)
    got = sampler(logits, temps, seed=1, noise=noise)
    assert got.dtype == torch.int64 and got.shape == (batch,)
    torch.testing.assert_close(got, gumbel_sample_ref(logits, temps, vocab, noise), rtol=0, atol=0)
    greedy = temps == 0
    assert torch.equal(got[greedy], logits[greedy, :vocab].float().argmax(-1))
    assert int(sampler.counters.abs().sum()) == 0  # left zeroed for the next launch


def test_greedy_ties_take_the_first_index_across_splits():
    vocab = 3000
    assert sample_splits(2, vocab) > 1
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, [2999, 1500, 7]] = 5.0   # the maximum in three splits: the first index wins
    logits[1, [2048, 2049]] = 1.0
    out = GumbelSampler(2, vocab, DEVICE)(logits, torch.zeros(2, device=DEVICE), seed=3)
    assert out.tolist() == [7, 2048] == logits.argmax(-1).tolist()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.slow  # 36-45 s a case interpreted; the fast tier samples in the other tests
@pytest.mark.parametrize("vocab, hot, rows", [(6, [0, 1, 2, 3, 4, 5], 512), (2500, [5, 1200, 2400], 128)])
def test_philox_draws_follow_softmax_over_temperature(vocab, hot, rows):
    """Rows share one distribution; 10 seeds x `rows` draws (5,120 over 6 tokens: a temperature of
    0.6 or 0.8 instead of 0.7 fails the bound). `hot` columns carry the mass (the rest at -30:
    never drawn in practice); with 2,500 columns they sit in three splits."""
    temperature = 0.7
    base = torch.full((vocab,), -30.0)
    base[hot] = torch.linspace(1.0, -0.5, len(hot))
    logits = base.expand(rows, vocab).contiguous().to(DEVICE)
    sampler = GumbelSampler(rows, vocab, DEVICE)
    temps = torch.full((rows,), temperature, device=DEVICE)
    draws = torch.cat([sampler(logits, temps, seed=seed) for seed in range(10)]).cpu()
    assert set(draws.tolist()) <= set(hot)
    counts = torch.bincount(draws, minlength=vocab)[hot].double()
    probs = torch.softmax(base[hot].double() / temperature, 0)
    # chi-square critical values at p = 1e-4: 25.7 (5 dof), 18.4 (2 dof); deterministic seeds
    assert _chi_square(counts, probs) < {6: 25.7, 3: 18.4}[len(hot)]
    assert len(set(draws.tolist())) == len(hot)  # it samples, it does not take the argmax


def test_every_column_draws_its_own_noise():
    """Flat logits at temperature 1 draw every column alike: the 3,000 columns in 12 bins of 250 (each tile of
    1,024 columns is four sub-tiles sharing one Philox evaluation: a sub-tile reusing another's uniforms never
    wins a tie-free race, and rows sharing a counter draw the same column)."""
    vocab, rows = 3000, 32
    assert sample_splits(rows, vocab) == 3
    sampler = GumbelSampler(rows, vocab, DEVICE)
    logits, temps = torch.zeros(rows, vocab, device=DEVICE), torch.ones(rows, device=DEVICE)
    draws = torch.cat([sampler(logits, temps, seed=seed) for seed in range(10)]).cpu()
    assert len(set(draws[:rows].tolist())) > rows * 3 // 4  # rows of one launch draw apart
    counts = torch.bincount(draws // 250, minlength=12).double()
    # chi-square critical value with 11 dof at p ~ 2e-4: 35.6; deterministic seeds
    assert _chi_square(counts, torch.full((12,), 1 / 12, dtype=torch.float64)) < 35.6


@pytest.mark.parametrize("programs", [1, 2])  # one program a row (5 tiles), or two splits of 3 tiles
def test_programs_scanning_many_tiles_match_the_formula(monkeypatch, programs):
    """Fewer programs, so each scans several 1,024-column tiles (greedy rows two a step): with given noise every
    row equals the reference; ties in later tiles resolve to the first index; padded columns never win."""
    import metainfer.kernels.sampling as sampling

    monkeypatch.setattr(sampling, "_TARGET_PROGRAMS", programs)
    vocab, pad, batch = 5000, 24, 4
    assert sample_splits(1, vocab) == programs
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(batch, vocab + pad, generator=g)
    logits[:, vocab:] = 1e30  # padded LM-head rows: never a token
    logits[0, [4100, 1500, 3500]] = 50.0  # greedy: the maximum in tiles 4, 1, 3; the first index wins
    logits[1, [3000, 4999]] = 40.0  # temperature 1e-3: the two ties are decided by the noise alone
    logits = logits.to(DEVICE)
    temps = torch.tensor([0.0, 1e-3, 0.8, 0.0], device=DEVICE)
    noise = _uniform((batch, vocab), seed=9)
    sampler = GumbelSampler(batch, vocab, DEVICE)
    got = sampler(logits, temps, seed=1, noise=noise)
    torch.testing.assert_close(got, gumbel_sample_ref(logits, temps, vocab, noise), rtol=0, atol=0)
    assert got[0] == 1500 and got[1] in (3000, 4999) and int(got.max()) < vocab
    assert got[3] == logits[3, :vocab].argmax()


def test_no_noise_is_a_shifted_copy_of_another(monkeypatch):
    """One program a row over two tiles (flat logits, temperature 1): draws spread over the 8 sub-tiles alike,
    and no row's draw is its neighbour's moved by a tile (what rows sharing a range of Philox counters give:
    row r's first tile keyed like row r-1's second)."""
    import metainfer.kernels.sampling as sampling

    monkeypatch.setattr(sampling, "_TARGET_PROGRAMS", 1)
    vocab, rows = 2048, 64
    sampler = GumbelSampler(rows, vocab, DEVICE)
    assert sampler._launch_shape(rows)[0] == 1
    logits, temps = torch.zeros(rows, vocab, device=DEVICE), torch.ones(rows, device=DEVICE)
    draws = torch.stack([sampler(logits, temps, seed=seed) for seed in range(5)]).cpu()  # [seeds, rows]
    shifted = int(((draws[:, 1:] - draws[:, :-1]).abs() == 1024).sum())
    assert shifted <= 3  # independent rows: ~0.3 of 315 pairs; rows keyed as their neighbour's copy: ~80
    counts = torch.bincount(draws.flatten() // 256, minlength=8).double()
    # chi-square critical value with 7 dof at p = 1e-4: 29.9
    assert _chi_square(counts, torch.full((8,), 1 / 8, dtype=torch.float64)) < 29.9


def test_nan_and_all_masked_rows_give_valid_ids():
    """NaN counts as +inf (torch.argmax picks the first NaN); a row of -inf gives 0, never an id
    outside the vocabulary (it would feed the next step's embedding lookup)."""
    vocab = 3000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[0, 1234] = float("nan")
    logits[1] = float("-inf")
    logits[2, 2500] = float("nan")
    logits[3] = float("-inf")
    for temps in (torch.zeros(4), torch.tensor([0.0, 0.0, 0.9, 0.9])):
        out = GumbelSampler(4, vocab, DEVICE)(logits, temps.to(DEVICE), seed=7).tolist()
        assert out == [1234, 0, 2500, 0]
    assert logits[:2].argmax(-1).tolist() == [1234, 0]  # torch.argmax agrees on the greedy rows


def test_seed_changes_the_draws_and_repeats_them():
    vocab, rows = 50, 64
    logits = torch.zeros(rows, vocab, device=DEVICE)
    temps = torch.ones(rows, device=DEVICE)
    sampler = GumbelSampler(rows, vocab, DEVICE)
    a, b, c = (sampler(logits, temps, seed=s) for s in (11, 11, 12))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(set(a.tolist())) > 10  # rows get their own noise


def test_gumbel_sampler_argument_errors():
    sampler = GumbelSampler(2, 100, DEVICE)
    logits = torch.zeros(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        sampler(logits[:, :50], torch.zeros(2, device=DEVICE), seed=0)
    with pytest.raises(ValueError, match="temperatures"):
        sampler(logits, torch.zeros(2, device=DEVICE, dtype=torch.float64), seed=0)
    with pytest.raises(ValueError, match="batch"):
        sampler(torch.zeros(3, 100, device=DEVICE), torch.zeros(3, device=DEVICE), seed=0)
    with pytest.raises(ValueError, match="noise"):
        sampler(logits, torch.zeros(2, device=DEVICE), seed=0, noise=torch.rand(2, 10, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU sampler wiring test")
def test_sampler_takes_the_kernel_only_for_plain_batches(monkeypatch):
    from metainfer.engine.sequence import Sequence
    from metainfer.sampling_params import SamplingParams
    from metainfer.worker.sampler import Sampler

    vocab = 40
    kernel = GumbelSampler(4, vocab, "cpu")
    calls = []
    class Counting:  # the kernel, its calls recorded
        zero_temperatures = kernel.zero_temperatures

        def __call__(self, *a):
            calls.append(a)
            return kernel(*a)

    sampler = Sampler(vocab, (0,), "cpu", fused=Counting(), seed=5)
    torch_path = Sampler(vocab, (0,), "cpu")

    def seqs(**kw):
        return [Sequence(f"r{i}", i, [1, 2, 3], SamplingParams(max_tokens=4, **kw)) for i in range(3)]

    logits = torch.randn(3, vocab + 8, generator=torch.Generator().manual_seed(0))
    greedy = sampler(logits, seqs(temperature=0.0))
    assert len(calls) == 1 and torch.equal(greedy.token_ids, torch_path(logits, seqs(temperature=0.0)).token_ids)
    sampler(logits, seqs(temperature=0.8))
    assert len(calls) == 2 and calls[1][2] != calls[0][2]  # a fresh seed each step
    for kw in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(seed=3), dict(logprobs=2),
               dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
               dict(min_tokens=2)):  # min_tokens pending: EOS masked by the torch path
        sampler(logits, seqs(temperature=0.8, **kw))
    assert len(calls) == 2  # none of those is plain: the torch path


@pytest.mark.slow
def test_aot_compile_sm90_sampling_kernel():
    from tests.helpers.aot import run_aot_check

    run_aot_check(["sampling"])
