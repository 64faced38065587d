"""TokenTexts against the Qwen3 tokenizer's own decode: the decoded_token pieces of a text's ids join to the text,
including ids whose decode alone starts with a character's trailing bytes (U+FFFD at the start, not the end)."""

from __future__ import annotations

import random

import pytest

from metainfer.engine.token_texts import REPLACEMENT_CHAR, TokenTexts
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
    """The output tokens' texts as the server asks for them: each after the ids before it (back to the last whole
    one, the prompt's where the outputs have none: context_of), the last one ending the text (a length finish)."""
    pieces = []
    for i, t in enumerate(out):
        context, own = texts.context_of(out, i, prompt)
        pieces.append(texts.text(t, context, {}, own, final=i == len(out) - 1))
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


def test_a_run_of_partial_ids_of_any_length_joins_to_the_text(tok):
    """Byte tokens of characters, characters cut short and stray trailing bytes, many partial ids in a row (a run
    longer than any fixed window, as 🦜 + 🦜's first 3 bytes + 😀: 11 byte tokens): each output token's text, given
    the whole sequence before it, is its slice of the text (token_pieces), so a token never carries U+FFFDs an
    earlier one already carried; the context a caller reads (context_of: back to the last whole id) gives the same."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = enc("> ok")
    out = byte_ids(tok, "🦜".encode()) + byte_ids(tok, "🦜".encode()[:3]) + byte_ids(tok, "😀".encode()) + enc(" ok")
    texts = TokenTexts(tok)
    full = [texts.text(t, prompt + out[:i], {}, i, final=i == len(out) - 1) for i, t in enumerate(out)]
    assert full == token_pieces(tok, prompt, out)[1] == [""] * 3 + ["🦜"] + [""] * 6 + [FFFD + "😀", " ok"]
    assert _output_pieces(texts, prompt, out) == full

    rng, checked = random.Random(1), 0
    stray = byte_ids(tok, bytes(range(0x80, 0xC0)))
    while checked < 60:
        ids = enc("> ok")
        for _ in range(rng.randrange(3, 14)):
            data = rng.choice("é🦜中데😀").encode()
            ids += byte_ids(tok, data[:rng.randrange(1, len(data) + 1)]) if rng.random() < 0.8 else [rng.choice(stray)]
        ids += enc(rng.choice([" ok", "!", "请"]))
        partial = "".join("p" if FFFD in tok.decode([t]) else "w" for t in ids)
        cut = rng.randrange(1, len(ids))
        prompt, out = ids[:cut], ids[cut:]
        try:
            text, want, _ = token_pieces(tok, prompt, out)
        except AssertionError:  # a text whose shorter decodes are not its prefixes: no slices to compare with
            continue
        got = [texts.text(t, prompt + out[:i], {}, i, final=i == len(out) - 1) for i, t in enumerate(out)]
        assert got == want == _output_pieces(texts, prompt, out), (text, want, got)
        checked += max(map(len, partial.split("w"))) >= 12  # a run longer than 12 partial ids
    assert checked == 60


class _CountingTokenizer:
    """The Qwen tokenizer with its decode calls counted (and its byte-level decoder shown as its own)."""

    def __init__(self, tok):
        self.tok, self.backend_tokenizer, self.decodes = tok, tok.backend_tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.tok.decode(ids, **kwargs)


def test_a_whole_id_after_an_unfinished_character_costs_no_decode(tok):
    """After ids that end inside a character, an id whose decode alone is whole (its bytes start a character, so
    they cannot complete the held one) gets the U+FFFDs it settles + its own decode, without decoding (a byte-level
    BPE's decode is its ids' bytes joined): the same text as the decode after the context (text_after), with one
    window a position however many ids it lists; ids whose decode alone is partial still decode."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    lead = enc("请데이터")[1]
    rng = random.Random(2)
    vocab = [t for t in rng.sample(range(151000), 3000) if tok.decode([t])]
    whole = [t for t in vocab if FFFD not in tok.decode([t])]
    counting = _CountingTokenizer(tok)
    texts, reference = TokenTexts(counting), TokenTexts(tok)
    for t in vocab:
        texts.solo(t)
    contexts = [(enc("> ok") + [lead], None), (enc("> ok") + [lead], 0), (enc("> ok") + byte_ids(tok, b"\xf0\x9f"), 1),
                (enc("> ok") + byte_ids(tok, "데".encode()), None), (enc("> ") + [lead, lead, lead], 2)]
    for context, own in contexts:
        counting.decodes = 0
        befores: dict = {}
        got = [texts.text(t, context, befores, own) for t in whole]
        assert counting.decodes <= 8 < len(whole) // 100  # the position's window (and its context ids' own decodes)
        assert got == [reference.text_after(t, context, {}, own) for t in whole]
        partial = [t for t in vocab if t not in whole][:20]
        assert [texts.text(t, context, {}, own) for t in partial] == [
            reference.text_after(t, context, {}, own) for t in partial]
    assert any(p.startswith(FFFD * 2) for p in got)
