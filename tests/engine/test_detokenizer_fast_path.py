"""Incremental detokenization's decode (issue 23, item 4): where transformers' `decode` adds nothing to the Rust
tokenizer's (the Qwen3 tokenizer), the detokenizer calls the latter directly; it must give transformers' text
exactly, special tokens kept or skipped, partial UTF-8 included, and the streamed text must equal a full decode of
the output after the prompt."""

from __future__ import annotations

import random

import pytest

from metainfer.engine.sequence import Sequence
from metainfer.engine.tokenizer import IncrementalDetokenizer, _backend_decode, load_tokenizer
from metainfer.sampling_params import SamplingParams
from tests.helpers.detok_reference import text_after_prompt
from tests.helpers.tiny_models import qwen_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(qwen_tokenizer_dir())


def _id_lists(tokenizer, n=300, seed=0):
    rng = random.Random(seed)
    special = sorted(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    out = [[], [special[0]], [151643, 151645]]
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        out.append(ids)
    # multi-byte characters split across tokens: byte-level pieces of CJK text and an emoji
    text_ids = tokenizer.encode("中文字符测试 🙂 Grüße", add_special_tokens=False)
    out += [text_ids[:i] for i in range(1, len(text_ids) + 1)]
    return out


@pytest.mark.parametrize("skip", [False, True])
def test_the_backend_decode_equals_transformers_decode(tokenizer, skip):
    fast = _backend_decode(tokenizer)
    assert fast is not None, "the Qwen3 tokenizer should take the direct path"
    for ids in _id_lists(tokenizer):
        assert fast(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_a_tokenizer_with_clean_up_keeps_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert _backend_decode(tokenizer) is None
    assert IncrementalDetokenizer(tokenizer)._decode.__name__ == "_generic_decode"


@pytest.mark.parametrize("skip", [False, True])
def test_streamed_text_equals_a_full_decode(tokenizer, skip):
    detok = IncrementalDetokenizer(tokenizer)
    rng = random.Random(1)
    for ids in _id_lists(tokenizer, n=60, seed=2)[1:]:
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 5))]
        seq = Sequence("r", 0, prompt, SamplingParams(skip_special_tokens=skip))
        streamed = ""
        for token in ids:
            seq.token_ids.append(token)
            streamed += detok.update(seq)
        streamed += detok.flush(seq)
        # the output's text after the prompt (random prompt ids may end inside a character the output completes)
        assert streamed == seq.output_text == text_after_prompt(tokenizer, prompt, ids, skip), (prompt, ids)
