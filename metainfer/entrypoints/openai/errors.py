"""OpenAI-style error bodies: every failure a client sees is {"error": {message, type, param, code}}.

One place maps Python exceptions (validation, engine, HTTP routing, bugs) to that body, so both
endpoints, the health check and the streaming error event answer alike.
"""

from __future__ import annotations

import logging

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


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """A body that fails its pydantic model: 400 naming the top-level field, as OpenAI reports it."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}", None)
    union = _union_failure(errors)
    if union is not None:
        return union
    loc = [str(x) for x in first.get("loc", ())]
    param = loc[0] if loc else None
    where = f"field '{'.'.join(loc)}': " if loc else "request body: "
    return bad_request(f"{where}{first['msg']}", param)


def _union_failure(errors: list[dict]) -> OpenAIError | None:
    """A value that matches no member of its field's union (prompt: str | list[str] | list[int] | ...): pydantic
    reports one error per member, tagged with the member's type after the field's path; name the field, the types
    it takes and what came, instead of the first member's complaint ("field 'prompt.str': a valid string")."""
    locs = [tuple(e.get("loc", ())) for e in errors]
    n = 0
    while all(len(loc) > n + 1 and loc[n] == locs[0][n] for loc in locs):
        n += 1
    if len(errors) < 2 or n == 0 or not all(len(loc) == n + 1 and isinstance(loc[n], str) for loc in locs):
        return None  # a member that got further (a list with one bad item) says more: its own error stands
    tags = " | ".join(dict.fromkeys(loc[n] for loc in locs))
    path = ".".join(str(x) for x in locs[0][:n])
    return bad_request(f"field '{path}': expected {tags}, got {_json_kind(errors[0].get('input'))}", str(locs[0][0]))


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
