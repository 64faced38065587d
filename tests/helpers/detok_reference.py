"""The output text a detokenizer must give, from the tokenizer's own decode (engine/tokenizer.py's contract): the
decode of prompt + output past the prompt's text."""

from __future__ import annotations

FFFD = "\ufffd"


def text_after_prompt(tok, prompt: list[int], out: list[int], skip: bool = True) -> str:
    """The decode of prompt + output past the prompt's text: the decode of the prompt where the full decode extends
    it; else (the prompt ends inside a character that the output completes, its U+FFFD replaced) the longest text of
    a leading part of the prompt's ids, with or without its trailing U+FFFD, that the full decode starts with (the
    whole prompt is read here, not the detokenizer's few ids)."""
    full = tok.decode(prompt + out, skip_special_tokens=skip)
    before = tok.decode(prompt, skip_special_tokens=skip)
    if not full.startswith(before):
        texts = [tok.decode(prompt[:k], skip_special_tokens=skip) for k in range(len(prompt) + 1)]
        before = max((t for text in texts for t in (text, text.rstrip(FFFD)) if full.startswith(t)), key=len)
    return full[len(before):]


def token_pieces(tok, prompt: list[int], out: list[int]) -> tuple[str, list[str], list[int]]:
    """(the output's text, each output token's text in it, each one's offset), from the tokenizer's decode alone: the
    offset of token i is the length of the text of the tokens before it without its trailing U+FFFDs (a character
    not whole yet, that a later token completes or shows unfinished), its text the slice up to the next offset (the
    last token's up to the end: the text of all the tokens keeps an unfinished character's U+FFFDs)."""
    text = text_after_prompt(tok, prompt, out)
    offsets = []
    for i in range(len(out)):
        before = text_after_prompt(tok, prompt, out[:i]).rstrip(FFFD)
        assert text.startswith(before) and before.startswith(text[:offsets[-1]] if offsets else ""), (prompt, out, i)
        offsets.append(len(before))
    return text, [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)])], offsets


def byte_ids(tok, data: bytes) -> list[int]:
    """`data` as byte-level BPE's single-byte tokens (one id a byte; all below 256 in Qwen's vocabulary): GPT-2's
    printable stand-in for each byte, written out here."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    stand_in = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [tok.convert_tokens_to_ids(stand_in[b]) for b in data]
