"""POST /tokenize and /detokenize (vLLM's routes and shapes): the ids the two generation endpoints would run for a
prompt or for chat messages, and the text of token ids, on this process's tokenizing thread (EngineLoop)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from metainfer.engine.request_validation import InvalidRequestError
from metainfer.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest, parse_request
from metainfer.entrypoints.openai.serving_base import OpenAIServing
from metainfer.entrypoints.openai.serving_chat import chat_prompt


class OpenAIServingTokenization(OpenAIServing):
    trust_request_chat_template = False  # as OpenAIServingChat's (build_app sets both)

    def __init__(self, engine_loop, served_model_names: list[str], max_logprobs: int, max_model_len: int,
                 model_vocab_size: int):
        super().__init__(engine_loop, served_model_names, max_logprobs)
        self.max_model_len, self.model_vocab_size = max_model_len, model_vocab_size

    async def tokenize(self, request: Request) -> JSONResponse:
        """-> {"count", "max_model_len", "tokens", "token_strs" (null unless return_token_strs)}."""
        body = await request.body()
        req = parse_request(body, TokenizeRequest)
        self.check_model(req.model)
        req.check_supported(self.trust_request_chat_template)
        if req.messages is not None:
            render = chat_prompt(req)

            def ids_of(tokenizer) -> list[int]:
                return render(tokenizer)["prompt_token_ids"]
        else:
            prompt, special = req.prompt, req.add_special_tokens is not False

            def ids_of(tokenizer) -> list[int]:
                return list(tokenizer.encode(prompt, add_special_tokens=special))
        return_strs = bool(req.return_token_strs)

        def tokenize(tokenizer) -> tuple[list[int], list[str] | None]:
            ids = ids_of(tokenizer)
            return ids, tokenizer.convert_ids_to_tokens(ids) if return_strs else None

        ids, strs = await self.engine_loop.run_tokenizer(tokenize, len(body))
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        """{"tokens": [ids]} -> {"prompt": text}; an id neither the model nor the tokenizer can name is a 400 naming
        `tokens` (the model's padded vocabulary ids past the tokenizer's, which it may output, decode to nothing)."""
        body = await request.body()
        req = parse_request(body, DetokenizeRequest)
        self.check_model(req.model)
        tokens, model_vocab = req.tokens, self.model_vocab_size

        def detokenize(tokenizer) -> str:
            size = max(len(tokenizer), model_vocab)
            bad = next((t for t in tokens if not 0 <= t < size), None)
            if bad is not None:
                raise InvalidRequestError("tokens", f"tokens must be in [0, {size}), got {bad}")
            return tokenizer.decode(tokens)

        return JSONResponse({"prompt": await self.engine_loop.run_tokenizer(detokenize, len(body))})
