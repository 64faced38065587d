"""Logprob.decoded_token: the text of each id a logprob entry names, as vLLM's output processor gives it.

Why a module of its own: the text of most ids is their decode alone (cached per engine), but a byte-level token
inside a multi-byte character decodes alone to text with U+FFFD in it: at its end (it starts or continues a
character) or at its start (it ends one and holds more text, as Qwen's token of 데's trailing bytes + 이터). Such a
token gets what it adds to the text after the ids before its position instead, so the pieces of a character join to
it (vLLM corrects these too, with its own split: there a token holding text before a partial byte, such as " " + a
lead byte, gives "" and the last byte's token the space with the character; here the space goes with the token that
holds it; vLLM's context is also the sampled ids only, this one the whole sequence).

What a token adds is counted as the detokenizer holds text back: a decode's trailing U+FFFDs (a character not whole
yet) are nobody's until a later token settles them, either completing the character (its token gets the character)
or showing it never completes (its token gets the U+FFFDs, then its own text: the id after an unfinished character
gets "\ufffd" + " ok", though " ok" alone decodes whole). So the pieces of a sequence join to its decode, the
U+FFFDs of an unfinished character included, and each token's offset is the length of the pieces before it. The
last token of a finished text (`final`) keeps what is still held back, as the full decode does. Where the ids
before a position are another text's (a completion's prompt: `own` counts the ids that are not), a partial
character the output does not complete stays that text's, as the detokenizer keeps it in the prompt's text.

That needs the position's context and a few decodes, done here for the engine's sampled and prompt positions alike,
and for the server's answers (OpenAIServing.token_texts_at); an id whose decode alone is whole after ids that end
whole characters (most of them) costs one dict look-up. A known limit: a Llama byte-fallback decode turns a whole run
of byte tokens into U+FFFDs when any of it is not valid UTF-8, so a character already given to its last byte's token
can turn back into U+FFFDs when a later byte of the same run opens one that never completes; such pieces do not
join exactly.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decode gives for an incomplete UTF-8 character
MAX_CONTEXT = 8  # ids before a position read: a held-back run (a partial character or a few) and the id before it


class TokenTexts:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._solo: dict[int, str] = {}  # each id's decode alone, met so far

    def solo(self, token: int) -> str:
        """The tokenizer's decode of the id alone (`decode([id])`, special tokens kept, as the server's top_logprobs
        keys are), cached."""
        text = self._solo.get(token)
        if text is None:
            text = self._solo[token] = self.tokenizer.decode([token])
        return text

    def text(self, token: int, context: list[int] | tuple = (), befores: dict | None = None, own: int | None = None,
             final: bool = False) -> str:
        """The decoded_token of `token` at a position after the ids `context` (its last MAX_CONTEXT are read): its
        decode alone where that is whole and the context ends whole characters (an id whose decode alone holds no
        U+FFFD), else what it adds to the text after the context (`text_after`; `befores`: the position's memo,
        shared by the ids of one position; `own`, `final`: text_after's)."""
        solo = self._solo
        text = solo.get(token)
        if text is None:
            text = self.solo(token)
        if not context:
            return text
        if REPLACEMENT_CHAR not in text:  # whole alone: its own decode, unless the context ends inside a character
            before = solo.get(context[-1])
            if REPLACEMENT_CHAR not in (self.solo(context[-1]) if before is None else before):
                return text
        return self.text_after(token, context, {} if befores is None else befores, own, final)

    def text_after(self, token: int, context, befores: dict, own: int | None = None, final: bool = False) -> str:
        """What `token` adds to the text after the ids `context`, U+FFFDs held back as the detokenizer holds them:
        the decode of held + [token] past the decode of held (both without their trailing U+FFFDs, unless `final`:
        the text ends here and keeps them), `held` being the context's ids after the last point where its text ends
        whole characters (with the whole id before them, where there is one, so a Metaspace decode keeps the space
        of what follows). So a token that starts or continues a character adds what comes before its partial bytes
        (often ""), the one that ends it adds the character, and one that shows a held character never completes
        adds its U+FFFDs before its own text. `own`: how many of the context's last ids are of the text being
        pieced (None: all); a partial character of the ids before those that this token's text does not complete
        stays theirs. Where the decodes do not extend each other (see the module's limit), the id's own decode."""
        window = befores.get("window")
        if window is None:
            window = befores["window"] = self._window(list(context)[-MAX_CONTEXT:], own)
        held, before, others = window
        full = self.tokenizer.decode([*held, token])
        kept = full if final else full.rstrip(REPLACEMENT_CHAR)
        for other in others:  # the other text's, with the partial characters this token's text does not complete
            if len(other) > len(before) and full.startswith(other):
                before = other
        if kept.startswith(before):
            return kept[len(before):]
        if before.startswith(kept):
            return ""  # nothing settled yet
        return self.solo(token)

    def _window(self, context: list[int], own: int | None) -> tuple[list[int], str, list[str]]:
        """(the held ids with the whole id before them, their text without its trailing U+FFFDs, the texts, with and
        without their trailing U+FFFDs, of their leading ids up to each of those that are not the pieced text's: as
        the detokenizer's _context_part, the longest that a decode with the token starts with is the other text's)
        for `text_after`."""
        decode, n = self.tokenizer.decode, len(context)
        whole = [REPLACEMENT_CHAR not in self.solo(t) for t in context]
        texts: dict[int, str] = {}  # decode(context[start:]) of the window that ends at the context's end
        end = n  # the last point where the text ends whole characters: after a whole id, or a decode from the
        while end > 0 and not whole[end - 1]:  # whole id before it (or the context's start) that ends whole
            start = next((i for i in range(end - 2, -1, -1) if whole[i]), 0)
            text = decode(context[start:end])
            if end == n:
                texts[start] = text
            if text and not text.endswith(REPLACEMENT_CHAR):
                break
            end -= 1
        start = end - 1 if end > 0 and whole[end - 1] else end
        held = context[start:]
        text = texts.get(start)
        if text is None:
            text = decode(held) if held else ""
        first = 0 if own is None else n - own  # where the pieced text's ids begin
        others = []
        for stop in range(max(end, start + 1), first + 1):
            other = decode(context[start:stop])
            others += [other, other.rstrip(REPLACEMENT_CHAR)]
        return held, text.rstrip(REPLACEMENT_CHAR), others

    def fill(self, entry: dict, context: list[int] | tuple = (), own: int | None = None) -> None:
        """Set the decoded_token of each Logprob of one position ({id: Logprob}; `context`: the ids before it, of
        which the last `own` are the same text's: None, all)."""
        befores: dict = {}
        for token, logprob in entry.items():
            logprob.decoded_token = self.text(token, context, befores, own)
