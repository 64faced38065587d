"""Tokenizer loading (model folder or GGUF, offline) and incremental detokenization."""

from __future__ import annotations

import hashlib
import os

from metainfer.config.errors import ConfigError
from metainfer.engine.sequence import Sequence
from metainfer.engine.token_texts import REPLACEMENT_CHAR


def load_tokenizer(model_dir: str, gguf_file: str | None = None, tokenizer: str | None = None):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if tokenizer:
        if not has_vocabulary(tokenizer):
            raise ConfigError(f"tokenizer folder {tokenizer!r} has no tokenizer files that define a vocabulary "
                              f"({VOCABULARY_FILES})")  # the CLI names --tokenizer (with_option_name)
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if gguf_file is not None and not has_vocabulary(model_dir):
        return _gguf_tokenizer(gguf_file)  # a tokenizer_config.json beside the GGUF holds no vocabulary either
    if not has_vocabulary(model_dir):
        # transformers would return a tokenizer that encodes every prompt to zero tokens (tokenizer_config.json
        # alone) or fail with a message that names no folder (vocab.json without merges.txt)
        raise ConfigError(f"model folder {model_dir!r} has no tokenizer files that define a vocabulary "
                          f"({VOCABULARY_FILES}); pass a folder that has them with --tokenizer PATH "
                          "(LLM(tokenizer=PATH)), or build none for token-id prompts with "
                          "LLM(skip_tokenizer_init=True) (bench latency / throughput: --skip-tokenizer-init)")
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


# The files a vocabulary comes from, for the tokenizers of the supported architectures (Qwen2/3, Llama, DeepSeek-V2,
# Qwen3-MoE): a fast tokenizer's tokenizer.json; a SentencePiece (or tiktoken) tokenizer.model (Llama's slow
# tokenizer); a byte-level BPE's vocab.json with its merges.txt (Qwen2Tokenizer: one without the other fails).
# tokenizer_config.json names the class and the special tokens, no vocabulary.
_VOCABULARY_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
VOCABULARY_FILES = "tokenizer.json, tokenizer.model, or vocab.json with merges.txt"


def has_vocabulary(folder: str) -> bool:
    """Whether `folder` holds a set of tokenizer files that defines a vocabulary (_VOCABULARY_SETS)."""
    return any(all(os.path.isfile(os.path.join(folder, name)) for name in names) for names in _VOCABULARY_SETS)


