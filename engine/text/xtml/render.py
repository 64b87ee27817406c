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

(no newlines in the real thing). Request options are system messages with a ``type``: the tool list
(``tool-declare``) and, with thinking on, the thinking effort (``thinking-effort``) come first; the
tool choice (``tool-choice``, for "none" and "required") and the response format
(``response-format``) come after the conversation, right before the generation prompt.
The generation prompt opens an assistant message and its ``think`` channel (or ``response`` with
thinking off); the model closes both and ends with ``<|end_of_msg|>``. Described in the Kimi K3
tech report (appendix "chat template") and reproduced by third-party ports of ``encoding_k3.py``
(e.g. ms-swift's ``KimiK3AgentTemplate``).

Encoding goes segment by segment, as Moonshot's ``tokenization_kimi.py`` (``_encode_chat_segments``)
does: the markers are encoded as their token ids and every other piece (a tag name, each part of an
attribute, a content part) as plain text on its own, so no message can forge a control token by
containing ``<|open|>`` as characters, and the ids are the ones the model was trained on.
Per-request options (thinking effort, tool choice, response format) are engine/text/xtml/options.py;
tool declarations, call arguments and the order of tool results are engine/text/xtml/tools.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kimitui.engine.text.xtml.options import (
    DEFAULT_THINKING_EFFORT,
    EFFORT_TEXT,
    THINKING_EFFORTS,
    OptionError,
    XtmlError,
    check_thinking_effort,
    compact_json,
    response_format_text,
    tool_choice_text,
)
from kimitui.engine.text.xtml.tools import call_arguments, declare_text, order_tool_results

__all__ = [
    "CLOSE",
    "DEFAULT_THINKING_EFFORT",
    "END_OF_MSG",
    "MARKERS",
    "OPEN",
    "ROLES",
    "SEP",
    "THINKING_EFFORTS",
    "OptionError",
    "Segment",
    "XtmlError",
    "build_segments",
    "compact_json",
    "encode_segments",
    "escape_attr",
    "render_text",
    "unescape_attr",
    "xtml_type",
]

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
ROLES = ("system", "user", "assistant", "tool")
# tokenization_kimi.py encodes a text piece in slices: at most 400,000 characters, and no run of more
# than 25,000 whitespace or non-whitespace characters (tiktoken is slow, or panics, beyond that).
_MAX_CHUNK, _MAX_RUN = 400_000, 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (_MAX_RUN + 1, _MAX_RUN + 1))


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
        # Every piece is its own segment, never merged with its neighbour: the reference encodes
        # ` role`, `="`, `user` and `"` one by one, and a merged string can tokenize differently
        # (`=".x"` is one pre-token where `="` and `.x` are two).
        if text:
            self.segments.append(Segment(text, False))

    def open(self, tag: str, **attrs: Any) -> None:
        self.mark(OPEN)
        self.text(tag)
        for key, value in attrs.items():
            for piece in (f" {key}", '="', escape_attr(str(value)), '"'):
                self.text(piece)
        self.mark(SEP)

    def close(self, tag: str) -> None:
        self.mark(CLOSE)
        self.text(tag)
        self.mark(SEP)

    def message(self, parts: list[str], **attrs: Any) -> None:
        self.open("message", **attrs)
        for part in parts:
            self.text(part)
        self.close("message")
        self.mark(END_OF_MSG)

    def system(self, kind: str, body: str) -> None:
        """A system message the renderer writes itself (``_internal_system_message``: body stripped)."""
        self.message([body.strip()], role="system", type=kind)


def build_segments(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = DEFAULT_THINKING_EFFORT,
    add_generation_prompt: bool = True,
    preserve_thinking: bool = True,
    tool_choice: Any = None,
    response_format: Any = None,
) -> list[Segment]:
    """The prompt for ``messages`` as segments (see the module docstring for the grammar).

    Order, as in the reference: tool declaration, thinking effort, the conversation (tool results
    reordered to their calls' order), tool choice, response format, generation prompt.
    ``preserve_thinking=False`` renders the think channel of assistant turns before the last user
    message empty (K3 is trained with preserved thinking, so True is the default).
    """
    if thinking and thinking_effort is not None:
        check_thinking_effort(thinking_effort)
    b = _Builder()
    if tools:
        b.system("tool-declare", declare_text(tools))
    if thinking and thinking_effort is not None:
        b.system("thinking-effort", EFFORT_TEXT.format(thinking_effort))
    _conversation(b, messages, thinking, preserve_thinking)
    for kind, body in (
        ("tool-choice", tool_choice_text(tool_choice)),
        ("response-format", response_format_text(response_format)),
    ):
        if body is not None:
            b.system(kind, body)
    if add_generation_prompt:
        b.open("message", role="assistant")
        b.open("think" if thinking else "response")
    return b.segments


