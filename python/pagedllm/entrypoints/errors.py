"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.

A client's mistake is a 4xx naming the field (never a 500); an engine failure is a 503.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.protocol import param_of, unknown_field


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error answer (what the OpenAPI document shows for them)."""

    error: ErrorDetail


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.headers = headers

    def body(self) -> dict:
        detail = ErrorDetail(
            message=self.message, type=self.type, param=self.param, code=self.status
        )
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable")


def _param_of(message: str) -> str | None:
    """The field an engine ValueError names ("SamplingParams.top_p must ...", "logprobs=...")."""
    match = re.search(r"SamplingParams\.(\w+)", message)
    if match:
        return match.group(1)
    names = ("logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs")
    for name in (*names, "prompt", "best_of", "logprobs", "priority", "stop_token_ids", "n"):
        if re.search(rf"\b{name}\b", message):
            return name
    return None


def bad_request(exc: Exception) -> APIError:
    """A 400 for an engine-side ValueError/TypeError, naming the field its message names."""
    message = str(exc)
    return APIError(400, message, param=_param_of(message))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message, `field: what is wrong` for up to 5 fields (a union's branches folded into
    one), and the first field as the param."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error')}", None
    problems: dict[str | None, list[str]] = {}
    for error in errors:
        param, msg = param_of(error.get("loc", ())), error.get("msg")
        if error.get("type") == "extra_forbidden":
            param, msg = unknown_field(error.get("loc", ()))
        msgs = problems.setdefault(param, [])
        if msg not in msgs:
            msgs.append(msg)
    message = "; ".join(
        f"{param or 'body'}: {' or '.join(msgs)}" for param, msgs in list(problems.items())[:5]
    )
    return message, next(iter(problems), None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises leaves in OpenAI's shape: ours, pydantic's (400: malformed
    JSON, wrong types, missing fields) and Starlette's (404 route, 405 method, ...)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's json.loads of the body
            message = "the body is nested too deeply to parse"
        # a 405 keeps its Allow header: the methods of every route of the path (Starlette names
        # only the first route's, where a path has one route per method)
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return APIError(exc.status_code, message, headers=headers).response()


def _allowed_methods(request: Request) -> str:
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches({**request.scope, "method": "GET"})[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))