def _gguf_tokenizer(gguf_file: str):
    """transformers converts a GGUF vocabulary in ~15 s; keep the result in a user cache."""
    from transformers import AutoTokenizer

    stat = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.abspath(gguf_file)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache_root = os.environ.get("METAINFER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "metainfer"))
    cached = os.path.join(cache_root, "tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_file)),
                                              gguf_file=os.path.basename(gguf_file), local_files_only=True)
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


# The fewest prompt ids the output is decoded after (all of a shorter prompt): more than the 3 tokens a prompt that
# ends inside a character can hold of it, so the context starts before that character; 5 as vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET. More where the 5th id from the end does not start a character.
CONTEXT_TOKENS = 5
MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 tokens


class IncrementalDetokenizer:
    """Decodes a sequence's new tokens into text without re-decoding everything.

    A window of earlier tokens is decoded with the new ones so that tokenizers that
    merge spaces or emit partial UTF-8 (shown as U+FFFD) produce the same text as a
    full decode; text ending in U+FFFD is held back until the character completes.
    The window starts inside the prompt (`seq.detok_context`, its last ids; a negative
    `detok_prefix_offset`), as vLLM's does, so the text is the output's text after the prompt:
    a Metaspace tokenizer (Llama-2, Mistral) keeps the space of a first "▁world", and the output
    of a prompt that ends inside a character starts with that whole character. `flush` decodes
    after the same context, so it agrees with the streamed text.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = _backend_decode(tokenizer) or self._generic_decode

    def _generic_decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def update(self, seq: Sequence) -> str:
        """Append the newly decodable text of `seq` to `seq.output_text`; return the delta. Runs for every
        streamed token: it reads only the window's tokens (not a copy of the whole output)."""
        skip = seq.params.skip_special_tokens
        context = self._context(seq, skip)
        start, read, end = seq.detok_prefix_offset, seq.detok_read_offset, seq.num_known_tokens - seq.num_prompt_tokens
        prefix = self._decode(_window(seq, start, read), skip) if start < read else ""
        full = self._decode(_window(seq, start, end), skip)
        if read == 0 and start < 0:  # the prefix is the prompt's context: it may end inside a character
            prefix = self._context_part(context, prefix, full, skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            delta = full[len(prefix):]
            if read > 0:  # the first window keeps its context: the prompt's end may be inside a character
                seq.detok_prefix_offset = read
            seq.detok_read_offset = end
            seq.output_text += delta
            return delta
        return ""

    def flush(self, seq: Sequence) -> str:
        """At the end, emit whatever was held back (a full decode, after the same context, is authoritative). A
        sequence a stop token ended (an EOS or one of stop_token_ids; `seq.finish_reason` set) keeps that token's id
        but not its text unless include_stop_str_in_output, as vLLM's detokenizer does (the engine and the server
        flush such a sequence without decoding the stop token first; text a caller decoded with it before the finish
        was known is cut back here)."""
        skip = seq.params.skip_special_tokens
        context = self._context(seq, skip)
        ids = seq.output_token_ids
        cut = bool(ids) and ended_by_stop_token(seq) and not seq.params.include_stop_str_in_output
        if cut:
            ids = ids[:-1]
        full = self._decode([*context, *ids], skip)
        before = self._decode(context, skip) if context else ""
        text = full[len(self._context_part(context, before, full, skip)):]
        if not text.startswith(seq.output_text):
            if cut and seq.output_text.startswith(text):  # the stop token's text, decoded before the finish was known
                seq.output_text = text
            return ""
        delta = text[len(seq.output_text):]
        seq.output_text += delta
        return delta

    def _context(self, seq: Sequence, skip: bool) -> list[int]:
        """The prompt's last ids that `seq`'s output is decoded after, chosen on first use: at least CONTEXT_TOKENS,
        from the latest id before those that starts a character (a Llama byte-fallback decode turns a whole run of
        byte tokens into U+FFFDs when it starts with a character's trailing byte, a byte-level one adds a U+FFFD)."""
        context = seq.detok_context
        if context is None:
            tail = seq.detok_prompt_tail
            for s in range(len(tail) - CONTEXT_TOKENS, -1, -1):
                if self._starts_a_character(tail[s:s + MAX_CHAR_TOKENS], skip):
                    context = list(tail[s:])
                    break
            else:  # a short prompt's ids, or none of them starts a character
                context = list(tail[-CONTEXT_TOKENS:])
            seq.detok_context, seq.detok_prefix_offset = context, -len(context)
        return context

    def _starts_a_character(self, ids: list[int], skip: bool) -> bool:
        """Whether the first of `ids` starts a character: the decode of it and the next few is text that does not
        start with U+FFFD (a trailing byte never does; a lead byte does until its character is whole). An id that
        decodes to nothing (a skipped special token) starts none: a context of those alone has no text, and the
        output would be decoded as the start of a text again (a Metaspace decoder strips its first space)."""
        for n in range(1, len(ids) + 1):
            text = self._decode(list(ids[:n]), skip)
            if text and not text.startswith(REPLACEMENT_CHAR):
                return True
        return False

    def _context_part(self, context: list[int], text: str, full: str, skip: bool) -> str:
        """The part of `full` (the text of `context` + output ids) that is the context's: its text `text` where
        `full` extends it. Else the context ends inside a character the output completes (its U+FFFD became that
        character): the longest text, with or without its trailing U+FFFD, of the context's leading ids that
        `full` starts with, so the output's text starts with the whole character (a Llama byte-fallback decode
        turns a whole run of byte tokens into U+FFFDs, so a shorter run's text can be the longer one). Where none
        is, `text` (its length is cut off)."""
        if full.startswith(text):
            return text
        best = None
        for k in range(len(context), 0, -1):
            part = text if k == len(context) else self._decode(context[:k], skip)
            for candidate in (part, part.rstrip(REPLACEMENT_CHAR)):
                if (best is None or len(candidate) > len(best)) and full.startswith(candidate):
                    best = candidate
        return text if best is None else best


def ended_by_stop_token(seq) -> bool:
    """Whether a stop token (an EOS, or one of stop_token_ids: `stop_reason` holds it) ended `seq`, not a stop
    string (`stop_reason` holds it) or a length."""
    return seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)


def _window(seq: Sequence, start: int, end: int) -> list[int]:
    """The ids of `seq` from `start` to `end`, both relative to the prompt's end; a negative start reads the
    prompt's last ids from `seq.detok_context` (a server choice holds its output ids only)."""
    p = seq.num_prompt_tokens
    if start >= 0:
        return seq.token_ids[p + start:p + end]
    context = seq.detok_context
    return [*context[len(context) + start:], *seq.token_ids[p:p + end]]


def _backend_decode(tokenizer):
    """The Rust tokenizer's decode where transformers' `decode` adds nothing to it (a tokenizers-backed
    tokenizer whose `_decode` is the base one, without clean-up of tokenization spaces): the same text without
    transformers' per-call conversions (~17 us a call, two calls a streamed token). None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if (backend is None or not isinstance(tokenizer, TokenizersBackend) or tokenizer.clean_up_tokenization_spaces
            or type(tokenizer)._decode is not TokenizersBackend._decode):
        return None
    return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class NoText:
    """The detokenizer of an engine built with skip_tokenizer_init: outputs carry token ids and empty text."""

    def update(self, seq: Sequence) -> str:
        return ""

    def flush(self, seq: Sequence) -> str:
        return ""
