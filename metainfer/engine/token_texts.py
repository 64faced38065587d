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
vLLM differs here on purpose: it gives "" to a token whose character never completes and carries no U+FFFD forward,
so its pieces drop those U+FFFDs; these keep them, so the pieces join to the text and a completions text_offset
indexes it.

That needs the position's context and a few decodes, done here for the engine's sampled and prompt positions alike,
and for the server's answers (OpenAIServing.token_texts_at). The context is the ids before the position back to the
last one whose decode alone is whole (`context_of`): the text is settled there, however many partial ids follow it
(a run of byte tokens as long as the sequence is read whole; a run of n partial ids costs the position O(n): the
walk back and decodes of up to n ids). Costs once the decodes alone are cached: an id whose decode alone is whole,
after an id whose decode alone is whole (most of them), takes two dict look-ups (the id's decode and the one
before's; the caller's context_of a third); after a context that ends inside a character, the same and a string
join where the tokenizer is a byte-level BPE (its decode of ids is the UTF-8 of their bytes joined, so such an id
adds the U+FFFDs it settles + its own decode: `_carried`), else a decode; an id whose decode alone is partial takes a
decode of the ids from the last point where the text ends whole characters (found once a position, at most SCAN
points back, else the whole id before the run) and the id. A known limit: a Llama byte-fallback decode turns a
whole run of byte tokens into U+FFFDs when any of it is not valid UTF-8, so a character already given to its last
byte's token can turn back into U+FFFDs when a later byte of the same run opens one that never completes; such
pieces do not join exactly.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"  # what a decode gives for an incomplete UTF-8 character
# the most points a position's window tries, back from its end, for the last one where the text ends whole characters
# (a valid character's bytes are at most 4 ids); past them it pieces from the whole id before the run of partial ids
SCAN = 8

# how a choice's last token id ends its text (text_ending)
ENDS_TEXT = "text"  # the text is the decode of all the ids: the last keeps the U+FFFDs of a character left unfinished
ENDS_AT_STOP_TOKEN = "stop token"  # a stop token whose text is left out: the id before it ends the text


def text_ending(finish_reason: str | None, stop_reason, include_stop_str_in_output: bool) -> str | None:
    """How the last id of a finished output ends its text: ENDS_TEXT for a length, or a stop token whose text is kept
    (include_stop_str_in_output); ENDS_AT_STOP_TOKEN for a stop token (an EOS or one of stop_token_ids: stop_reason
    not a string) whose text is left out; None for a stop string (the text is cut there), an abort, an error, or an
    output not finished."""
    if finish_reason == "length":
        return ENDS_TEXT
    if finish_reason == "stop" and not isinstance(stop_reason, str):
        return ENDS_TEXT if include_stop_str_in_output else ENDS_AT_STOP_TOKEN
    return None


def _byte_level(tokenizer) -> bool:
    """Whether `tokenizer` decodes with a byte-level BPE decoder alone (GPT-2's: Qwen, Llama 3, DeepSeek): ids decode
    to the UTF-8 of their bytes joined, U+FFFD for each bad run, so an id that decodes whole alone (its bytes start a
    character) decodes after any ids as their decode + its own."""
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return False
    return isinstance(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None), ByteLevel)


