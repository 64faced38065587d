"""The output text is the output's text after the prompt (vLLM's detokenizer starts its window inside the prompt),
checked against the tokenizers library's own decode of prompt + output: a Metaspace tokenizer (Llama-2, Mistral)
strips the leading space of a decode's first token, so decode(["▁world"]) is "world" but the completion of
"▁Hello" is " world"; a prompt that ends inside a UTF-8 character gives a completion that starts with the whole
character (Qwen3's byte-level tokens), not U+FFFD. Offline (streamed or decoded once by `flush`) and the server's
`RequestState` (streamed or not) give the same text."""

from __future__ import annotations

import random

import pytest

from metainfer import LLM, SamplingParams
from metainfer.engine.sequence import Sequence
from metainfer.engine.token_texts import TokenTexts
from metainfer.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from metainfer.entrypoints.openai.engine_loop import RequestState
from tests.helpers.detok_reference import FFFD, text_after_prompt, token_pieces
from tests.helpers.tiny_models import build_tiny_model, qwen_tokenizer_dir

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

WORDS = ["▁Hello", "▁world", "!", "▁foo", "bar", "▁"]
BYTES = [0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80]  # 中 and 😀 as byte-fallback tokens


def metaspace_tokenizer(decoder: str):
    """A tiny SentencePiece-style tokenizer: "▁"-prefixed words, <0xNN> byte tokens, Metaspace pre-tokenizer;
    `decoder` "metaspace" (Metaspace, prepend_scheme "first") or "llama" (Llama-2's tokenizer.json: Replace,
    ByteFallback, Fuse, Strip one leading space). Both strip the space of a decode's first token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *WORDS, *(f"<0x{b:02X}>" for b in BYTES)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "metaspace":
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def tok(request):
    return metaspace_tokenizer(request.param)


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(qwen_tokenizer_dir())


def offline_texts(detok, prompt, out, skip=True) -> tuple[list[str], str, str]:
    """(streamed deltas (update per token, then flush), their final text, the text of flush alone)."""
    params = SamplingParams(skip_special_tokens=skip)
    seq = Sequence("r", 0, prompt, params)
    deltas = []
    for token in out:
        seq.token_ids.append(token)
        deltas.append(detok.update(seq))
        assert seq.output_text == "".join(deltas)
    deltas.append(detok.flush(seq))
    once = Sequence("r", 0, prompt, params)
    once.token_ids += out
    detok.flush(once)
    return deltas, seq.output_text, once.output_text


def server_texts(detok, prompt, out, skip=True) -> tuple[list[str], str, str]:
    """The same through the HTTP process's RequestState: one token a step, a chunk read after each step (streamed),
    and all tokens at once with the output read only when finished (non-streamed)."""
    params = SamplingParams(skip_special_tokens=skip)
    state = RequestState("s", None, prompt, params, None, 0.0)
    texts = []
    for i, token in enumerate(out):
        done = i == len(out) - 1
        state.apply(done, 0, [([token], None, None, "length" if done else None, None, None)])
        texts.append(state.output(detok).outputs[0].text)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    whole = RequestState("w", None, prompt, params, None, 0.0)
    whole.apply(True, 0, [(list(out), None, None, "length", None, None)])
    return [b[len(a):] for a, b in zip(["", *texts], texts)], texts[-1], whole.output(detok).outputs[0].text


def assert_all_paths(detok, tok, prompt, out, skip=True) -> str:
    want = text_after_prompt(tok, prompt, out, skip)
    deltas, streamed, once = offline_texts(detok, prompt, out, skip)
    assert "".join(deltas) == streamed == once == want, (prompt, out, deltas, once, want)
    chunks, server_streamed, server_once = server_texts(detok, prompt, out, skip)
    assert "".join(chunks) == server_streamed == server_once == want, (prompt, out, chunks, server_once, want)
    return want


def ids(tok, *tokens) -> list[int]:
    return tok.convert_tokens_to_ids(list(tokens))


@pytest.mark.parametrize("decode_path", ["backend", "transformers"])
def test_a_completion_keeps_the_space_of_its_first_token(tok, decode_path):
    detok = IncrementalDetokenizer(tok)
    if decode_path == "transformers":
        detok._decode = detok._generic_decode
    prompt, out = ids(tok, "▁Hello"), ids(tok, "▁world", "!", "▁foo", "bar")
    assert tok.decode(out) == "world! foobar"  # the output decoded alone: what the text was without the prompt
    assert assert_all_paths(detok, tok, prompt, out) == " world! foobar"
    assert tok.decode(prompt) + " world! foobar" == tok.decode(prompt + out)


@pytest.mark.parametrize("skip", [True, False])
def test_a_bos_prompt_and_special_tokens(tok, skip):
    detok = IncrementalDetokenizer(tok)
    assert_all_paths(detok, tok, ids(tok, "<s>"), ids(tok, "▁world", "</s>"), skip)
    assert_all_paths(detok, tok, ids(tok, "<s>", "▁Hello"), ids(tok, "</s>", "▁world", "bar"), skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_at_the_prompts_end_are_not_all_of_the_context(tok, skip):
    """Five skipped special tokens after the text: a context of them alone decodes to nothing, and the output's
    first space would be stripped again ("world!" against " world!")."""
    detok = IncrementalDetokenizer(tok)
    prompt = ids(tok, "▁Hello", *["</s>"] * 5)
    assert assert_all_paths(detok, tok, prompt, ids(tok, "▁world", "!"), skip).startswith(" world")


def test_an_empty_prompt_decodes_the_output_alone(tok):
    detok = IncrementalDetokenizer(tok)
    out = ids(tok, "▁world", "!", "▁foo")
    assert assert_all_paths(detok, tok, [], out) == tok.decode(out) == "world! foo"


@pytest.mark.parametrize("skip", [True, False])
def test_random_prompts_and_outputs_equal_the_decode_in_context(tok, skip):
    """Words, specials and whole byte-fallback characters, split into prompt and output anywhere, inside a
    character too (the "llama" decoder then gives U+FFFD for the prompt's partial bytes)."""
    units = [[w] for w in WORDS + ["<s>", "</s>"]] + [["<0xE4>", "<0xB8>", "<0xAD>"],
                                                     ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]]
    detok, rng = IncrementalDetokenizer(tok), random.Random(0)
    for _ in range(150):
        seq = [t for _ in range(rng.randrange(2, 9)) for t in ids(tok, *rng.choice(units))]
        cut = rng.randrange(len(seq))  # the engine gives at least one token
        assert_all_paths(detok, tok, seq[:cut], seq[cut:], skip)


