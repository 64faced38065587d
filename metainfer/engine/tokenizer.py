"""Tokenizer loading (model folder or GGUF, offline) and incremental detokenization."""

from __future__ import annotations

import hashlib
import os

from metainfer.config.errors import ConfigError
from metainfer.engine.sequence import Sequence


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


class IncrementalDetokenizer:
    """Decodes a sequence's new tokens into text without re-decoding everything.

    A window of earlier tokens is decoded with the new ones so that tokenizers that
    merge spaces or emit partial UTF-8 (shown as U+FFFD) produce the same text as a
    full decode; text ending in U+FFFD is held back until the character completes.
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
        start, tokens = seq.num_prompt_tokens + seq.detok_prefix_offset, seq.token_ids
        read, end = seq.num_prompt_tokens + seq.detok_read_offset, seq.num_known_tokens
        prefix = self._decode(tokens[start:read], skip)
        full = self._decode(tokens[start:end], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            seq.detok_prefix_offset = seq.detok_read_offset
            seq.detok_read_offset = end - seq.num_prompt_tokens
            seq.output_text += delta
            return delta
        return ""

    def flush(self, seq: Sequence) -> str:
        """At the end, emit whatever was held back (a full decode is authoritative)."""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        delta = text[len(seq.output_text):] if text.startswith(seq.output_text) else ""
        seq.output_text += delta
        return delta


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
