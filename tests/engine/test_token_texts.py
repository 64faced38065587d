"""TokenTexts against the Qwen3 tokenizer's own decode: the decoded_token pieces of a text's ids join to the text,
including ids whose decode alone starts with a character's trailing bytes (U+FFFD at the start, not the end)."""

from __future__ import annotations

import random

import pytest

from metainfer.engine.token_texts import MAX_CONTEXT, REPLACEMENT_CHAR, TokenTexts
from tests.helpers.detok_reference import FFFD, byte_ids, token_pieces
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
    """Qwen has tokens of a literal U+FFFD followed by a letter ("\ufffds"): not trailing bytes, so after ids that end
    whole characters it is its own decode. After a lead byte left unfinished, or a token that ends in a literal U+FFFD
    (no decode tells it from a partial character: held back as one), it also settles the U+FFFD held before it, so the
    pieces join to the tokenizer's decode."""
    (token,) = tok.encode("\ufffds", add_special_tokens=False)
    assert tok.decode([token]) == "\ufffds"
    texts = TokenTexts(tok)
    assert texts.text(token, tok.encode("x", add_special_tokens=False)) == "\ufffds"
    unfinished = tok.encode("请데이터", add_special_tokens=False)[:-1]  # 请, then the lead byte of 데
    for context in (unfinished, tok.encode("x \ufffd", add_special_tokens=False)):
        ids = [*context, token]
        pieces = [texts.text(t, ids[:i]) for i, t in enumerate(ids)]
        assert "".join(pieces) == tok.decode(ids) and pieces[-1] == "\ufffd\ufffds"


def _output_pieces(texts: TokenTexts, prompt: list[int], out: list[int]) -> list[str]:
    """The output tokens' texts as the server asks for them: each after the ids before it (the prompt's last ones
    among them), the last one ending the text (a length finish)."""
    pieces = []
    for i, t in enumerate(out):
        context = (prompt + out[:i])[-MAX_CONTEXT:]
        pieces.append(texts.text(t, context, {}, own=min(i, len(context)), final=i == len(out) - 1))
    return pieces


def test_an_unfinished_character_is_settled_by_the_token_after_it(tok):
    """Random texts of words, characters and characters cut short (a lead byte, or a few bytes, that nothing
    completes), split into prompt and output anywhere: each output token's text is its slice of the output's text
    (the tokenizer's decode after the prompt) from the length of the text before it without the trailing U+FFFDs of
    a character not whole yet (token_pieces): the token after an unfinished character carries its U+FFFD, the last
    token keeps one the text ends with, and a prompt's unfinished character stays the prompt's."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    whole = [enc(" ok"), enc("!"), enc(" the"), enc("请"), enc(" 🦜"), enc("请데이터"),
             *(byte_ids(tok, c.encode()) for c in "é🦜中데")]
    cut_short = [*(byte_ids(tok, c.encode()[:k]) for c in "é🦜中" for k in range(1, len(c.encode()))),
                 enc(" 🦜")[:1], enc(" 🦜")[:2], enc("请데이터")[1:2]]
    texts, rng, checked = TokenTexts(tok), random.Random(0), []
    while len(checked) < 150:
        units = [rng.choice(cut_short if rng.random() < 0.5 else whole) for _ in range(rng.randrange(2, 9))]
        ids = [t for unit in units for t in unit]
        partial = "".join("p" if FFFD in tok.decode([t]) else "w" for t in ids)
        if max(map(len, partial.split("w"))) >= MAX_CONTEXT:  # more partial ids in a row than a position reads
            continue
        cut = rng.randrange(1, len(ids))
        prompt, out = ids[:cut], ids[cut:]
        text, want, _ = token_pieces(tok, prompt, out)
        assert _output_pieces(texts, prompt, out) == want, (tok.decode(prompt), text, want)
        checked.append(text)
    assert sum(FFFD in t.rstrip(FFFD) for t in checked) > 30 and sum(t.endswith(FFFD) for t in checked) > 10


def test_the_prompts_unfinished_character_stays_the_prompts(tok):
    """A prompt that ends with 데's lead byte: an output that completes it starts with 데이터; one that does not
    leaves the prompt's U+FFFD in the prompt (the completion is " ok"), and a second lead byte of its own is the
    output's, settled by the token after it."""
    lead, rest = tok.encode("请데이터", add_special_tokens=False)[1:]
    prompt, ok = tok.encode("> 请", add_special_tokens=False) + [lead], tok.encode(" ok", add_special_tokens=False)
    texts = TokenTexts(tok)
    for out, want in (([rest, *ok], ["데이터", " ok"]), (ok, [" ok"]), ([lead, *ok], ["", FFFD + " ok"]),
                      ([lead], [FFFD])):
        assert token_pieces(tok, prompt, out)[1] == want
        assert _output_pieces(texts, prompt, out) == want
