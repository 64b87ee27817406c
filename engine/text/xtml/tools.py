"""Tools in Kimi K3's XTML: declarations, call arguments, and the order of tool results.

Follows Moonshot's ``encoding_k3.py`` (huggingface.co/moonshotai/Kimi-K3; vendored as
vllm-project/vllm ``vllm/tokenizers/encoding_k3.py``): ``_render_tool_declare``,
``normalize_tool_arguments`` and ``normalize_xtml_tool_result_messages``.
"""

from __future__ import annotations

import json
from typing import Any

from kimitui.engine.text.k2 import deep_sort
from kimitui.engine.text.xtml.options import XtmlError, compact_json

_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
# A system message that carries ``tools`` extends the tool set mid-conversation ("lazy loading").
_DECLARE_MORE = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended "
    "tools.\n\n```json\n{}\n```"
)


class ToolFormatError(XtmlError):
    """A tool call or tool list XTML cannot express."""


def declare_text(tools: list[dict], *, extension: bool = False) -> str:
    """Body of a ``type="tool-declare"`` system message: the tools as compact JSON, keys sorted at
    every depth. A bare function (no ``{"type": "function"}`` wrapper) is wrapped first, so both
    spellings declare the same bytes (the reference renders what it is given, which from an OpenAI
    client is always the wrapped form)."""
    tools = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    return (_DECLARE_MORE if extension else _DECLARE).format(compact_json(deep_sort(tools)))


def call_arguments(arguments: Any, where: str) -> tuple[dict, str | None]:
    """(arguments as a dict, raw text for a ``json`` block) of one tool call.

    An object is rendered key by key; a string is parsed first. A string that is not JSON at all is
    kept verbatim in a ``json`` block (a model that wrote broken JSON sees what it wrote); empty or
    missing arguments are no arguments; JSON that is not an object cannot be expressed.
    """
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}, arguments
        if isinstance(parsed, dict):
            return parsed, None
    raise ToolFormatError(
        f"{where}: tool call arguments must be a JSON object (or a string holding one), "
        f"got {type(arguments).__name__} {str(arguments)[:60]!r}"
    )


def _call_index(calls: Any) -> dict[str, tuple[int, Any]]:
    """tool call id -> (1-based position, function name); every call advances the position, and a
    repeated id keeps its first position."""
    index: dict[str, tuple[int, Any]] = {}
    for pos, call in enumerate(calls if isinstance(calls, list) else [], 1):
        if isinstance(call, dict) and call.get("id") is not None:
            fn = call.get("function")
            index.setdefault(str(call["id"]), (pos, fn.get("name") if isinstance(fn, dict) else call.get("name")))
    return index


def order_tool_results(messages: list[dict]) -> list[dict]:
    """``messages`` with each run of consecutive tool results in the order of the calls they answer.

    XTML binds a result to its call by position (``index``), while an OpenAI client binds by
    ``tool_call_id`` and may send results in any order. A run whose every message names a call of
    the latest assistant turn is sorted by call position (stable for repeats), and each gets that
    call's function name as ``tool``; a run with any unmatched result is left exactly as sent.
    Returns new dicts for the messages it changes and never mutates its input.
    """
    out: list[dict] = []
    calls: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if not isinstance(m, dict) or m.get("role") != "tool":
            if isinstance(m, dict) and m.get("role") == "assistant":
                calls = _call_index(m.get("tool_calls")) if m.get("tool_calls") else {}
            out.append(m)
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            run.append((calls.get(str(call_id)) if call_id is not None else None, len(run), messages[i]))
            i += 1
        if any(match is None for match, _, _ in run):
            out += [m for _, _, m in run]
            continue
        for (_, name), _, m in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                m = {**m, "tool": name, **({"name": name} if "name" in m else {})}
            out.append(m)
    return out
