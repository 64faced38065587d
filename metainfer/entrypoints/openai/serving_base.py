"""What /v1/completions and /v1/chat/completions share: the model check, waiting for the final
outputs (or the client's disconnect), text deltas for streaming, and the SSE framing.

Streaming sends text as deltas of the engine's cumulative output. When stop strings are set, the
last `len(longest stop) - 1` characters are held back until the request finishes, because the
engine may cut them off when the stop string completes; so the streamed text always equals the
non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from metainfer.engine.token_texts import ENDS_AT_STOP_TOKEN, ENDS_TEXT, REPLACEMENT_CHAR, TokenTexts
from metainfer.entrypoints.openai.engine_loop import EngineError, EngineLoop, RequestGroup
from metainfer.entrypoints.openai.errors import OpenAIError, engine_failed
from metainfer.entrypoints.openai.protocol import usage
from metainfer.outputs import CompletionOutput, RequestOutput
from metainfer.sampling_params import SamplingParams

Finals = dict[str, RequestOutput]
# (choice, index, text, new token ids, their logprob dicts or None, the ids before them that their token texts read
# (TokenTexts.context_of; none where no logprobs were asked for), how many of those are the choice's own outputs: the
# rest are the prompt's)
Piece = tuple[CompletionOutput, int, str, list[int], list | None, list[int], int]


def check_model(served_model_names: list[str], model: str | None) -> str:
    """The served name a request asked for (the first one when it names none); 404 otherwise."""
    if model is None:
        return served_model_names[0]
    if model not in served_model_names:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                          "model_not_found")
    return model


class OpenAIServing:
    """Base of the two endpoint classes: the engine loop (and this process's tokenizer), the served names and
    the engine's logprobs cap."""

    def __init__(self, engine_loop: EngineLoop, served_model_names: list[str], max_logprobs: int,
                 vocab_size: int | None = None):
        self.tokenizer = engine_loop.tokenizer
        self.token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None
        self.engine_loop = engine_loop
        self.served_model_names = served_model_names
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size  # the model's: logit_bias ids must index it (protocol's sampling_params)

    def check_model(self, model: str | None) -> str:
        return check_model(self.served_model_names, model)

    def token_texts_at(self, token_ids: list[int], dicts: list, context, own: int | None = None,
                       ending: str | None = None) -> list[tuple[str, dict[int, str]]]:
        """(the text of each id, {listed id: its text}) per position, as LLMEngine's Logprob.decoded_token gives
        them (engine/token_texts.py: a byte-level piece of a character gets what it adds after the ids before it, so
        the pieces join to the text); `context`: the ids before the first position (the prompt's and earlier
        outputs': their tail from the last id whose decode alone is whole is read), of which the last `own` are the
        same text's (None: all; 0: the prompt's alone, whose partial character the output does not complete stays
        the prompt's). `ending` (token_texts.text_ending) where these ids end a finished text: ENDS_TEXT, the last id
        ends it (it keeps the U+FFFDs of a character left unfinished, as the full decode does); ENDS_AT_STOP_TOKEN,
        the last id is a stop token whose text is left out: the id before it ends the text, and the stop token's text
        is its own decode (after the U+FFFDs the text ends with where the id before it was answered earlier, in
        another chunk, so the texts still join). A None dict (a prompt's first token) gives an empty listing."""
        texts, token_texts, n = [], self.token_texts, len(token_ids)
        ctx, in_ctx = token_texts.context_of(context, len(context))
        own = None if own is None else min(own, in_ctx)
        ends = n - 1 if ending == ENDS_TEXT else n - 2 if ending == ENDS_AT_STOP_TOKEN else None
        for i, (tid, d) in enumerate(zip(token_ids, dicts)):
            befores: dict = {}
            last = i == ends
            if ending == ENDS_AT_STOP_TOKEN and i == n - 1:
                text = token_texts.solo(tid) if i else token_texts.unfinished(ctx, own) + token_texts.solo(tid)
            else:
                text = token_texts.text(tid, ctx, befores, own, last)
            listed = ({t: (text if t == tid else token_texts.text(t, ctx, befores, own, last)) for t in d}
                      if d else {})
            texts.append((text, listed))
            if REPLACEMENT_CHAR in token_texts.solo(tid):  # the next position reads back to the last whole id
                ctx.append(tid)
                own = None if own is None else own + 1
            else:
                ctx, own = [tid], None if own is None else 1
        return texts

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    async def respond(self, request: Request, req, group: RequestGroup, *, base: str, model: str, obj: str,
                      chunk_obj: str, chunks: Callable[[dict, Finals], AsyncIterator[dict]],
                      choices: Callable[[Finals], list[dict]]) -> Response:
        """The answer to one request: an SSE stream of `chunks(head, finals)` when it asked to stream,
        else, once every engine request has finished, one JSON body with `choices(finals)`."""
        created = int(time.time())
        if req.stream:
            head = {"id": base, "object": chunk_obj, "created": created, "model": model}
            if req.include_usage:
                head["usage"] = None  # OpenAI's chunks carry usage: null until the last one
            finals: Finals = {}
            return self._event_stream(group, chunks(head, finals), head, finals, req.include_usage)
        try:
            done = await _collect(group, request)
        finally:
            group.close()
        if done is None:
            return Response(status_code=499)
        return JSONResponse({"id": base, "object": obj, "created": created, "model": model,
                             "choices": choices(done), "usage": usage(done)})

    async def pieces(self, group: RequestGroup, n: int, params: SamplingParams, echo: bool,
                     finals: Finals) -> AsyncIterator[Piece]:
        """What is new per choice since its last yield: (choice, index, text, new token ids, their logprob dicts
        or None, the ids before the new ones that their token texts read (TokenTexts.context_of: back to the last id
        whose decode alone is whole, into the prompt's tail where the outputs have none; only those ids are copied),
        how many of those are outputs).

        The new tokens are sliced when the output arrives: a choice's token lists are the engine loop's own and
        grow while this generator waits for its consumer, so they must not be read after a yield.
        Text a stop string may still cut off (the last len(longest stop) - 1 characters) is held
        back until the choice finishes; a finished choice is yielded once, with finish_reason. Every output with
        new tokens is yielded, with empty text where its tokens end inside a character or a held-back stop string
        (vLLM sends those chunks too: a client sees each step's tokens, and `bench serve` counts them as tokens)."""
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        sent: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        async for out in group.outputs():
            finals[out.request_id] = out
            lengths = [len(c.token_ids) for c in out.outputs]  # as of this output's text, before any yield
            for c, length in zip(out.outputs, lengths):
                index = group.position[out.request_id] * n + c.index
                if index in done:
                    continue
                finished = c.finish_reason is not None
                start, first = sent.get(index, 0), sent_tokens.get(index, 0)
                end = len(c.text) if finished else max(start, len(c.text) - hold)
                text = c.text[start:end]
                if echo and index not in sent:
                    text = self.prompt_text(out) + text
                if not text and not finished and length == first:
                    continue
                sent[index], sent_tokens[index] = end, length
                if finished:
                    done.add(index)
                new_logprobs = c.logprobs[first:length] if c.logprobs is not None else None
                context, own = [], 0
                if new_logprobs is not None and self.token_texts is not None:
                    context, own = self.token_texts.context_of(c.token_ids, first, out.prompt_token_ids or ())
                yield c, index, text, c.token_ids[first:length], new_logprobs, context, own

    @staticmethod
    def _event_stream(group: RequestGroup, chunks, head: dict, finals: Finals, include_usage: bool) -> _EventStream:
        """SSE framing for both endpoints: the chunks, an error event if the engine failed, the
        usage chunk (stream_options.include_usage), then [DONE]; the group is always released."""

        async def events():
            try:
                try:
                    async for obj in chunks:
                        yield _sse(obj)
                except EngineError as exc:
                    yield _sse(engine_failed(exc).body())
                else:
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": usage(finals)})
                yield "data: [DONE]\n\n"
            finally:
                group.close()

        return _EventStream(events(), group.close)


class _EventStream(StreamingResponse):
    """An SSE response that always runs `on_close` (client gone, cancelled, or done)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(group: RequestGroup, request: Request) -> Finals | None:
    """Wait for the final outputs; None if the client disconnected first."""
    finals: Finals = {}

    async def consume():
        async for out in group.outputs(partial=False):
            finals[out.request_id] = out

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (consumer, watcher):
            if not task.done():
                task.cancel()
    if consumer in done:
        exc = consumer.exception()
        if exc is not None:
            raise engine_failed(exc)
        return finals
    return None
