"""OpenAI-shaped errors: one exception type for every refusal, one JSON body for all of them.

Handlers raise `APIError`; the error middleware turns it (and anything unexpected) into

    {"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}

with the matching HTTP status. Parameter errors say which field and which value, the way
vLLM words them: "... (parameter=max_tokens, value=-1)".

With --log-error-stack (default: VLLM_SERVER_DEV_MODE=1) every error response an exception
made (an APIError, aiohttp's HTTP errors, an unknown route or method) is logged at ERROR
with its stack trace, as vLLM's exception handlers log them; unexpected exceptions are
logged with theirs always.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

logger = logging.getLogger("aioserve.server")

LOG_ERROR_STACK: web.AppKey[bool] = web.AppKey("aioserve_log_error_stack", bool)
"""Whether the app logs error responses with their stack (--log-error-stack; app.py)."""

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowed",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLarge",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.headers = headers or {}
        self.error_type = error_type or _ERROR_TYPES.get(HTTPStatus(self.status), "APIError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return web.Response(
            body=orjson.dumps(self.body()),
            status=self.status,
            content_type="application/json",
            headers=self.headers,
        )


def bad_parameter(param: str, value: Any, reason: str) -> APIError:
    """A 400 naming the field and its value: "<reason> (parameter=<param>, value=<value>)"."""
    return APIError(f"{reason} (parameter={param}, value={value})", param=param)


def refusal(message: str, param: str) -> APIError:
    """A 400 as vLLM's VLLMValidationError words it without a value: the message, then
    " (parameter=X)"."""
    return APIError(f"{message} (parameter={param})", param=param)


def log_error_response(request: web.Request, error: BaseException, status: int) -> None:
    """With --log-error-stack, log the error response to `request` with `error`'s stack."""
    if request.app.get(LOG_ERROR_STACK, False):
        logger.error(
            "%s caught. Request id: %s (%s %s answered %d: %s)",
            type(error).__name__,
            request.headers.get("X-Request-Id"),
            request.method,
            request.path,
            status,
            error,
            exc_info=error,
        )


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Answer an APIError with its JSON body; anything unexpected becomes a logged 500."""
    try:
        return await handler(request)
    except APIError as error:
        log_error_response(request, error, error.status)
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        log_error_response(request, error, error.status)
        return APIError(error.reason, error.status).response()
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return APIError("internal server error", HTTPStatus.INTERNAL_SERVER_ERROR).response()
