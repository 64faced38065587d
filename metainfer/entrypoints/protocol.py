"""Request bodies of the OpenAI-compatible server (pydantic, strict types).

Strict mode: a string where a number belongs is an error (400), not a silent coercion; JSON
integers are still accepted for float fields. Unknown fields are ignored, as OpenAI's own
server does. vLLM's sampling extras (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, ...) are accepted in the body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


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
    repetition_penalty: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) are kept for the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

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
