"""Every per-request value checked in one place, before a request is queued.

A value that passes these checks cannot make a step raise: ranges, finiteness (NaN and infinity
compare false against every bound, so they are refused explicitly), types (a bool is not an integer
here), integer width (every integer must fit an int64, the width the sampler's tensors use) and the
vocabulary (token ids the sampler indexes with). `SamplingParams` runs `check_sampling_params` on
construction and again when the engine adds it (the object may have changed); the engine adds the
checks that need the model and its options (`check_request`); the server and the CLI reach both
through those two, so a bad value gets the same message everywhere. An `InvalidRequestError` names
the offending field in `.param` (the server's 400 body uses it).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The sampler works in float32: a value finite in float64 can round to 0 or to infinity there (top_p 1e-300 kept
# no token, repetition_penalty 1e-300 divided by zero, temperature 1e39 became inf). These bounds keep every
# float inside float32's useful range.
MAX_TEMPERATURE = 1e4  # above it sampling is uniform anyway
MIN_PROBABILITY = 1e-6  # the smallest top_p, and the smallest min_p other than 0 (off)
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value


class InvalidRequestError(ValueError):
    """A request value the engine refuses; `param` is the field's name (vLLM's / OpenAI's spelling)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _all_ints(values) -> bool:
    """`_is_int` of every element. Plain ints are decided by one C-level pass over the element types (a
    throughput run's 148,779 prompt ids took ~0.25 s through the per-element isinstance checks, twice)."""
    return set(map(type, values)) <= {int} or all(_is_int(t) for t in values)


def _is_number(value) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(p, name: str, low: int, high: int = INT64_MAX, none_ok: bool = False, what: str = "") -> None:
    value = getattr(p, name)
    if value is None and none_ok:
        return
    if not _is_int(value) or not low <= value <= high:
        bound = f"in [{low}, {high}]" if high != INT64_MAX else f">= {low} (and fit in int64)"
        raise InvalidRequestError(name, f"{name} must be an integer {what or bound}, got {value!r}")


def _float(p, name: str, low: float, high: float, low_open: bool = False, zero_ok: bool = False) -> None:
    """`name` must be a finite number in the range; `zero_ok`: 0 too (a filter's "off" below the range)."""
    value = getattr(p, name)
    if zero_ok and _is_number(value) and value == 0:
        return
    ok = _is_number(value) and math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        span = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else \
            (f"> {low:g}" if low_open else f">= {low:g}")
        what = f"0 (off) or a finite number {span}" if zero_ok else f"a finite number {span}"
        raise InvalidRequestError(name, f"{name} must be {what}, got {value!r}")