def test_a_byte_fallback_run_completed_by_the_output(tok):
    """Llama-2's decoder turns every byte token of a run that is not valid UTF-8 into U+FFFD: a prompt that ends
    with 中's three byte tokens and 😀's first shows four U+FFFD, yet the completion is 😀 and what follows, not
    中 (its bytes are the prompt's)."""
    prompt = ids(tok, "▁Hello", "<0xE4>", "<0xB8>", "<0xAD>", "<0xF0>")
    out = ids(tok, "<0x9F>", "<0x98>", "<0x80>", "▁world", "<0xE4>", "<0xB8>", "<0xAD>", "!")
    detok, llama = IncrementalDetokenizer(tok), tok.backend_tokenizer.decoder.__class__.__name__ == "Sequence"
    want = assert_all_paths(detok, tok, prompt, out)
    if llama:
        assert tok.decode(prompt) == "Hello" + FFFD * 4 and want == "😀 world中!"
    # the prompt's 5th id from the end is 😀's last byte: the context starts at its first (a run that starts with a
    # trailing byte decodes to U+FFFDs only), so the output's 😀, which continues the run, is whole
    prompt = ids(tok, "▁Hello", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0xE4>", "<0xB8>", "<0xAD>")
    out = ids(tok, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁world")
    want = assert_all_paths(detok, tok, prompt, out)
    if llama:
        assert tok.decode(prompt[-5:] + out) == FFFD * 9 + " world" and want == "😀 world"


def _splits_inside_a_character(qwen, text):
    token_ids = qwen.encode(text, add_special_tokens=False)
    assert qwen.decode(token_ids) == text
    return token_ids, [i for i in range(1, len(token_ids)) if qwen.decode(token_ids[:i]).endswith(FFFD)]


@pytest.mark.parametrize("text", ["> 请데이터 ok", "I love 🍕 and 日本語 🦜🦜", "é“鸚” 데이터베이스와 한국어"])
def test_a_prompt_that_ends_inside_a_character_gives_the_whole_character(qwen, text):
    """Token-id prompts cut inside a character: the completion is the rest of the text from that character's
    start (what the prompt's text has before its U+FFFD is the prompt's), with no U+FFFD."""
    detok = IncrementalDetokenizer(qwen)
    token_ids, cuts = _splits_inside_a_character(qwen, text)
    assert cuts, "the text should have a token boundary inside a character"
    for cut in cuts:
        prompt, out = token_ids[:cut], token_ids[cut:]
        want = assert_all_paths(detok, qwen, prompt, out)
        assert want == text[len(qwen.decode(prompt).rstrip(FFFD)):] and FFFD not in want
        assert qwen.decode(out).startswith(FFFD)  # decoded alone: the character's trailing bytes


def test_a_replacement_character_the_output_does_not_replace_stays_the_prompts(qwen):
    """A prompt ending in a literal U+FFFD, or in a lead byte that the output never completes: the U+FFFD is the
    prompt's text, the completion is only what follows it."""
    detok = IncrementalDetokenizer(qwen)
    literal = qwen.encode("x \ufffd", add_special_tokens=False)
    assert assert_all_paths(detok, qwen, literal, qwen.encode(" ok", add_special_tokens=False)) == " ok"
    token_ids, cuts = _splits_inside_a_character(qwen, "> 请데이터")
    open_prompt = token_ids[:cuts[0]]
    assert assert_all_paths(detok, qwen, open_prompt, qwen.encode("ab c", add_special_tokens=False)) == "ab c"


def test_the_engine_streams_the_text_in_context(tmp_path):
    """One tiny model with the Metaspace tokenizer: the offline engine's text, decoded once or streamed, is the
    completion of the prompt in context (allowed_token_ids keeps the output to the tokenizer's words)."""
    tok = metaspace_tokenizer("metaspace")
    folder = str(tmp_path)
    build_tiny_model(folder, "qwen3", initializer_range=0.1)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).unlink(missing_ok=True)
    tok.save_pretrained(folder)
    llm = LLM(folder, device="cpu", dtype="float32")
    prompt = ids(tok, "<s>", "▁Hello")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=ids(tok, "▁world", "!", "▁foo", "bar"))
    offline = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    out = list(offline.token_ids)
    want = text_after_prompt(tok, prompt, out)
    assert len(out) == 12 and offline.text == want != tok.decode(out, skip_special_tokens=True)
    engine = llm.llm_engine
    engine.add_request("streamed", {"prompt_token_ids": prompt}, params, stream=True)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == offline.text


