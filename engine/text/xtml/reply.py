"""Kimi K3 replies: XTML text -> reasoning, content and tool calls, while it streams.

A K3 reply continues the generation prompt, which left an assistant message and its ``think``
(or ``response``) channel open. A complete thinking reply reads (no newlines in reality):

    REASONING<|close|>think<|sep|><|open|>response<|sep|>TEXT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>...<|close|>call<|sep|><|close|>tools<|sep|>
    <|close|>message<|sep|>

and then ``<|end_of_msg|>``, the stop token. ``<|open|>``, ``<|close|>`` and ``<|sep|>`` are not
special tokens in K3's tokenizer, so they arrive as text and this parser removes them. Same API as
the K2 ``engine.chat.ReplyStreamParser``.
"""

from __future__ import annotations

import json
import re

from kimitui.engine.text.k2 import ParsedReply, StreamDelta, StreamParserBase, ToolCall, _held_suffix
from kimitui.engine.text.xtml.render import CLOSE, END_OF_MSG, OPEN, SEP, unescape_attr

THINK_BEGIN, THINK_END = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_BEGIN, RESPONSE_END = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_BEGIN, TOOLS_END = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
MESSAGE_END = f"{CLOSE}message{SEP}"

# state -> the markers that leave it, and where each leads. Text in "think" is reasoning, in
# "response" content, in "tools" the tool section; in the other states it is structure, dropped.
_EXITS: dict[str, dict[str, str]] = {
    "think": {THINK_END: "between", MESSAGE_END: "done", END_OF_MSG: "done"},
    "between": {RESPONSE_BEGIN: "response", TOOLS_BEGIN: "tools", MESSAGE_END: "done", END_OF_MSG: "done"},
    "response": {RESPONSE_END: "after", TOOLS_BEGIN: "tools", MESSAGE_END: "done", END_OF_MSG: "done"},
    "after": {TOOLS_BEGIN: "tools", MESSAGE_END: "done", END_OF_MSG: "done"},
    "tools": {TOOLS_END: "after", MESSAGE_END: "done", END_OF_MSG: "done"},
}
_ATTR_RE = re.compile(r'([A-Za-z_][\w.:-]*)="([^"]*)"')


def parse_xtml_reply(text: str, *, started_in_thinking: bool = True) -> ParsedReply:
    """Split a complete K3 reply; ``started_in_thinking``: the prompt opened the think channel."""
    parser = XtmlReplyParser(started_in_thinking=started_in_thinking)
    parser.feed(text)
    parser.finish()
    return parser.result()


class XtmlReplyParser(StreamParserBase):
    """Incremental K3 reply parser: ``feed`` text pieces, get reasoning/content/tool-call deltas.

    Text that could still become a marker is held back until it is decided, so the deltas do not
    depend on how the text was cut into pieces.
    """

    def __init__(self, started_in_thinking: bool = True):
        # The model may repeat the channel opener the prompt already wrote; it can only be first.
        super().__init__("start")
        self._first = "think" if started_in_thinking else "response"
        self._section = ""  # the tool section so far

    def _step(self, final: bool) -> StreamDelta:
        out = {"think": [], "response": []}
        calls: list[ToolCall] = []
        while True:
            state, buf = self._state, self._buf
            if state == "start":
                opener = THINK_BEGIN if self._first == "think" else RESPONSE_BEGIN
                other = RESPONSE_BEGIN if self._first == "think" else THINK_BEGIN
                hit = next((m for m in (opener, other) if buf.startswith(m)), None)
                if hit is None and not final and any(m.startswith(buf) for m in (opener, other)):
                    break  # could still be an opener: wait
                self._buf = buf[len(hit) :] if hit else buf
                self._state = ("think" if hit == THINK_BEGIN else "response") if hit else self._first
                continue
            if state == "done":
                self._buf = ""
                break
            exits = _EXITS[state]
            hits = [(i, m) for m in exits if (i := buf.find(m)) >= 0]
            if hits:
                idx, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
                self._take(state, buf[:idx], out, calls)
                self._buf, self._state = buf[idx + len(marker) :], exits[marker]
                continue
            # Held: a tail that may still grow into a marker. At the end of the reply it is the
            # start of a marker cut off by max_tokens, so it is dropped rather than shown.
            keep = _held_suffix(buf, tuple(exits))
            self._take(state, buf[: len(buf) - keep], out, calls)
            self._buf = "" if final else buf[len(buf) - keep :]
            break
        delta = StreamDelta("".join(out["think"]), "".join(out["response"]), calls)
        self.reasoning += delta.reasoning
        self.content += delta.content
        self.tool_calls += calls
        return delta

    def _take(self, state: str, text: str, out: dict, calls: list[ToolCall]) -> None:
        if state in out:
            out[state].append(text)
        elif state == "tools" and text:
            self._section += text
            found = list(call_blocks(self._section))
            for attrs, body in found[self._calls_seen :]:
                call = _tool_call(attrs, body, len(self.tool_calls) + len(calls))
                if call is not None:
                    calls.append(call)
            self._calls_seen = len(found)


def call_blocks(text: str, tag: str = "call"):
    """(attributes, body) of each complete ``<|open|>TAG ...<|sep|>BODY<|close|>TAG<|sep|>``.

    A linear scan. An opener with no close before the next opener is skipped, so a truncated call
    never swallows the next call's arguments under its own name.
    """
    opener, closer = f"{OPEN}{tag}", f"{CLOSE}{tag}{SEP}"
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        head_end = text.find(SEP, start + len(opener))
        if head_end < 0:
            return
        end = text.find(closer, head_end + len(SEP))
        if end < 0:
            return
        nxt = text.find(opener, head_end + len(SEP))
        if 0 <= nxt < end:
            pos = nxt
            continue
        attrs = {k: unescape_attr(v) for k, v in _ATTR_RE.findall(text[start + len(opener) : head_end])}
        yield attrs, text[head_end + len(SEP) : end]
        pos = end + len(closer)


def _tool_call(attrs: dict, body: str, n: int) -> ToolCall | None:
    name = attrs.get("tool")
    if not name:
        return None  # a call without a tool name cannot be acted on
    raw = next((b for a, b in call_blocks(body, "json")), None)
    if raw is not None and body.startswith(f"{OPEN}json") and body.endswith(f"{CLOSE}json{SEP}"):
        arguments = raw.strip()
    else:
        args = {}
        for a, value in call_blocks(body, "argument"):
            if "key" in a:
                args[a["key"]] = _typed(value, a.get("type", "string"))
        arguments = json.dumps(args, ensure_ascii=False)
    # Same id shape as K2 replies, so tool results can name the call they answer.
    return ToolCall(id=f"functions.{name}:{n}", name=name, arguments_json=arguments)


def _typed(raw: str, kind: str):
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # a truncated or malformed value keeps its text
