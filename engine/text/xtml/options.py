"""Per-request options Kimi K3 reads as system messages: thinking effort, tool choice, response format.

K3 has no request fields for these; Moonshot's ``encoding_k3.py`` (shipped with the checkpoint on
huggingface.co/moonshotai/Kimi-K3, vendored as vllm-project/vllm ``vllm/tokenizers/encoding_k3.py``)
writes each as a system message with a ``type`` attribute. The thinking-effort message comes
before the conversation (after the tool declaration); the tool-choice and response-format messages
come after it, right before the generation prompt. The texts below are the reference's, verbatim.

Thinking effort: the reference accepts ``low``, ``high`` and ``max`` only (its message text also
names ``medium``, which its own check rejects), so anything else is an ``OptionError``. OpenAI's
``reasoning_effort`` is mapped onto it as vLLM's K3 renderer (``vllm/renderers/kimi_k3.py``) does:
``none`` turns thinking off and K3's own values pass through; on top of that ``minimal`` maps to
``low`` and ``xhigh`` to ``max`` (the nearest ends of K3's scale). ``medium`` is refused: the
reference refuses it, and choosing between ``low`` and ``high`` for the client would be a guess.
"""

from __future__ import annotations

import json
from typing import Any

from kimitui.engine.text.k2 import deep_sort

THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
# OpenAI reasoning_effort -> K3 thinking effort; None turns thinking off.
REASONING_EFFORTS: dict[str, str | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}
TOOL_CHOICES = ("auto", "none", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
_TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
_JSON_OBJECT_TEXT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_JSON_SCHEMA_TEXT = (
    "The system is invoked with `response_format=json_schema`.\n"
    + _RAW_JSON
    + "\nThe JSON data must match the following schema:\n```json\n{}\n```"
)


class XtmlError(ValueError):
    """Messages or options XTML cannot express (unknown role, bad tool call, unknown effort)."""


class OptionError(XtmlError):
    """A request option K3 does not take; ``param`` names the request field (for an HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_thinking_effort(effort: str, param: str = "thinking_effort") -> str:
    if effort not in THINKING_EFFORTS:
        raise OptionError(
            f"{param} must be one of {', '.join(THINKING_EFFORTS)} (the values Kimi K3 knows), got {effort!r}", param
        )
    return effort


def resolve_effort(
    thinking: bool | None, thinking_effort: str | None, reasoning_effort: str | None
) -> tuple[bool, str]:
    """(thinking, effort) from the explicit K3 options and OpenAI's ``reasoning_effort``.

    Explicit ``thinking`` / ``thinking_effort`` win over ``reasoning_effort``, as in vLLM's K3
    renderer (it only ``setdefault``s them). Thinking defaults to on and the effort to ``max``,
    as Moonshot's ``apply_chat_template`` does.
    """
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise OptionError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} (Kimi K3 thinks at "
                f"low, high or max; none turns thinking off), got {reasoning_effort!r}",
                "reasoning_effort",
            )
        mapped = REASONING_EFFORTS[reasoning_effort]
        if mapped is None:
            thinking = False if thinking is None else thinking
        elif thinking_effort is None:
            thinking_effort = mapped
    thinking = True if thinking is None else thinking
    return thinking, check_thinking_effort(thinking_effort or DEFAULT_THINKING_EFFORT)


def tool_choice_name(tool_choice: Any) -> str | None:
    """The function a named tool choice (``{"type": "function", "function": {"name": ...}}``)
    forces; None for the string choices. Anything else is an ``OptionError``."""
    name = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        ok = tool_choice.get("type") == "function" and isinstance(name, str) and bool(name)
    else:
        ok = tool_choice is None or tool_choice in TOOL_CHOICES
    if not ok:
        raise OptionError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
            "tool_choice",
        )
    return name


def tool_choice_text(tool_choice: Any) -> str | None:
    """The body of the ``type="tool-choice"`` message, or None when K3 renders none.

    The reference renders one for ``required`` and ``none`` only: ``auto`` is the default, and a
    named function (a dict, equal to neither string) renders nothing; the tools stay declared in
    every case, so the choice is left to constrained decoding, as in vLLM.
    """
    tool_choice_name(tool_choice)  # validates
    return _TOOL_CHOICE_TEXT.get(tool_choice) if isinstance(tool_choice, str) else None


def response_schema(response_format: dict) -> Any:
    """The JSON schema of a ``json_schema`` response format, found where the reference looks:
    ``json_schema.schema``, else ``json_schema.json_schema``, else the ``json_schema`` object itself."""
    js = response_format.get("json_schema")
    if js is None:
        return None
    if isinstance(js, dict):
        return js.get("schema", js.get("json_schema", js))
    return js


def response_format_type(response_format: Any) -> str | None:
    """The format's type (the reference also takes a bare string); None when there is none."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in RESPONSE_FORMATS:
        raise OptionError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}", "response_format"
        )
    if kind == "json_schema" and not (
        isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict)
    ):
        raise OptionError(
            'response_format of type "json_schema" needs a "json_schema" object', "response_format.json_schema"
        )
    return kind


def compact_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def response_format_text(response_format: Any) -> str | None:
    """The body of the ``type="response-format"`` message, or None (``text`` or no format).
    The schema is key-sorted at every depth and written as compact JSON, as the reference does."""
    kind = response_format_type(response_format)
    if kind == "json_object":
        return _JSON_OBJECT_TEXT
    if kind == "json_schema":
        return _JSON_SCHEMA_TEXT.format(compact_json(deep_sort(response_schema(response_format))))
    return None