def test_byte_fallback_token_texts_settle_unfinished_characters():
    """Llama-2's byte-fallback decoder gives one U+FFFD per byte token of a run that is not valid UTF-8: the token
    after a character cut short (bytes that nothing completes) carries all of them, the one that completes a
    character the character, the last one those the text ends with; so the output tokens' texts are their slices of
    the output's text (token_pieces: from the tokenizer's decode) and join to it. Texts are words each followed by
    at most one character or cut-short character (a run of byte tokens that holds a whole character and then a
    cut-short one turns the whole character into U+FFFDs once more: TokenTexts' known limit); the words have no
    "▁" (the decode of a "▁" word alone has no space: its own decode, as vLLM's decode([id]), is not its slice)."""
    tok = metaspace_tokenizer("llama")
    byte_tokens = lambda data: ids(tok, *(f"<0x{b:02X}>" for b in data))  # noqa: E731
    chars = [byte_tokens(c.encode()) for c in "中😀"]
    cut_short = [byte_tokens(c.encode()[:k]) for c in "中😀" for k in range(1, len(c.encode()))]
    texts, rng, checked = TokenTexts(tok), random.Random(0), []
    while len(checked) < 150:
        units = []
        for _ in range(rng.randrange(1, 6)):
            units.append(ids(tok, rng.choice(["!", "bar"])))
            if rng.random() < 0.7:
                units.append(rng.choice(chars + cut_short))
        seq = [t for unit in units for t in unit]
        if len(seq) < 2:
            continue
        cut = rng.randrange(1, len(seq))
        prompt, out = seq[:cut], seq[cut:]
        text, want, _ = token_pieces(tok, prompt, out)
        got = []
        for i, t in enumerate(out):
            context, own = texts.context_of(out, i, prompt)
            got.append(texts.text(t, context, {}, own, final=i == len(out) - 1))
        assert got == want, (tok.decode(prompt), text, want)
        checked.append(text)
    assert sum(FFFD * 2 in t.rstrip(FFFD) for t in checked) > 10 and sum(t.endswith(FFFD) for t in checked) > 10
