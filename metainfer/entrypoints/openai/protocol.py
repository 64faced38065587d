"""Request bodies of the OpenAI-compatible server (pydantic, strict types) and their checks.

Strict mode: a string where a number belongs is an error (400), not a silent coercion; JSON
integers are still accepted for float fields. Unknown fields are ignored, as OpenAI's own
server does. vLLM's sampling extras (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `allowed_token_ids`,
`repetition_penalty`, ...) are accepted in the body. Options we parse but do not implement
are refused with a 400 naming them (`check_supported`, and `_UNSUPPORTED_FIELDS`: vLLM's guided decoding, beam search
and the like), never silently ignored. A null for a field with a default (n, stream, ...) is that default, as vLLM's
Optional fields take it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from metainfer.engine.request_validation import INT64_MAX, MAX_LOGIT_BIAS
from metainfer.entrypoints.openai.errors import bad_request, from_engine_error, from_validation_error
from metainfer.outputs import RequestOutput
from metainfer.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # the default of EngineConfig.max_logprobs; the endpoints pass the engine's own
# chat_template_kwargs may not override how the template is called
# (apply_chat_template's own keywords and those it passes to the template's render())
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "continue_final_message", "tokenize",
    "add_generation_prompt", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens"})
# the optional sampling fields passed to SamplingParams only when the client set them
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "stop", "stop_token_ids", "allowed_token_ids")


# vLLM request fields that change what is generated or returned and that this server does not implement: a body that
# sets one (to anything but null, false or empty) is a 400 naming it, not an answer that silently lacks it
_UNSUPPORTED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                       "guided_whitespace_pattern", "structured_outputs", "bad_words", "use_beam_search",
                       "truncate_prompt_tokens", "return_tokens_as_token_ids", "logits_processors", "prompt_embeds",
                       "functions", "function_call")
# output constraints: any value but null asks for one (vLLM takes `{}` as "any JSON" and `""` as a regex that only the
# empty text matches), so an empty one is refused too; for the other fields an empty value asks for nothing
_CONSTRAINT_FIELDS = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"})


def _clamp_bias(value):
    """A logit_bias value in OpenAI's [-100, 100] (vLLM's server clamps; a non-number passes to be refused)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    return value


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(_clamp_bias(value))


Body = TypeVar("Body", bound=BaseModel)


def parse_request(body: bytes, model: type[Body]) -> Body:
    """The raw body validated against `model`; a bad body is a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc, model) from None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """A null for a field whose type has no null but which has a default (n, stream, echo, ...) is unset, as
        vLLM's Optional fields read it; where null means something (max_tokens: no limit) or the field is required,
        it stays as sent."""
        if isinstance(data, dict):
            defaulted = {k for k, f in cls.model_fields.items()
                         if not f.is_required() and type(None) not in get_args(f.annotation)}
            return {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM's body field: refused (echo + logprobs gives the prompt's logprobs)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name in _UNSUPPORTED_FIELDS:
                value = data.get(name)
                served = name == "function_call" and value in ("none", "auto")  # as tool_choice: nothing to call
                empty = value is None if name in _CONSTRAINT_FIELDS else value in (None, False, [], {}, "")
                if not empty and not served:
                    raise bad_request(f"{name} is not supported by this server", name)
        return data

    def check_stream_options(self) -> None:
        """stream_options only with stream (vLLM's rule: an empty object passes)."""
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        vocab_size: int | None = None) -> SamplingParams:
        """The engine's SamplingParams; a value it refuses is a 400 naming the field. `vocab_size`: the model's
        vocabulary, which logit_bias ids must index (checked here, so that the 400 shows the entries as sent)."""
        if self.prompt_logprobs is not None:  # parsed so that it is not silently dropped
            raise bad_request("prompt_logprobs is not supported as a body field: completions with echo and logprobs "
                              "return the prompt tokens' logprobs", "prompt_logprobs")
        kw: dict[str, Any] = dict(n=self.n, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=self.ignore_eos,
                                  min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output)
        for name in _OPTIONAL_SAMPLING:
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:  # OpenAI's keys are token ids written as strings; values clamped to [-100, 100] as
            kw["logit_bias"] = self._logit_bias(vocab_size)  # OpenAI's spec and vLLM's server do
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as exc:
            err = from_engine_error(exc)
            if err.param == "logit_bias" and self.logit_bias:  # its message showed the clamped values
                bad = [k for k, v in self.logit_bias.items() if not _finite(v)]
                err.message = f"{err.message.rpartition(', got ')[0] or err.message}, got {self._bias_as_sent(bad)}"
            err.param = self.body_field(err.param)
            raise err from None

    def _logit_bias(self, vocab_size: int | None) -> dict[int, Any]:
        """{token id: value clamped to [-100, 100]} (NaN is left for SamplingParams to refuse); a key that is not a
        token id (of the vocabulary, when known) is a 400 that shows the entries as the client sent them."""
        ids: dict[str, int] = {}
        for key in self.logit_bias:
            try:
                ids[key] = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:5]}"[:300],
                                  "logit_bias") from None
        end = vocab_size if vocab_size is not None else INT64_MAX + 1
        bad = [key for key, token in ids.items() if not 0 <= token < end]
        if bad:
            span = f"in [0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else "non-negative"
            raise bad_request(f"logit_bias token ids must be {span}, got {self._bias_as_sent(bad)}", "logit_bias")
        return {ids[key]: _clamp_bias(value) for key, value in self.logit_bias.items()}

    def _bias_as_sent(self, keys: list[str]) -> str:
        """The client's own logit_bias entries of `keys` (every entry when none is named), as JSON, at most 5."""
        keys = keys or list(self.logit_bias)
        shown = json.dumps({k: self.logit_bias[k] for k in keys[:5]})
        return f"{shown} (and {len(keys) - 5} more)" if len(keys) > 5 else shown[:300]

    def body_field(self, param: str | None) -> str | None:
        """The body's name for a SamplingParams field (they differ in the chat API)."""
        return param


