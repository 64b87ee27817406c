"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# OpenAI's `type` per status, so clients that branch on it (the openai package maps statuses to
# exception classes, others read `type`) behave as against api.openai.com.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client as OpenAI's error object; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure, including unknown routes and bugs, leaves as JSON in OpenAI's shape."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return exception_response(request, exc)

    app.add_exception_handler(APIError, on_error)
    app.add_exception_handler(StarletteHTTPException, on_error)
    app.add_exception_handler(Exception, on_error)


def exception_response(request: Request, exc: Exception) -> JSONResponse:
    """The JSON error answered for ``exc`` raised by a handler: an ``APIError`` as it says, an HTTP
    exception with its status, anything else a logged 500."""
    if isinstance(exc, APIError):
        return error_response(exc)
    if isinstance(exc, StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))


def engine_error(e: Exception) -> APIError:
    """An exception raised while generating, as the error the client sees (400 or 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):  # PromptError, ChatError, bad sampling values: the request's fault
        return bad_request(str(e))
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}")
