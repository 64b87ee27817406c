"""Kimi K3's chat format, "XTML": messages -> segments -> prompt ids.

K3 ships no Jinja chat template; Moonshot's ``encoding_k3.py`` builds the prompt in code as an
XML-like markup whose angle brackets are three tokens, ``<|open|>``, ``<|sep|>`` and ``<|close|>``:

    <|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>REASONING<|close|>think<|sep|>
        <|open|>response<|sep|>TEXT<|close|>response<|sep|>
        <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
            <|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>
        <|close|>call<|sep|><|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>

(no newlines in the real thing). Global options come first as system messages: the tool list
(``type="tool-declare"``) and, with thinking on, the thinking effort (``type="thinking-effort"``).
The generation prompt opens an assistant message and its ``think`` channel (or ``response`` with
thinking off); the model closes both and ends with ``<|end_of_msg|>``. Described in the Kimi K3
tech report (appendix "chat template") and reproduced by third-party ports of ``encoding_k3.py``
(e.g. ms-swift's ``KimiK3AgentTemplate``).

Encoding goes segment by segment: the markers are encoded as their token ids and everything else
(role names, user text, tool names, argument values) as plain text, so no message can forge a
control token by containing ``<|open|>`` as characters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.chat import content_text, deep_sort

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
# Moonshot's renderer asserts {low, high, max}, while the system message it renders tells the
# model `low`, `medium`, `high` and `max` are supported; we accept all four.
THINKING_EFFORTS = ("low", "medium", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
ROLES = ("system", "user", "assistant", "tool")

_EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
_TOOLS_TEXT = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"


class XtmlError(ValueError):
    """Messages XTML cannot express (unknown role, bad tool call, unknown effort)."""


@dataclass(frozen=True)
class Segment:
    """One piece of the prompt: a control marker (encoded as its token id) or plain text."""

    text: str
    control: bool


def escape_attr(value: str) -> str:
    # `&` first, so the `&` of `&quot;` is not escaped again.
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    # The reverse order of escape_attr: a literal "&quot;" in a value must come back as written.
    return value.replace("&quot;", '"').replace("&amp;", "&")


class _Builder:
    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def mark(self, marker: str) -> None:
        self.segments.append(Segment(marker, True))

    def text(self, text: str) -> None:
        if not text:
            return
        # Adjacent text is one segment: `message role="user"` must tokenize as one string, exactly
        # as it does inside the whole prompt.
        if self.segments and not self.segments[-1].control:
            self.segments[-1] = Segment(self.segments[-1].text + text, False)
        else:
            self.segments.append(Segment(text, False))

    def open(self, tag: str, **attrs: str) -> None:
        self.mark(OPEN)
        self.text(tag + "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs.items()))
        self.mark(SEP)

    def close(self, tag: str) -> None:
        self.mark(CLOSE)
        self.text(tag)
        self.mark(SEP)

    def element(self, tag: str, body: str, **attrs: str) -> None:
        self.open(tag, **attrs)
        self.text(body)
        self.close(tag)

    def message(self, body: str, **attrs: str) -> None:
        self.element("message", body, **attrs)
        self.mark(END_OF_MSG)


def build_segments(messages: list[dict], *, tools: list[dict] | None = None, thinking: bool = True,
                   thinking_effort: str | None = DEFAULT_THINKING_EFFORT, add_generation_prompt: bool = True,
                   preserve_thinking: bool = True) -> list[Segment]:
    """The prompt for ``messages`` as segments (see the module docstring for the grammar).

    ``preserve_thinking=False`` renders the think channel of assistant turns before the last user
    message empty (K3 is trained with preserved thinking, so True is the default).
    """
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise XtmlError(f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)}, got {thinking_effort!r}")
    b = _Builder()
    if tools:
        b.message(_TOOLS_TEXT.format(compact_json(deep_sort([_as_function_tool(t) for t in tools]))),
                  role="system", type="tool-declare")
    if thinking and thinking_effort is not None:
        b.message(_EFFORT_TEXT.format(thinking_effort), role="system", type="thinking-effort")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    calls: list[dict] = []  # the latest assistant turn's tool calls, which tool results answer
    results = 0
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise XtmlError(f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = content_text(m.get("content"), f"messages[{i}].content", XtmlError)
        if role == "assistant":
            calls, results = list(m.get("tool_calls") or []), 0
            reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
            if not preserve_thinking and i < last_user:
                reasoning = ""
            _assistant(b, content, reasoning if thinking else None, calls, i)
        elif role == "tool":
            results += 1
            name, index = _tool_result_target(m, calls, results, i)
            b.message(content, role="tool", tool=name, index=str(index))
        else:
            attrs = {"role": role}
            if m.get("name"):
                attrs["name"] = str(m["name"])
            b.message(content, **attrs)
    if add_generation_prompt:
        b.open("message", role="assistant")
        b.open("think" if thinking else "response")
    return b.segments


def render_text(messages: list[dict], **kwargs: Any) -> str:
    """The prompt as one string (for display and tests; encode with ``encode_segments``)."""
    return "".join(s.text for s in build_segments(messages, **kwargs))


def encode_segments(segments: list[Segment], tokenizer) -> list[int]:
    """Prompt ids: markers as their token ids, text with special-token text kept as text."""
    ids: list[int] = []
    for s in segments:
        if s.control:
            tid = tokenizer.token_to_id(s.text)
            if tid is None:
                raise XtmlError(f"{tokenizer.name_or_path or 'tokenizer'}: has no token {s.text!r}; "
                                "not a Kimi K3 tokenizer")
            ids.append(tid)
        else:
            ids += tokenizer.encode(s.text)
    return ids


def compact_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def xtml_type(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _as_function_tool(tool: dict) -> dict:
    return tool if "function" in tool else {"type": "function", "function": tool}


def _assistant(b: _Builder, content: str, reasoning: str | None, calls: list[dict], i: int) -> None:
    b.open("message", role="assistant")
    if reasoning is not None:  # thinking on: the think channel is always there, even empty
        b.element("think", reasoning)
    b.element("response", content)
    if calls:
        b.open("tools")
        for j, call in enumerate(calls, 1):
            _tool_call(b, call, j, f"messages[{i}].tool_calls[{j - 1}]")
        b.close("tools")
    b.close("message")
    b.mark(END_OF_MSG)


def _tool_call(b: _Builder, call: dict, index: int, where: str) -> None:
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise XtmlError(f"{where}: a tool call needs function.name")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # not JSON: carried verbatim in a json block below
    b.open("call", tool=name, index=str(index))
    if isinstance(args, dict):
        for key, value in args.items():
            b.element("argument", value if isinstance(value, str) else json.dumps(value, ensure_ascii=False),
                      key=str(key), type=xtml_type(value))
    elif args is not None:
        raw = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        b.element("json", raw, type="object")
    b.close("call")


def _tool_result_target(m: dict, calls: list[dict], n: int, i: int) -> tuple[str, int]:
    """(tool name, 1-based call index) a tool message answers: by tool_call_id when it names one
    of the last assistant turn's calls, else by position (results follow the calls' order)."""
    call_id = m.get("tool_call_id")
    for j, call in enumerate(calls, 1):
        if call_id and call.get("id") == call_id:
            return call.get("function", call)["name"], j
    name = m.get("tool") or m.get("name")
    if not name and n <= len(calls):
        name = calls[n - 1].get("function", calls[n - 1]).get("name")
    if not name:
        raise XtmlError(f"messages[{i}]: a tool result needs a name or a preceding assistant tool call")
    return str(name), n