def check_sampling_params(p) -> None:
    """The checks that need nothing but the parameters themselves (raise InvalidRequestError)."""
    _int(p, "n", 1)
    _float(p, "temperature", 0.0, MAX_TEMPERATURE)
    _float(p, "top_p", MIN_PROBABILITY, 1.0)
    if p.top_k != -1:
        _int(p, "top_k", 0, what=">= 0, or -1 (0 and -1: disabled; it must fit in int64)")
    _float(p, "min_p", MIN_PROBABILITY, 1.0, zero_ok=True)
    _int(p, "seed", INT64_MIN, none_ok=True, what=f"in [{INT64_MIN}, {INT64_MAX}] (int64)")
    _int(p, "max_tokens", 1, none_ok=True)
    _int(p, "min_tokens", 0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidRequestError("min_tokens", f"min_tokens must be <= max_tokens ({p.max_tokens}), "
                                                f"got {p.min_tokens!r}")
    for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (vLLM's; check_request bounds it)
        _int(p, name, -1, none_ok=True, what=">= 0 or -1 (the whole vocabulary; it must fit in int64)")
    _float(p, "presence_penalty", -2.0, 2.0)
    _float(p, "frequency_penalty", -2.0, 2.0)
    _float(p, "repetition_penalty", *REPETITION_PENALTY_RANGE)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        if not isinstance(getattr(p, name), bool):
            raise InvalidRequestError(name, f"{name} must be true or false, got {getattr(p, name)!r}")
    if not isinstance(p.stop_token_ids, list) or not all(_is_int(t) and 0 <= t <= INT64_MAX
                                                         for t in p.stop_token_ids):
        raise InvalidRequestError("stop_token_ids", "stop_token_ids must be a list of non-negative integer token "
                                                    f"ids, got {p.stop_token_ids!r}"[:300])
    if p.logit_bias is not None:
        bias = p.logit_bias
        if not isinstance(bias, dict) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in bias):
            raise InvalidRequestError("logit_bias", "logit_bias must map non-negative integer token ids to biases, "
                                                    f"got {bias!r}"[:300])
        if not all(_is_number(b) and math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                   for b in bias.values()):
            raise InvalidRequestError("logit_bias", "logit_bias values must be finite numbers in "
                                                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"[:300])
    if p.allowed_token_ids is not None:
        allowed = p.allowed_token_ids
        if not isinstance(allowed, list) or not allowed or not all(_is_int(t) and 0 <= t <= INT64_MAX
                                                                   for t in allowed):
            raise InvalidRequestError("allowed_token_ids", "allowed_token_ids must be a non-empty list of "
                                                           f"non-negative integer token ids, got {allowed!r}"[:300])
    if not all(isinstance(s, str) and s for s in p.stop_strings):
        raise InvalidRequestError("stop", f"stop must be a string or a list of non-empty strings, got {p.stop!r}"[:300])


@dataclass(frozen=True)
class RequestLimits:
    """What the engine's model and options allow one request (EngineConfig.max_n, max_logprobs)."""

    vocab_size: int  # the larger of the model's and the tokenizer's vocabularies: any id either can name
    max_model_len: int
    max_n: int
    max_logprobs: int  # -1: no cap (the model's vocabulary bounds a request's logprobs either way)
    kv_tokens: int | None = None  # the KV pool's size in tokens: what one request's samples may hold at once
    shared_prompt: bool = True  # prefix caching: the samples of a request share its prompt's KV blocks


def check_prompt_ids(ids) -> list[int]:
    """A prompt given as token ids: a non-empty list (or tuple, or a 1-D numpy / torch array) of integers (numpy's
    too), returned as a list of Python ints. Their range is checked by `check_request`."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError("prompt", f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    if not ids:
        raise InvalidRequestError("prompt", "prompt_token_ids must not be empty")
    plain = set(map(type, ids)) <= {int}  # one C-level pass (see _all_ints)
    if not plain and not all(_is_int(t) for t in ids):
        raise InvalidRequestError("prompt", "prompt_token_ids must be a list of integers")
    return list(ids) if plain else [int(t) for t in ids]


def check_prompt_length(prompt_token_ids: list[int], max_model_len: int) -> None:
    """A prompt longer than the context is refused (also by the server's HTTP process before it ships the ids)."""
    if len(prompt_token_ids) > max_model_len:
        raise InvalidRequestError("prompt", f"prompt is {len(prompt_token_ids)} tokens long, longer than "
                                            f"max_model_len ({max_model_len})")


def check_request(p, prompt_token_ids: list[int], model_vocab_size: int, limits: RequestLimits) -> None:
    """Everything `check_sampling_params` checks, plus the bounds that need the model and the engine's
    options. `prompt_token_ids` must index the model's embedding (`model_vocab_size`)."""
    check_sampling_params(p)
    if p.n > limits.max_n:
        raise InvalidRequestError("n", f"n must be <= {limits.max_n} (the engine's max_n: one request's samples "
                                       f"may not fill the batch), got {p.n}")
    for name in ("logprobs", "prompt_logprobs"):
        _check_num_logprobs(name, getattr(p, name), model_vocab_size, limits.max_logprobs)
    bad = [t for t in p.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be in [0, {limits.vocab_size}) (the "
                                                    f"vocabulary), got {bad[:5]}")
    for name, ids in (("logit_bias", p.logit_bias or ()), ("allowed_token_ids", p.allowed_token_ids or ())):
        bad = [t for t in ids if t >= model_vocab_size]
        if bad:  # they index the logits, whose width is the model's vocabulary
            raise InvalidRequestError(name, f"{name} token ids must be in [0, {model_vocab_size}) (the model's "
                                            f"vocabulary), got {bad[:5]}")
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "prompt_token_ids must not be empty")
    check_prompt_length(prompt_token_ids, limits.max_model_len)
    if not _all_ints(prompt_token_ids):
        raise InvalidRequestError("prompt", "prompt_token_ids must be a list of integers")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= model_vocab_size:
        bad = [t for t in prompt_token_ids if not 0 <= t < model_vocab_size]
        raise InvalidRequestError("prompt", f"prompt_token_ids contain ids outside [0, {model_vocab_size}): "
                                            f"{bad[:5]}")
    if limits.kv_tokens is not None and p.n > 1:
        need = kv_tokens_needed(p, len(prompt_token_ids), limits)
        if need > limits.kv_tokens:
            longest = len(prompt_token_ids) + max_new_tokens(p, len(prompt_token_ids), limits.max_model_len)
            raise InvalidRequestError("n", f"n={p.n} samples of up to {longest} tokens need "
                                           f"{need} tokens of KV cache, more than the engine's {limits.kv_tokens}; "
                                           "lower n or max_tokens")


def _check_num_logprobs(name: str, asked: int | None, model_vocab_size: int, max_logprobs: int) -> None:
    """`asked` (a `logprobs` / `prompt_logprobs` value, -1 the whole vocabulary) within the engine's
    `max_logprobs` (-1: no cap but the vocabulary itself), as vLLM's processor bounds it. The sampler resolves -1
    to the same vocabulary (worker/sampler.py)."""
    if asked is None:
        return
    cap = model_vocab_size if max_logprobs == -1 else max_logprobs
    if asked == -1 and model_vocab_size > cap:
        raise InvalidRequestError(name, f"{name}=-1 requests the whole vocabulary ({model_vocab_size} logprobs a "
                                        f"token), which is greater than max allowed: {cap} (the engine's "
                                        "max_logprobs; max_logprobs=-1 lifts the cap)")
    if asked > cap:
        what = "the model's vocabulary: the engine's max_logprobs is -1" if max_logprobs == -1 else \
            "the engine's max_logprobs"
        raise InvalidRequestError(name, f"{name} must be <= {cap} ({what}), got {asked}")


def kv_tokens_needed(p, prompt_len: int, limits: RequestLimits) -> int:
    """The request's token budget: the KV its samples hold together at their longest. Beyond the pool they
    would preempt each other over and over and hold the whole pool while every other request waits."""
    new = max_new_tokens(p, prompt_len, limits.max_model_len)
    return (prompt_len + p.n * new) if limits.shared_prompt else p.n * (prompt_len + new)


def check_fan_out(num_prompts: int, n: list[int], max_n: int) -> None:
    """One client request (a server request with a list of prompts, `n[i]` samples each) may ask for at most
    `max_n` choices in all: 20,000 one-token prompts held the engine for minutes while a small request waited."""
    if sum(n) > max_n:
        raise InvalidRequestError("prompt", f"prompt: {num_prompts} prompts x n={max(n)} is {sum(n)} choices, "
                                            f"more than the engine's max_n ({max_n}); send fewer prompts or "
                                            "lower n")


def check_group_budget(needs: list[int], limits: RequestLimits) -> None:
    """The token budget of one client request's engine requests together (`kv_tokens_needed` each)."""
    total = sum(needs)
    if limits.kv_tokens is not None and len(needs) > 1 and total > limits.kv_tokens:
        raise InvalidRequestError("prompt", f"prompt: {len(needs)} prompts need {total} tokens of KV cache "
                                            f"together, more than the engine's {limits.kv_tokens}; send fewer "
                                            "prompts or lower n or max_tokens")


def max_new_tokens(p, prompt_len: int, max_model_len: int) -> int:
    """The tokens a request can generate: max_tokens clamped to the context left after its prompt
    (vLLM's server answers 400 instead; the engine stops at max_model_len either way, with
    finish_reason "length")."""
    left = max_model_len - prompt_len
    return left if p.max_tokens is None else min(p.max_tokens, left)
