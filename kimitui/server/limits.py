"""Per-request bounds: what one request may ask of the server before any work is done for it.

Each bound is checked before the work it protects (parsing, tokenizing, compiling a grammar,
admitting prompts), so a careless or hostile request costs a 4xx, never a stall of everyone else,
a worker thread's stack or a 500. Every message names the field and the limit.
"""

from __future__ import annotations

import re

from kimitui.server.errors import bad_request

# Nesting of the request body as JSON. Real requests stay below 20 (a chat with tool schemas);
# Python's JSON parser and the grammar compiler recurse per level and fail near 1000.
MAX_JSON_DEPTH = 64
# Nesting of one JSON schema (response_format, a tool's parameters), counted as JSON levels of the
# schema object: {"properties": {"a": {...}}} is two per property level. OpenAI allows 10 levels of
# properties in strict schemas; 32 JSON levels leaves room for arrays, anyOf and $defs.
MAX_SCHEMA_DEPTH = 32
# OpenAI allows 4 stop sequences; vLLM sets no bound. Every generated token is checked against
# every stop string, so the count and the total length are what a step costs.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 16_384
MAX_STOP_TOKEN_IDS = 1024
# Prompts in one /v1/completions request (lm-eval sends its batch size, tens). Each becomes an
# engine request; more would hold the scheduler for everyone (see completions: admitted in pieces).
MAX_PROMPTS = 1024
MAX_TOOLS = 512

# A JSON \u escape of a UTF-16 surrogate: only bodies holding one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def body_problems(raw: bytes, data) -> None:
    """400 for a parsed body nested deeper than MAX_JSON_DEPTH or holding a string with a lone
    surrogate (which can be neither tokenized nor written back as UTF-8). Walks the body only
    when the raw bytes say it could fail (enough brackets, a surrogate escape)."""
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if not (deep or surrogates):
        return
    stack = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if surrogates and not _encodable(value):
                field = _field(path)
                raise bad_request(f"'{field}' is not valid Unicode text (it contains a lone surrogate)", param=field)
            continue
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            field = _field(path)
            raise bad_request(
                f"request body is nested more than {MAX_JSON_DEPTH} levels deep (at '{field}')", param=field
            )
        for key, item in items:
            if surrogates and isinstance(key, str) and not _encodable(key):
                raise bad_request(
                    "a JSON key is not valid Unicode text (it contains a lone surrogate)", param=_field(path)
                )
            if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str)):
                stack.append((item, depth + 1, (*path, key)))


def check_schema_depth(schema, field: str) -> None:
    """400 when the JSON schema at ``field`` nests deeper than MAX_SCHEMA_DEPTH."""
    depth = json_depth(schema, MAX_SCHEMA_DEPTH + 1)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{field} is nested more than {MAX_SCHEMA_DEPTH} levels deep", param=field)


def json_depth(value, stop: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counted up to ``stop``; iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        if deepest >= stop:
            return deepest
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_stop(stop, stop_token_ids) -> None:
    """400 for more stop strings, stop characters or stop token ids than a step may check."""
    strings = [stop] if isinstance(stop, str) else list(stop or ())
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(strings)} strings; the limit is {MAX_STOP_STRINGS}", param="stop")
    total = sum(len(s) for s in strings)
    if total > MAX_STOP_CHARS:
        raise bad_request(f"stop strings have {total} characters in all; the limit is {MAX_STOP_CHARS}", param="stop")
    if len(stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"stop_token_ids has {len(stop_token_ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}", param="stop_token_ids"
        )


def check_prompt_chars(text: str, limit: int, param: str = "prompt") -> None:
    """400 before tokenizing a text that cannot fit the context whatever its tokens: ``limit`` is
    max_model_len times the longest token's length (ServerState.max_prompt_chars)."""
    if len(text) > limit:
        raise bad_request(
            f"{param} has {len(text)} characters; more than {limit} cannot fit in the "
            "model's context, so it is refused before tokenizing",
            param=param,
        )


def check_prompt_chars_of(state, chars: int, param: str) -> None:
    """check_prompt_chars for a chat: ``chars`` of message text rendered together."""
    if chars > state.max_prompt_chars:
        raise bad_request(
            f"{param} have {chars} characters; more than {state.max_prompt_chars} cannot fit in "
            "the model's context, so they are refused before tokenizing",
            param=param,
        )


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "body"