class TokenTexts:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._solo: dict[int, str] = {}  # each id's decode alone, met so far
        self._byte_level = _byte_level(tokenizer)

    def solo(self, token: int) -> str:
        """The tokenizer's decode of the id alone (`decode([id])`, special tokens kept, as the server's top_logprobs
        keys are), cached."""
        text = self._solo.get(token)
        if text is None:
            text = self._solo[token] = self.tokenizer.decode([token])
        return text

    def last_whole(self, ids, end: int) -> int:
        """The index of the last id of ids[:end] whose decode alone is whole (no U+FFFD): the text of the ids up to
        it ends whole characters and it starts one; -1 where there is none."""
        solo = self._solo
        i = end - 1
        while i >= 0:
            text = solo.get(ids[i])
            if text is None:
                text = self.solo(ids[i])
            if REPLACEMENT_CHAR not in text:
                return i
            i -= 1
        return -1

    def context_of(self, ids, end: int, before=()) -> tuple[list[int], int]:
        """(the context of the position `end` of `ids`: its ids before it back to the last one whose decode alone is
        whole, where the text before is settled; with none, back to the start of `before` + ids, `before` being the
        ids ahead of `ids` (a completion's prompt), read from its last whole id the same way; how many of the context
        are `ids`'). Only those ids are copied, whatever the sequence's length."""
        if end:  # most often the id before the position is whole (a dict look-up)
            text = self._solo.get(ids[end - 1])
            if text is not None and REPLACEMENT_CHAR not in text:
                return [ids[end - 1]], 1
        i = self.last_whole(ids, end)
        if i >= 0 or not before:
            start = max(i, 0)
            return list(ids[start:end]), end - start
        return [*before[max(self.last_whole(before, len(before)), 0):], *ids[:end]], end

    def text(self, token: int, context: list[int] | tuple = (), befores: dict | None = None, own: int | None = None,
             final: bool = False) -> str:
        """The decoded_token of `token` at a position after the ids `context` (back to the last id whose decode alone
        is whole, or to the text's start: `context_of`): its decode alone where that is whole and the context ends
        whole characters (an id whose decode alone holds no U+FFFD), else what it adds to the text after the context
        (`text_after`; `befores`: the position's memo, shared by the ids of one position; `own`, `final`:
        text_after's)."""
        solo = self._solo
        text = solo.get(token)
        if text is None:
            text = self.solo(token)
        if not context:
            return text
        if befores is None:
            befores = {}
        if REPLACEMENT_CHAR not in text:  # whole alone: its own decode, unless the context ends inside a character
            before = solo.get(context[-1])
            if REPLACEMENT_CHAR not in (self.solo(context[-1]) if before is None else before):
                return text
            if text and self._byte_level:  # it settles what is held back, then adds its own decode
                carried = befores.get("carried", False)
                if carried is False:
                    carried = befores["carried"] = self._carried(context, befores, own)
                if carried is not None:
                    return carried + text
        return self.text_after(token, context, befores, own, final)

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
        held, before, others, _ = self._window_of(context, befores, own)
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

    def unfinished(self, context, own: int | None = None) -> str:
        """The U+FFFDs the text of the ids `context` ends with (a character not whole yet, held back so far) that are
        the pieced text's: what its last id keeps where the text ends there (`final`) beyond what it added; "" where
        the context ends whole characters or its last id is another text's (`own` 0)."""
        if not context or own == 0 or REPLACEMENT_CHAR not in self.solo(context[-1]):
            return ""
        last, before, befores = context[-1], context[:-1], {}
        own = None if own is None else own - 1
        added = self.text_after(last, before, befores, own)
        kept = self.text_after(last, before, befores, own, final=True)
        return kept[len(added):] if kept.startswith(added) else ""

    def _window_of(self, context, befores: dict, own: int | None) -> tuple[list[int], str, list[str], str]:
        window = befores.get("window")
        if window is None:
            window = befores["window"] = self._window(context, own)
        return window

    def _carried(self, context, befores: dict, own: int | None) -> str | None:
        """What an id whose decode alone is whole adds before its own decode after the ids `context` (a byte-level
        BPE's: text_after of it is the held text past `before`, + its decode): the U+FFFDs it settles, "" where the
        text ends whole characters or they are another text's; None where the other text's decodes reach past the
        held text (text_after then)."""
        _, before, others, text = self._window_of(context, befores, own)
        for other in others:
            if len(other) > len(text):
                return None
            if len(other) > len(before) and text.startswith(other):
                before = other
        return text[len(before):] if text.startswith(before) else None

    def _window(self, context, own: int | None) -> tuple[list[int], str, list[str], str]:
        """(the held ids with the whole id before them, their text without its trailing U+FFFDs, the texts, with and
        without their trailing U+FFFDs, of their leading ids up to each of those that are not the pieced text's: as
        the detokenizer's _context_part, the longest that a decode with the token starts with is the other text's,
        their text with its trailing U+FFFDs) for `text_after`. The decodes start at the context's last id whose
        decode alone is whole (or its start: the text's), where the text before is settled."""
        decode, n = self.tokenizer.decode, len(context)
        last = self.last_whole(context, n)
        base = max(last, 0)
        end, text = n, None  # the last point where the text ends whole characters: after the whole id, or a decode
        while end > last + 1 and n - end < SCAN:  # from it (or the context's start) that ends whole, SCAN tried
            piece = decode(context[base:end])
            if end == n:
                text = piece
            if piece and not piece.endswith(REPLACEMENT_CHAR):
                break
            end -= 1
        else:
            end = last + 1  # none: the held text starts at the whole id (or the context's start)
        start = last if last >= 0 and end == last + 1 else end
        held = context[start:]
        if text is None or start != base:
            text = self.solo(held[0]) if len(held) == 1 else decode(held) if held else ""
        first = 0 if own is None else n - own  # where the pieced text's ids begin
        others = []
        for stop in range(max(end, start + 1, first - SCAN), first + 1):
            other = decode(context[start:stop])
            others += [other, other.rstrip(REPLACEMENT_CHAR)]
        return list(held), text.rstrip(REPLACEMENT_CHAR), others, text

    def fill(self, entry: dict, context: list[int] | tuple = (), own: int | None = None, final: bool = False) -> None:
        """Set the decoded_token of each Logprob of one position ({id: Logprob}; `context`: the ids before it, as
        `text` takes them, of which the last `own` are the same text's: None, all; `final`: the position's token ends
        the text)."""
        befores: dict = {}
        for token, logprob in entry.items():
            logprob.decoded_token = self.text(token, context, befores, own, final)
