"""SamplingParams with vLLM's field names, defaults and validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from metainfer.engine.request_validation import InvalidRequestError, check_sampling_params


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request; validated on construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 mean "no top-k" (vLLM accepts both)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # the logprob of every prompt token after the first (and the top prompt_logprobs others) from the prompt's own
    # forward; such a request computes its whole prompt (no prefix-cache hit), as vLLM's does
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's / OpenAI's token constraints, applied to the logits before the penalties (logprobs stay the raw ones):
    # {token id: bias in [-100, 100]} added, and the only ids that may be sampled
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        elif self.stop is None:
            self.stop_strings = []
        else:
            raise InvalidRequestError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias) or None
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Check every field (again: they may have been changed after construction); raises a ValueError
        (`InvalidRequestError`, its `param` the field) naming the field. The engine adds the checks that
        need the model: metainfer/engine/request_validation.py."""
        check_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_token_constraints(self) -> bool:
        """logit_bias or allowed_token_ids set: the torch sampler's path (worker/sampler.py)."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
