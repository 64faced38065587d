"""The logprob entries a sequence carries: its scored prompt positions, and the texts (decoded_token) of its
sampled positions' Logprobs, kept apart from LLMEngine's step loop (engine/token_texts.py decodes them)."""

from __future__ import annotations

import itertools

from metainfer.engine.sequence import Sequence
from metainfer.engine.token_texts import ENDS_AT_STOP_TOKEN, ENDS_TEXT, TokenTexts
from metainfer.outputs import Logprob


def store_prompt_logprobs(scored, entries: list[tuple[float, dict[int, float]]]) -> None:
    """A step's scored prompt tokens into their sequences (by position: a recomputed prompt rescores the same)."""
    for (seq, position), target, (chosen, top) in zip(scored.owners, scored.targets, entries):
        k = seq.params.prompt_logprobs  # the step's top list is as long as its largest k; it is sorted
        top = top if k == -1 else dict(itertools.islice(top.items(), k))  # -1: the whole vocabulary
        seq.prompt_logprobs[position] = {**top, target: chosen}


def prompt_logprobs(first: Sequence) -> list[dict[int, float] | None] | None:
    """A request's prompt logprobs once every prompt token is scored (its samples share one prompt: pass the first
    sample; a copy, as the other output lists)."""
    scored = first.prompt_logprobs
    if scored is None or (len(scored) > 1 and scored[-1] is None):
        return None
    return list(scored)


def fill_sampled_texts(texts: TokenTexts, seq: Sequence, entry: dict, token: int, ending: str | None) -> None:
    """The decoded_token of the sampled position's Logprobs (engine/token_texts.py), after the ids before it. The
    token that ends a finished text keeps the U+FFFDs of a character it leaves unfinished, as the text does
    (`ending`: text_ending); a stop token whose text is left out gets its own decode, and the token before it,
    which then ends the text, gets its position's texts again (a new dict: outputs streamed before keep theirs)."""
    index = seq.num_known_tokens - 1  # this token's (pending ones are read in order)
    context, own = text_context(texts, seq, index)
    texts.fill(entry, context, own, final=ending == ENDS_TEXT)
    if ending == ENDS_AT_STOP_TOKEN:
        entry[token].decoded_token = texts.solo(token)
        if own:  # the token before it is an output (else the prompt's, whose text stays as it is)
            before = {t: Logprob(lp, lp.rank) for t, lp in seq.output_logprobs[-2].items()}
            texts.fill(before, *text_context(texts, seq, index - 1), final=True)
            seq.output_logprobs[-2] = before


def text_context(texts: TokenTexts, seq: Sequence, index: int) -> tuple[list[int], int]:
    """The ids before the output position `index` of `seq` that its token texts read (TokenTexts.context_of), and
    how many of them are outputs (the rest are the prompt's)."""
    context, _ = texts.context_of(seq.token_ids, index)
    return context, min(len(context), index - seq.num_prompt_tokens)
