"""Logprob.decoded_token: the text of each id a logprob entry names, as vLLM's output processor gives it.

Why a module of its own: the text of most ids is their decode alone (cached per engine), but a byte-level token
inside a multi-byte character decodes alone to text with U+FFFD in it: at its end (it starts or continues a
character) or at its start (it ends one and holds more text, as Qwen's token of 데's trailing bytes + 이터). Such a
token gets what it adds to the text after the ids before its position instead, so the pieces of a character join to
it (vLLM corrects these too, with its own split: there a token holding text before a partial byte, such as " " + a
lead byte, gives "" and the last byte's token the space with the character; here the space goes with the token that
holds it; vLLM's context is also the sampled ids only, this one the whole sequence). That needs the position's
context and a few decodes, done here for the engine's sampled and prompt positions alike, and for the server's
answers (OpenAIServing.token_texts_at). A known limit: the decodes cannot tell a literal U+FFFD from a partial
character where it ends a token ("\ufffd", " \ufffd") or comes just before one, so such a token adds "" or less than its
text and those pieces do not join exactly (a literal U+FFFD followed by other text in a token is kept: _stands_alone).
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decode gives for an incomplete UTF-8 character
MAX_CONTEXT = 4  # ids before a position tried (a UTF-8 character is at most 4 bytes)


class TokenTexts:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._solo: dict[int, str] = {}  # each id's decode alone, met so far

    def text(self, token: int, context: list[int] | tuple = (), befores: dict | None = None) -> str:
        """The decoded_token of `token` at a position after the ids `context` (its last MAX_CONTEXT are read): the
        tokenizer's decode of the id alone (`decode([id])`, special tokens kept, as the server's top_logprobs keys
        are), except where that holds an incomplete character (U+FFFD anywhere) and a context is given (`text_after`;
        `befores`: the position's context decodes, shared by the ids of one position)."""
        text = self._solo.get(token)
        if text is None:
            text = self._solo[token] = self.tokenizer.decode([token])
        if context and REPLACEMENT_CHAR in text:
            befores = {} if befores is None else befores
            if not text.endswith(REPLACEMENT_CHAR) and self._stands_alone(token, text, context, befores):
                return text  # a literal U+FFFD inside the token (Qwen has "\ufffds"), not trailing bytes
            return self.text_after(token, context, befores)
        return text

    def _stands_alone(self, token: int, text: str, context, befores: dict) -> bool:
        """Whether the token's decode after the last context id is just the two decodes side by side: nothing of
        it completes a character that id opened."""
        key = ("raw", 1)
        before = befores.get(key)
        if before is None:
            before = befores[key] = self.tokenizer.decode(list(context[-1:]))
        return self.tokenizer.decode([*context[-1:], token]) == before + text

    def text_after(self, token: int, context, befores: dict) -> str:
        """What `token` adds to the text after the ids `context` (the last 1-4 of them, fewest first, until the
        character it ends is complete): the decode of context + [token] past the decode of context, each without
        its trailing U+FFFD. So a token that only starts or continues a character adds what it completes before it
        (often "", or the text before its partial byte, such as a space), the one that ends it adds the character,
        and the pieces join to the text. Where the decodes do not extend each other, the token's own decode.
        `befores` memoises decode(context[-n:]) per n for the position."""
        decode, piece = self.tokenizer.decode, None
        for n in range(1, min(MAX_CONTEXT, len(context)) + 1):
            before = befores.get(n)
            if before is None:
                before = befores[n] = decode(list(context[-n:])).rstrip(REPLACEMENT_CHAR)
            full = decode([*context[-n:], token])
            if not full.startswith(before):
                continue
            piece = full.rstrip(REPLACEMENT_CHAR)[len(before):]
            if not full.endswith(REPLACEMENT_CHAR):
                return piece
        return piece if piece is not None else self.text(token)

    def fill(self, entry: dict, context: list[int] | tuple = ()) -> None:
        """Set the decoded_token of each Logprob of one position ({id: Logprob}; `context`: the ids before it)."""
        befores: dict[int, str] = {}
        for token, logprob in entry.items():
            logprob.decoded_token = self.text(token, context, befores)