def _conversation(b: _Builder, messages: list[dict], thinking: bool, preserve_thinking: bool) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise XtmlError(f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    # Positions are those of the caller's list (for error messages); reordering keeps runs in place.
    ordered = order_tool_results(messages)
    calls: list[dict] | None = None  # the latest assistant turn's tool calls, which results answer
    results = 0
    for i, m in enumerate(ordered):
        role = m["role"]
        parts = content_parts(m.get("content"), f"messages[{i}].content")
        if role == "assistant":
            calls, results = m.get("tool_calls"), 0
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if not preserve_thinking and i < last_user:
                reasoning = None
            _assistant(b, m, parts, reasoning, thinking, i)
        elif role == "tool":
            results += 1
            b.message(parts, role="tool", tool=_tool_result_name(m, calls, results, i), index=results)
        elif role == "system" and m.get("tools"):
            b.system("tool-declare", declare_text(m["tools"], extension=True))
        else:
            attrs = {"role": role, **({"name": m["name"]} if m.get("name") else {})}
            b.message(parts, **attrs)


def content_parts(content: Any, where: str) -> list[str]:
    """A message's content as the text pieces the reference encodes one by one: a string is one
    piece, a list of ``{"type": "text"}`` parts one piece per part (never joined)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise XtmlError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise XtmlError(f"{where}[{j}]: content part of type {kind!r} is not supported (text only)")
        parts.append(part["text"])
    return parts


def render_text(messages: list[dict], **kwargs: Any) -> str:
    """The prompt as one string (for display and tests; encode with ``encode_segments``)."""
    return "".join(s.text for s in build_segments(messages, **kwargs))


def encode_segments(segments: list[Segment], tokenizer) -> list[int]:
    """Prompt ids: markers as their token ids, every text segment encoded on its own (special-token
    text stays text), sliced as ``tokenization_kimi._encode_text_piece`` slices long text."""
    ids: list[int] = []
    for s in segments:
        if s.control:
            tid = tokenizer.token_to_id(s.text)
            if tid is None:
                raise XtmlError(
                    f"{tokenizer.name_or_path or 'tokenizer'}: has no token {s.text!r}; not a Kimi K3 tokenizer"
                )
            ids.append(tid)
        else:
            for piece in text_slices(s.text):
                ids += tokenizer.encode(piece)
    return ids


def text_slices(text: str) -> list[str]:
    """``text`` cut where the reference cuts it before BPE: every 400,000 characters, then inside
    each chunk every 25,000 characters of a longer run of whitespace or of non-whitespace."""
    out = []
    for start in range(0, len(text), _MAX_CHUNK):
        chunk = text[start : start + _MAX_CHUNK]
        cuts = [
            run.start() + k
            for run in _LONG_RUN.finditer(chunk)
            for k in range(_MAX_RUN, run.end() - run.start(), _MAX_RUN)
        ]
        out += [chunk[a:b] for a, b in zip([0, *cuts], [*cuts, len(chunk)])]
    return out


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


def _assistant(b: _Builder, m: dict, parts: list[str], reasoning: Any, thinking: bool, i: int) -> None:
    b.open("message", role="assistant", **({"name": m["name"]} if m.get("name") else {}))
    if thinking:  # the think channel is always there, even empty
        b.open("think")
        if reasoning is not None and str(reasoning).strip():  # whitespace-only reasoning is dropped
            b.text(str(reasoning))
        b.close("think")
    b.open("response")
    for part in parts:
        b.text(part)
    b.close("response")
    calls = m.get("tool_calls")
    if calls:
        b.open("tools")
        for j, call in enumerate(calls, 1):
            _tool_call(b, call, j, f"messages[{i}].tool_calls[{j - 1}]")
        b.close("tools")
    b.close("message")
    b.mark(END_OF_MSG)


def _tool_call(b: _Builder, call: dict, index: int, where: str) -> None:
    fn = call.get("function", call) if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise XtmlError(f"{where}: a tool call needs function.name")
    args, raw = call_arguments(fn.get("arguments"), where)
    b.open("call", tool=name, index=index)
    if raw is not None:  # not JSON: carried verbatim
        b.open("json", type="object")
        b.text(raw)
        b.close("json")
    else:
        for key, value in args.items():
            b.open("argument", key=key, type=xtml_type(value))
            b.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            b.close("argument")
    b.close("call")


def _tool_result_name(m: dict, calls: Any, n: int, i: int) -> str:
    """The tool a result answers: its own ``tool`` (set from the matched call when results were
    reordered) or ``name``, else the name of the ``n``-th call of the latest assistant turn."""
    name = m.get("tool", m.get("name"))
    if name is None and isinstance(calls, list) and n <= len(calls):
        call = calls[n - 1]
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
    if name is None:
        raise XtmlError(f"messages[{i}]: a tool result needs a name or a preceding assistant tool call")
    return str(name)
