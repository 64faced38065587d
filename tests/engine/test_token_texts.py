"""TokenTexts against the Qwen3 tokenizer's own decode: the decoded_token pieces of a text's ids join to the text,
including ids whose decode alone starts with a character's trailing bytes (U+FFFD at the start, not the end)."""

from __future__ import annotations

import pytest

from metainfer.engine.token_texts import REPLACEMENT_CHAR, TokenTexts
from tests.helpers.tiny_models import qwen_tokenizer_dir

transformers = pytest.importorskip("transformers")

TEXTS = ["请데이터", "데이터베이스와 한국어 텍스트", "好的あ数据", "I love 🍕 and 日本語 🦜🦜", "emoji 😀👍🏽 ok",
         "é“鸚”"]


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_tokenizers_decode(tok, text):
    """Position 0 has no context (a prompt's first token is never scored): the text starts with a whole token."""
    text = "> " + text
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    texts = TokenTexts(tok)
    pieces = [texts.text(t, ids[:i]) for i, t in enumerate(ids)]
    assert "".join(pieces) == text
    assert REPLACEMENT_CHAR not in "".join(pieces)


def test_a_token_that_starts_with_trailing_bytes_gets_the_character_it_ends(tok):
    """"请데이터" is [请, the lead byte of 데, a token of 데's two trailing bytes + 이터]: the last decodes alone to
    U+FFFD followed by 이터, so only a check for U+FFFD anywhere (not only at the end) gives it 데이터."""
    ids = tok.encode("请데이터", add_special_tokens=False)
    solo = [tok.decode([t]) for t in ids]
    assert solo[-1].startswith(REPLACEMENT_CHAR) and not solo[-1].endswith(REPLACEMENT_CHAR)
    texts = TokenTexts(tok)
    assert [texts.text(t, ids[:i]) for i, t in enumerate(ids)] == ["请", "", "데이터"]
    assert texts.text(ids[-1]) == solo[-1]  # without a context: its own decode


def test_whole_tokens_keep_their_own_decode(tok):
    ids = tok.encode("hello world, the cat", add_special_tokens=False)
    texts = TokenTexts(tok)
    assert [texts.text(t, ids[:i]) for i, t in enumerate(ids)] == [tok.decode([t]) for t in ids]


def test_a_literal_replacement_character_keeps_its_own_decode(tok):
    """Qwen has tokens of a literal U+FFFD followed by a letter ("\ufffds"): not trailing bytes, so after a lead byte
    (its character still open) or after a literal U+FFFD it is its own decode, as the pieces of the text say."""
    (token,) = tok.encode("\ufffds", add_special_tokens=False)
    lead = tok.encode("请데이터", add_special_tokens=False)[-2]
    texts = TokenTexts(tok)
    for context in ([lead], tok.encode("x \ufffd", add_special_tokens=False)):
        assert texts.text(token, context) == "\ufffds"
