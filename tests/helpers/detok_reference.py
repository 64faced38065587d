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
