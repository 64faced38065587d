"""POST /v1/chat/completions: the tokenizer's chat template turns the messages into one prompt
(applied in the HTTP process, on the event loop: the engine process gets token ids), `n` choices."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from metainfer.engine.request_validation import InvalidRequestError
from metainfer.engine.token_texts import text_ending
from metainfer.entrypoints.openai.engine_loop import RequestGroup
from metainfer.entrypoints.openai.errors import OpenAIError
from metainfer.entrypoints.openai.protocol import ChatCompletionRequest, ChatTemplateFields, parse_request
from metainfer.entrypoints.openai.serving_base import Finals, OpenAIServing
from metainfer.sampling_params import SamplingParams


def apply_chat_template(tokenizer, conversation, chat_template_kwargs, add_generation_prompt: bool) -> list[int]:
    """The prompt's token ids (LLM.apply_chat_template's rendering, on this process's tokenizer)."""
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **(chat_template_kwargs or {}))
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers v5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_prompt(req: ChatTemplateFields) -> Callable:
    """The request's prompt as EngineLoop's tokenizing thread renders it (called there, with its tokenizer)."""
    conversation, template_kwargs = req.conversation(), req.template_kwargs()
    add_generation_prompt = req.add_generation_prompt

    def prompt(tokenizer) -> dict:
        try:
            ids = apply_chat_template(tokenizer, conversation, template_kwargs, add_generation_prompt)
        except Exception as exc:  # any rendering error is the request's: a 400 naming what it brought
            field = "chat_template_kwargs" if req.chat_template_kwargs else (
                "chat_template" if req.chat_template is not None else "messages")
            raise InvalidRequestError(field, f"the chat template failed on this request's {field}: "
                                             f"{type(exc).__name__}: {exc}"[:500]) from None
        return {"prompt_token_ids": ids}

    return prompt


class OpenAIServingChat(OpenAIServing):
    trust_request_chat_template = False  # a request may set chat_template_kwargs.chat_template (build_app)

    async def create(self, request: Request) -> Response:
        body = await request.body()
        req = parse_request(body, ChatCompletionRequest)
        model = self.check_model(req.model)
        req.check_supported(self.max_logprobs, self.trust_request_chat_template)
        top_k = req.top_logprobs or 0
        params = req.sampling_params(req.max_new_tokens, top_k if req.logprobs else None, self.vocab_size)
        prompt = chat_prompt(req)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            group = await self.engine_loop.submit([(base, prompt, params)], len(body))
        except OpenAIError as err:  # the engine names its own fields: the prompt is the messages here
            field = req.body_field(err.param)
            if field != err.param and err.message.startswith(f"{err.param}="):  # "logprobs=-1 ..." as sent here
                err.message = field + err.message[len(err.param):]
            err.param = field
            raise
        return await self.respond(
            request, req, group, base=base, model=model, obj="chat.completion", chunk_obj="chat.completion.chunk",
            chunks=lambda head, finals: self._chunks(group, req, params, head, finals, top_k),
            choices=lambda finals: self._choices(finals[base], req, params, top_k))

    def _choices(self, out, req: ChatCompletionRequest, params: SamplingParams, top_k: int) -> list[dict]:
        return [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": {"content": self.logprobs(c.token_ids, c.logprobs or [], top_k, out.prompt_token_ids, 0,
                                                       _ending(c, params))}
                 if req.logprobs else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]

    async def _chunks(self, group: RequestGroup, req: ChatCompletionRequest, params: SamplingParams, head: dict,
                      finals: Finals, top_k: int):
        for index in range(req.n):
            yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        async for c, index, text, ids, dicts, context, own in self.pieces(group, req.n, params, False, finals):
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self.logprobs(ids, dicts or [], top_k, context, own, _ending(c, params))}
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                      "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            yield {**head, "choices": [choice]}

    def logprobs(self, token_ids: list[int], dicts: list[dict[int, float]], k: int, context,
                 own: int = 0, ending: str | None = None) -> list[dict]:
        """Chat-style logprobs (token, logprob, bytes, the top k) for some output tokens after the ids `context`, the
        last `own` of them outputs (the texts and their bytes as vLLM's: LLMEngine's decoded_token, token_texts_at,
        with `ending`: the same texts as completions' tokens)."""
        content = []
        texts = self.token_texts_at(token_ids, dicts, context, own, ending)
        for tid, d, (text, listed) in zip(token_ids, dicts, texts):
            ranked = sorted(d.items(), key=lambda kv: -kv[1])
            ranked = ranked if k == -1 else ranked[:k]  # top_logprobs=-1: the whole vocabulary
            content.append({"token": text, "logprob": d.get(tid), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": listed[t], "logprob": lp, "bytes": list(listed[t].encode())}
                                             for t, lp in ranked]})
        return content


def _ending(c, params: SamplingParams) -> str | None:
    """How the choice `c`'s last token ends its text (token_texts.text_ending), as completions reads it."""
    return text_ending(c.finish_reason, c.stop_reason, params.include_stop_str_in_output)
