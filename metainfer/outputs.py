"""Request outputs, shaped like vLLM's so callers can switch engines by one import."""

from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A token's logprob, a float that also carries vLLM's `Logprob` fields: `.logprob` (the value), `.rank` (1 for
    the vocabulary's most likely token; the sampled or scored token's is the count of tokens at least as likely,
    vLLM's rule) and `.decoded_token` (its text alone, the tokenizer's `decode([id])`, except for a byte-level piece
    of a character, which gets what it adds to the text after the ids before it (engine/token_texts.py): set in every
    output of `LLMEngine.step` and `LLM.generate` when the engine has a tokenizer, else None; the server's engine
    process leaves it None, its HTTP process decodes what it answers). Unlike vLLM's, which gives "" to a token whose
    character never completes and carries no U+FFFD forward, the U+FFFDs of such a character go to the token after it
    (or to the token that ends the text), so the pieces of a text join to it. Code written for vLLM
    (`lp[token].logprob`) and code using logprobs as numbers both read it."""

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: its own and the top-k
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    # prompt tokens whose KV came from the prefix cache at admission (vLLM's field; 0 without a hit)
    num_cached_tokens: int = 0
    error: str | None = None  # set when a step failed because of this request (its finish_reason is "error")
    # SamplingParams.prompt_logprobs: per prompt token, {token: logprob} of it and the top others; None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class Metric:
    """One engine metric as `LLM.get_metrics()` reads it (vLLM's metrics reader: name, kind, value); the names are
    the server's `/metrics` names, so an offline run and a server report the same counters."""
    name: str
    kind: str  # "counter" (monotonic since the engine started) | "gauge" (now)
    value: float
    labels: dict[str, str] = field(default_factory=dict)  # beside model_name, as the server renders them
