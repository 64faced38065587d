"""POST /v1/completions: one engine request per prompt, `n` choices each, prompt-major indices."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from metainfer.engine.token_texts import ENDS_TEXT, text_ending
from metainfer.entrypoints.openai.engine_loop import RequestGroup
from metainfer.entrypoints.openai.protocol import CompletionRequest, parse_request
from metainfer.entrypoints.openai.serving_base import Finals, OpenAIServing
from metainfer.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: Request) -> Response:
        body = await request.body()
        req = parse_request(body, CompletionRequest)
        model = self.check_model(req.model)
        req.check_supported(self.max_logprobs)
        params = req.sampling_params(1 if req.echo_only else req.max_tokens, req.logprobs, self.vocab_size)
        if req.echo and req.logprobs is not None:  # the echoed prompt's tokens carry their logprobs too (vLLM)
            params.prompt_logprobs = req.logprobs
            params.validate()
        base = f"cmpl-{uuid.uuid4().hex}"
        items = [(f"{base}-{i}", p if isinstance(p, str) else {"prompt_token_ids": p}, params)
                 for i, p in enumerate(req.prompts())]
        group = await self.engine_loop.submit(items, len(body))
        return await self.respond(
            request, req, group, base=base, model=model, obj="text_completion", chunk_obj="text_completion",
            chunks=lambda head, finals: self._chunks(group, req, params, head, finals),
            choices=lambda finals: self._choices(group, req, params, finals))

    def _choices(self, group: RequestGroup, req: CompletionRequest, params: SamplingParams,
                 finals: Finals) -> list[dict]:
        choices = []
        for rid in group.ids:
            out = finals[rid]
            prefix = self.prompt_text(out) if req.echo else ""
            for c in out.outputs:
                ids, text = ([], "") if req.echo_only else (c.token_ids, c.text)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self.logprobs(ids, c.logprobs or [], len(prefix), out.prompt_token_ids, 0,
                                             _ending(c, params))
                    if req.echo:
                        logprobs = self._with_prompt(out, logprobs)
                choices.append({"index": group.position[rid] * req.n + c.index, "text": prefix + text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return choices

    async def _chunks(self, group: RequestGroup, req: CompletionRequest, params: SamplingParams, head: dict,
                      finals: Finals):
        offsets: dict[int, int] = {}
        want_logprobs = req.logprobs is not None
        async for c, index, text, ids, dicts, context, own in self.pieces(group, req.n, params, req.echo, finals):
            if req.echo_only:  # the prompt alone (its text is this first piece's head)
                out = finals[group.ids[index // req.n]]
                text, ids = self.prompt_text(out), []
            logprobs = None
            first = index not in offsets
            if want_logprobs:
                ending = _ending(c, params)
                if req.echo and first:  # the chunk that echoes the prompt carries its tokens' logprobs first
                    out = finals[group.ids[index // req.n]]
                    logprobs = self._with_prompt(out, self.logprobs(ids, dicts or [], len(self.prompt_text(out)),
                                                                    context, own, ending))
                else:
                    logprobs = self.logprobs(ids, dicts or [], offsets.get(index, 0), context, own, ending)
            # the next chunk's first text_offset: past this chunk's token texts, as the whole body counts them (the
            # streamed text may hold some back: a partial character, a possible stop string)
            offsets[index] = (_offset_after(logprobs, offsets.get(index, 0)) if logprobs
                              else offsets.get(index, 0) + len(text))
            yield {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

    def _with_prompt(self, out, output_logprobs: dict) -> dict:
        """`output_logprobs` after the echoed prompt's own (its first token has none: null, as vLLM and OpenAI). The
        echoed text is the prompt's whole decode, so its last token keeps a partial character's U+FFFDs."""
        prompt = self.logprobs(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids), 0, (),
                               None, ENDS_TEXT)
        return {key: prompt[key] + output_logprobs[key] for key in prompt}

    def logprobs(self, token_ids: list[int], dicts: list[dict[int, float] | None], text_offset: int, context,
                 own: int | None = 0, ending: str | None = None) -> dict:
        """Completions-style logprobs for some tokens after the ids `context` (a None dict: a prompt's first token,
        which has none; the texts as vLLM's: LLMEngine's decoded_token, token_texts_at, with `own` and `ending`).
        The token texts join to the choice's text (each text_offset is the length of those before it), a partial
        character's U+FFFDs included, except where the text leaves out a stop token's text (that token's text is its
        own decode), a stop string and what follows it, or a special token's text that skip_special_tokens (the
        default) drops (its token keeps it)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        texts = self.token_texts_at(token_ids, dicts, context, own, ending)
        for tid, d, (text, listed) in zip(token_ids, dicts, texts):
            tokens.append(text)
            if d is None:
                token_logprobs.append(None)
                top.append(None)
                offsets.append(text_offset)
                text_offset += len(text)
                continue
            token_logprobs.append(d.get(tid))
            ranked = {}
            for t, lp in sorted(d.items(), key=lambda kv: -kv[1]):
                ranked.setdefault(listed[t], lp)  # ids with the same text: the likelier one's value
            top.append(ranked)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _ending(c, params: SamplingParams) -> str | None:
    """How the choice `c`'s last token ends its text (token_texts.text_ending: the token that ends a finished text
    keeps a partial character's U+FFFDs, as the text does; a stop token left out of it gets its own decode)."""
    return text_ending(c.finish_reason, c.stop_reason, params.include_stop_str_in_output)


def _offset_after(logprobs: dict, offset: int) -> int:
    """The text offset just past a completions logprobs block's last token (`offset` where it has none)."""
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    return offsets[-1] + len(tokens[-1]) if tokens else offset
