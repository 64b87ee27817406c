"""Reading a request body: size limit (413), JSON (400), schema (400 naming the field)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kimitui.server.errors import APIError, bad_request

Model = TypeVar("Model", bound=BaseModel)


async def read_body(request: Request, model: type[Model], limit: int) -> Model:
    """Parse the body of ``request`` as ``model``; raise APIError with the status a client expects."""
    raw = await _read_limited(request, limit)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def _read_limited(request: Request, limit: int) -> bytes:
    too_big = APIError(413, f"request body is larger than the server's limit of {limit} bytes "
                            "(kimitui serve --max-request-bytes)", code="request_too_large")
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
