"""OpenAI-style error bodies: every failure a client sees is {"error": {message, type, param, code}}.

One place maps Python exceptions (validation, engine, HTTP routing, bugs) to that body, so both
endpoints, the health check and the streaming error event answer alike.
"""

from __future__ import annotations

import logging
import types
from typing import Union, get_args, get_origin

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("metainfer.server")

# the first word of an engine / SamplingParams ValueError names the field
_PARAM_OF_MESSAGE = {name: name for name in (
    "prompt", "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "messages")}
_PARAM_OF_MESSAGE["prompt_token_ids"] = "prompt"


class OpenAIError(Exception):
    """An error answered as OpenAI's JSON body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, None)


def engine_dead() -> OpenAIError:
    return OpenAIError(503, "the engine is not running", "server_error", None, "engine_dead")


def engine_failed(exc: BaseException) -> OpenAIError:
    """The engine failed while the request was in flight (a step raised, the loop died, or the server
    shut down before it finished: the exception's `status` / `code`)."""
    return OpenAIError(getattr(exc, "status", 500), str(exc), "server_error", None,
                       getattr(exc, "code", "engine_error"))


def from_engine_error(exc: BaseException) -> OpenAIError:
    """Map an exception raised while adding a request (tokenize, template, validate)."""
    if isinstance(exc, OpenAIError):
        return exc
    import jinja2  # only chat templates raise it; transformers brings it

    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError)):
        msg = str(exc) or type(exc).__name__
        param = getattr(exc, "param", None)  # InvalidRequestError (engine/request_validation.py) names it
        return bad_request(msg, param if param is not None else _PARAM_OF_MESSAGE.get(msg.split(" ", 1)[0]))
    log.exception("adding a request failed", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


def from_validation_error(exc: ValidationError, model: type | None = None) -> OpenAIError:
    """A body that fails its pydantic `model`: 400 naming the top-level field, as OpenAI reports it."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}", None)
    union = _union_failure(errors, model)
    if union is not None:
        return union
    loc = [str(x) for x in first.get("loc", ())]
    param = loc[0] if loc else None
    where = f"field '{'.'.join(loc)}': " if loc else "request body: "
    return bad_request(f"{where}{first['msg']}", param)


def _union_failure(errors: list[dict], model: type | None) -> OpenAIError | None:
    """A top-level field whose type is a union (prompt: str | list[str] | list[int] | list[list[int]]) and a value
    that fits no member: pydantic reports one error per member, its path tagged with the member's type. Name the
    field, the types it takes and what came, and where the member that got furthest failed, instead of the first
    member's complaint ("field 'prompt.str': Input should be a valid string")."""
    locs = [tuple(e.get("loc", ())) for e in errors]
    name = locs[0][0] if locs and locs[0] else None
    fields = getattr(model, "model_fields", {})
    if len(errors) < 2 or name not in fields or not _is_union(fields[name].annotation):
        return None
    if not all(len(loc) >= 2 and loc[0] == name for loc in locs):
        return None
    tags = " | ".join(dict.fromkeys(str(loc[1]) for loc in locs))
    whole = next((e["input"] for e, loc in zip(errors, locs) if len(loc) == 2 and "input" in e), errors[0])
    got = "a value that fits none of them" if whole is errors[0] else _json_kind(whole)
    loc, err = max(zip(locs, errors), key=lambda p: (len(p[0]), [x for x in p[0][2:] if isinstance(x, int)]))
    detail = f" ({name}{''.join(f'[{x}]' for x in loc[2:])} as {loc[1]}: {err['msg']})" if len(loc) > 2 else ""
    return bad_request(f"field '{name}': expected {tags}, got {got}{detail}", name)


def _is_union(annotation) -> bool:
    members = [a for a in get_args(annotation) if a is not type(None)]
    return get_origin(annotation) in (Union, types.UnionType) and len(members) >= 2


def _json_kind(value) -> str:
    kinds = ((type(None), "null"), (bool, "a boolean"), (str, "a string"), ((int, float), "a number"),
             (list, "an array"), (dict, "an object"))
    return next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)


def add_exception_handlers(app: FastAPI) -> None:
    """Our errors, FastAPI's own (404, 405) and unexpected bugs all answer with the OpenAI body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error", None,
                           "internal_error").response()
