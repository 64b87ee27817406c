"""Reading a request body: media type (415), size limit (413), JSON (400), nesting and lone
surrogates (400, limits.py), schema (400 naming the field)."""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kimitui.server.errors import APIError, bad_request
from kimitui.server.limits import body_problems

Model = TypeVar("Model", bound=BaseModel)
# Bodies larger than this are parsed in a worker thread, so a 16 MB prompt does not hold the
# event loop (and every other request's stream) while it is decoded.
_INLINE_PARSE_BYTES = 256 * 1024


async def read_body(request: Request, model: type[Model], limit: int) -> Model:
    """Parse the body of ``request`` as ``model``; raise APIError with the status a client expects."""
    check_media_type(request)
    raw = await _read_limited(request, limit)
    if len(raw) > _INLINE_PARSE_BYTES:
        data = await asyncio.to_thread(parse_json, raw)
    else:
        data = parse_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def check_media_type(request: Request) -> None:
    """415 unless the body is declared JSON (or not declared, as FastAPI and vLLM take it): a
    text/plain or form body is not read as JSON by accident."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    shown = declared.encode("ascii", "replace").decode()[:80]
    raise APIError(
        415,
        f"Content-Type must be application/json, got {shown!r}",
        param="Content-Type",
        code="unsupported_media_type",
    )


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; 400 for invalid JSON, another type, too deep a nesting or a lone
    surrogate."""
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except RecursionError:  # the C parser's own guard, near 1000 levels
        raise bad_request("request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    body_problems(raw, data)
    return data


async def _read_limited(request: Request, limit: int) -> bytes:
    timeout = getattr(request.app.state.server, "request_read_timeout", None)
    if timeout is None:
        return await _read_body(request, limit)
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(request, limit)
    except TimeoutError:
        # A client that sends its body slowly (or stops halfway) holds a connection and a buffer.
        raise APIError(
            408,
            f"request body not received within {timeout:g} s (kimitui serve --request-read-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = APIError(
        413,
        f"request body is larger than the server's limit of {limit} bytes (kimitui serve --max-request-bytes)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big  # refuse before reading a byte
    chunks, size = [], 0
    # Chunked uploads declare no length: count while reading and stop at the limit.
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _not_json(name: str):
    # Python reads NaN, Infinity and -Infinity; JSON (RFC 8259) has no such numbers, and a NaN
    # temperature or penalty would poison a batch's logits.
    raise ValueError(f"{name} is not a JSON number")


def validation_error(e: ValidationError) -> APIError:
    """The first schema error as a 400 whose message and ``param`` name the field."""
    err = e.errors(include_url=False)[0]
    # Drop pydantic's union-branch tags ("str", "list[str]") so the path reads messages.0.role.
    parts = [str(p) for p in err["loc"] if isinstance(p, int) or ("[" not in p and p not in _TAGS)]
    field = ".".join(parts) or "body"
    got = err.get("input")
    got_text = "" if err["type"] == "missing" else f" (got {json.dumps(got, default=str)[:80]})"
    return bad_request(f"invalid field '{field}': {err['msg']}{got_text}", param=field)


_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal", "function-after"}
