"""Vocab-parallel embedding (masked lookup + all-reduce, vocabulary padded to a multiple of
tp) and the parallel LM head (logits gathered to rank 0, cut to the true vocabulary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer.distributed.launch import run_on_ranks
from metainfer.distributed.parallel_state import tp_state
from metainfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tests.helpers.tensors import randn

H = 8


def _ranks(tp, cls, vocab, weight):
    layers = []
    for rank in range(tp):
        with tp_state(rank, tp):
            layer = cls(vocab, H)
        layer.weight.weight_loader(layer.weight, weight)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("vocab", [509, 512])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_embedding_shards_pad_and_sum_to_full(vocab, tp):
    weight = randn(vocab, H, seed=1)
    ids = torch.tensor([0, 1, vocab // 2, vocab - 2, vocab - 1, 127, 128, 255, 256])
    layers = _ranks(tp, VocabParallelEmbedding, vocab, weight)
    rows = -(-vocab // tp)
    partials = []
    for rank, layer in enumerate(layers):
        assert tuple(layer.weight.shape) == (rows, H)
        real = min(rows, vocab - rank * rows)
        torch.testing.assert_close(layer.weight[:real], weight[rank * rows:rank * rows + real])
        assert not layer.weight[real:].any(), "padding rows must be zero"
        layer.reduce = lambda y: partials.append(y.clone()) or y
        out = layer(ids)
    if tp == 1:  # one rank: a plain lookup, no reduce at all
        assert not partials
        torch.testing.assert_close(out, F.embedding(ids, weight))
    else:
        torch.testing.assert_close(torch.stack(partials).sum(0), F.embedding(ids, weight))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lm_head_shards_concat_to_full_logits(tp):
    vocab = 509
    weight, hidden = randn(vocab, H, seed=2), randn(4, H, seed=3)
    layers = _ranks(tp, ParallelLMHead, vocab, weight)
    shards = []
    for layer in layers:
        layer.gather = lambda y: shards.append(y.clone()) or y
        layer(hidden)
    assert all(s.shape == (4, -(-vocab // tp)) for s in shards)
    torch.testing.assert_close(torch.cat(shards, -1)[:, :vocab], F.linear(hidden, weight))


def test_loaders_reject_an_already_sliced_tensor():
    with tp_state(1, 2):
        embed, head = VocabParallelEmbedding(509, H), ParallelLMHead(509, H)
    for layer in (embed, head):
        with pytest.raises(ValueError, match="expected"):
            layer.weight.weight_loader(layer.weight, randn(255, H))


def _vocab_over_gloo(rank: int, world: int) -> tuple:
    vocab = 509
    weight = randn(vocab, H, seed=4)
    embed, head = VocabParallelEmbedding(vocab, H), ParallelLMHead(vocab, H)
    embed.weight.weight_loader(embed.weight, weight)
    head.weight.weight_loader(head.weight, weight)
    x = embed(torch.tensor([0, 5, 170, 340, 508]))
    return x, head(x), head(x[:0])


@pytest.mark.tp
def test_embedding_and_lm_head_with_real_collectives():
    world, vocab = 3, 509  # 509 = 3 * 170 - 1: the last rank holds a padding row
    weight = randn(vocab, H, seed=4)
    ref = F.embedding(torch.tensor([0, 5, 170, 340, 508]), weight)
    for rank, (x, logits, empty) in enumerate(run_on_ranks(_vocab_over_gloo, world)):
        torch.testing.assert_close(x, ref)  # every rank gets the summed lookup
        if rank == 0:  # only rank 0 samples, so only rank 0 has the whole vocabulary
            torch.testing.assert_close(logits, F.linear(ref, weight), rtol=1e-5, atol=1e-5)
            assert tuple(empty.shape) == (0, vocab)
        else:
            assert tuple(logits.shape) == (5, 170)
