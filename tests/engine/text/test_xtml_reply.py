"""Kimi K3 reply parser: channels and tool calls, the same whatever pieces the text streams in."""

from __future__ import annotations

import json

import pytest

from kimitui.engine.text.k2 import ParsedReply, ToolCall
from kimitui.engine.text.xtml.reply import XtmlReplyParser, parse_xtml_reply

CALL = (
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="location" type="string"<|sep|>Paris <b><|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"metric": true}<|close|>argument<|sep|>'
    '<|close|>call<|sep|><|open|>call tool="a&quot;b" index="2"<|sep|><|open|>json type="object"<|sep|>'
    "{raw<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
)
ARGS = json.dumps({"location": "Paris <b>", "days": 2, "opts": {"metric": True}}, ensure_ascii=False)
CALLS = [ToolCall("functions.get_weather:0", "get_weather", ARGS), ToolCall('functions.a"b:1', 'a"b', "{raw")]

# (reply text, started_in_thinking, expected)
CASES = [
    (
        "Let me think.<|close|>think<|sep|><|open|>response<|sep|>It is 21 °C.<|close|>response<|sep|>"
        "<|close|>message<|sep|>",
        True,
        ParsedReply("Let me think.", "It is 21 °C."),
    ),
    # the model repeats the opener the prompt already wrote
    (
        "<|open|>think<|sep|>hm<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>",
        True,
        ParsedReply("hm", "ok"),
    ),
    ("Sure<|close|>response<|sep|><|close|>message<|sep|>", False, ParsedReply("", "Sure")),
    ("<|open|>response<|sep|>Sure<|close|>response<|sep|>", False, ParsedReply("", "Sure")),
    (
        "plan<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        + CALL
        + "<|close|>message<|sep|>",
        True,
        ParsedReply("plan", "Checking.", CALLS),
    ),
    # straight from the think channel into the tool section, no response channel
    ("plan<|close|>think<|sep|>" + CALL, True, ParsedReply("plan", "", CALLS)),
    # cut off by max_tokens: the partial marker is not shown, the unfinished call is dropped
    ("still thinking <|clo", True, ParsedReply("still thinking ", "")),
    (
        'a<|close|>think<|sep|><|open|>response<|sep|>b<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
        '<|open|>argument key="x" type="string"<|sep|>1',
        True,
        ParsedReply("a", "b"),
    ),
    # a truncated call does not swallow the next call's arguments
    (
        'x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="bad" index="1"<|sep|>'
        '<|open|>call tool="good" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
        True,
        ParsedReply("x", "", [ToolCall("functions.good:0", "good", "{}")]),
    ),
    # text after the message closes (or after a stray <|end_of_msg|>) is not part of the reply
    (
        "r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|><|close|>message<|sep|>junk",
        True,
        ParsedReply("r", "c"),
    ),
    ("no markers at all, a < b | c", True, ParsedReply("no markers at all, a < b | c", "")),
    ("no markers at all", False, ParsedReply("", "no markers at all")),
    ("", True, ParsedReply("", "")),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_parse_xtml_reply(i):
    text, thinking, expected = CASES[i]
    assert parse_xtml_reply(text, started_in_thinking=thinking) == expected


def _streamed(pieces, thinking):
    p = XtmlReplyParser(started_in_thinking=thinking)
    reasoning, content, calls = [], [], []
    for piece in pieces + [None]:
        d = p.finish() if piece is None else p.feed(piece)
        reasoning.append(d.reasoning)
        content.append(d.content)
        calls += d.tool_calls
    assert p.result() == ParsedReply("".join(reasoning), "".join(content), calls)
    return p.result()


@pytest.mark.parametrize("i", range(len(CASES)))
def test_stream_split_at_every_position(i):
    text, thinking, expected = CASES[i]
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]], thinking) == expected, cut
    for cut in range(0, len(text), 7):  # three pieces
        assert _streamed([text[:cut], text[cut : cut + 5], text[cut + 5 :]], thinking) == expected, cut
    assert _streamed(list(text), thinking) == expected


def test_deltas_stream_before_the_reply_ends():
    p = XtmlReplyParser(started_in_thinking=True)
    assert p.feed("thinking hard").reasoning == "thinking hard"
    assert p.feed("<|close|>th").reasoning == ""  # held: could be the closing marker
    d = p.feed("ink<|sep|><|open|>response<|sep|>Hi")
    assert (d.reasoning, d.content) == ("", "Hi")
    d = p.feed("<|close|>response<|sep|>" + CALL[: CALL.index('<|open|>call tool="a')])
    assert d.content == "" and d.tool_calls == CALLS[:1]  # a call is reported as soon as it closes