def _within(k: int, max_logprobs: int) -> bool:
    """A top-logprobs count within the engine's max_logprobs (-1: no cap; the engine bounds it by the vocabulary)."""
    return 0 <= k and (max_logprobs == -1 or k <= max_logprobs)


def _bound(max_logprobs: int) -> str:
    return ">= 0" if max_logprobs == -1 else f"in [0, {max_logprobs}]"


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # vLLM's: only "text" (the default) is served

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (how scorers ask for a prompt's logprobs alone): one token is generated and not
        answered, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per engine prompt: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def check_supported(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        if not self.prompts():
            raise bad_request("prompt must not be empty", "prompt")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", "response_format")
        self.check_stream_options()
        if self.best_of is not None and self.best_of < 1:
            raise bad_request(f"best_of must be >= 1, got {self.best_of}", "best_of")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.logprobs is not None and not _within(self.logprobs, max_logprobs):  # no -1 here, as vLLM's
            raise bad_request(f"logprobs must be {_bound(max_logprobs)}, got {self.logprobs}", "logprobs")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) are kept for the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data):
        """An image or audio part is a 400 that says so (a text model), not a type error about strings."""
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict) and p.get("type") != "text"})
            if kinds:
                raise bad_request(f"message content parts of type {kinds} are not supported: text only", "messages")
        return data


class ChatTemplateFields(_Body):
    """The messages and how the chat template renders them: /v1/chat/completions and /tokenize share them."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is left open for the reply to extend
    chat_template: str | None = None  # vLLM's: the request's own template (serve --trust-request-chat-template)
    tools: list[dict[str, Any]] | None = None

    def check_template_kwargs(self, trust_request_chat_template: bool) -> None:
        """`trust_request_chat_template` (serve --trust-request-chat-template): a request may bring its own
        chat template; off by default, as in vLLM: a template is a program the engine thread runs (a nested
        loop froze every stream for 28 s)."""
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true (the reply would "
                              "both extend the last message and start a new one)", "continue_final_message")
        if self.chat_template is not None and not trust_request_chat_template:
            raise bad_request("chat_template: this server does not run templates from requests (serve "
                              "--trust-request-chat-template allows it)", "chat_template")
        kwargs = self.chat_template_kwargs or {}
        if "chat_template" in kwargs and not trust_request_chat_template:
            raise bad_request("chat_template_kwargs may not set chat_template: this server does not run "
                              "templates from requests (serve --trust-request-chat-template allows it)",
                              "chat_template_kwargs")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is called with besides the conversation and add_generation_prompt."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def conversation(self) -> list[dict]:
        """Messages as plain dicts for the tokenizer's chat template (text parts joined)."""
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                content = "\n".join(p.text for p in content)
            d["content"] = content if content is not None else ""
            out.append(d)
        return out


class ChatCompletionRequest(ChatTemplateFields, _SamplingFields):
    max_tokens: int | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    echo: bool = False  # vLLM's chat extra (the last message's text before the reply): refused
    tool_choice: str | dict[str, Any] | None = None

    def check_supported(self, max_logprobs: int = MAX_LOGPROBS, trust_request_chat_template: bool = False) -> None:
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", "response_format")
        if self.echo:
            raise bad_request("echo is not supported for chat completions", "echo")
        if self.tool_choice not in (None, "none", "auto"):  # "auto" without tools calls nothing
            raise bad_request("tool_choice other than none or auto is not supported (tools are not)", "tool_choice")
        self.check_stream_options()
        # -1: the whole vocabulary (vLLM's); the engine refuses it unless the vocabulary fits under max_logprobs
        if self.top_logprobs is not None and self.top_logprobs != -1 and not _within(self.top_logprobs, max_logprobs):
            raise bad_request(f"top_logprobs must be {_bound(max_logprobs)} or -1 (the whole vocabulary), got "
                              f"{self.top_logprobs}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.check_template_kwargs(trust_request_chat_template)

    def body_field(self, param: str | None) -> str | None:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs", "prompt": "messages"}.get(param, param)

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize (vLLM's shapes): a `prompt` (the ids /v1/completions would run) or `messages` (the ids
    /v1/chat/completions would run), exactly one of them."""

    messages: list[ChatMessage] | None = None
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # a prompt's BOS / EOS as /v1/completions adds them (default true)
    return_token_strs: bool | None = False  # null: false (vLLM's type)

    def check_supported(self, trust_request_chat_template: bool = False) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if self.messages is not None:
            if not self.messages:
                raise bad_request("messages must not be empty", "messages")
            if self.add_special_tokens:
                raise bad_request("add_special_tokens applies to a prompt: the chat template places the special "
                                  "tokens of messages", "add_special_tokens")
            self.check_template_kwargs(trust_request_chat_template)


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


def usage(finals: dict[str, RequestOutput]) -> dict:
    """The `usage` object of a response: prompt and generated tokens over all its engine requests."""
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals.values())  # prompt tokens served by the prefix cache
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
