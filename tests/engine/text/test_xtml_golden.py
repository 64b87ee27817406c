"""Kimi K3 XTML as trained: tool choice, response format, thinking effort, tool-result order, per-part text.

Every golden string below is transcribed by hand from Moonshot's ``encoding_k3.py`` (the file the
K3 checkpoint ships on huggingface.co/moonshotai/Kimi-K3), read in its vendored copy
vllm-project/vllm ``vllm/tokenizers/encoding_k3.py`` (``build_chat_segments``,
``_internal_system_message``, ``normalize_xtml_tool_result_messages``, ``_render_assistant_segments``),
with the OpenAI-field mapping of vllm-project/vllm ``vllm/renderers/kimi_k3.py``. Token ids are
checked against an independent oracle: the checkpoint's ``tokenization_kimi.py``
``_encode_chat_segments`` rule (each segment encoded on its own; markers with special tokens
allowed, text with none) run by tiktoken itself over the demo K3 checkpoint's ``tiktoken.model``,
on the segments the reference emits (each tag name, each attribute as `` key`` / ``="`` / value /
``"``, each content part).
"""

from __future__ import annotations

import json
import re

import pytest

from kimitui.engine.text.chat_format import chat_format_for
from kimitui.engine.text.tokenizer import KIMI_PAT_STR, Tokenizer, load_tiktoken_ranks
from kimitui.engine.text.xtml.options import OptionError, resolve_effort
from kimitui.engine.text.xtml.render import XtmlError, build_segments, encode_segments, render_text, text_slices

tiktoken = pytest.importorskip("tiktoken")

EFFORT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to '
    "think in your thinking channel (not including the response channel), supported values include "
    "`low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`."
    "<|close|>message<|sep|><|end_of_msg|>"
)
HI = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
DECLARE = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, '
    'described in JSONSchema.\n\n```json\n[{"function":{"name":"f","parameters":{"type":"object"}},'
    '"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
)
CHOICE_NONE = (
    '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
    "`tool_choice=none`.\nYou MUST NOT call any tools in the next message.<|close|>message<|sep|>"
    "<|end_of_msg|>"
)
CHOICE_REQUIRED = (
    '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
    "`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|>"
    "<|end_of_msg|>"
)
RAW = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
JSON_OBJECT = (
    '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
    "`response_format=json_object`.\n" + RAW + "<|close|>message<|sep|><|end_of_msg|>"
)
SCHEMA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
}
JSON_SCHEMA = (
    '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
    "`response_format=json_schema`.\n" + RAW + "\nThe JSON data must match the following schema:\n"
    '```json\n{"properties":{"age":{"type":"integer"},"name":{"type":"string"}},"required":["name"],'
    '"type":"object"}\n```<|close|>message<|sep|><|end_of_msg|>'
)
USER = [{"role": "user", "content": "hi"}]
MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_ATTR = re.compile(r' ([\w-]+)="([^"]*)"')


def reference_segments(text: str, parts: dict[str, list[str]] | None = None) -> list[tuple[str, bool]]:
    """The segments encoding_k3 emits for a rendered prompt: markers; after ``<|open|>`` the tag and
    each attribute as `` key``, ``="``, value (absent when empty), ``"``; after ``<|close|>`` the tag;
    any other text one segment, or the content parts ``parts`` lists for it."""
    out: list[tuple[str, bool]] = []
    prev = None
    for piece in _SPLIT.split(text):
        if piece in MARKERS:
            out.append((piece, True))
        elif piece and prev == "<|open|>":
            tag, _, attrs = piece.partition(" ")
            out.append((tag, False))
            for key, value in _ATTR.findall(" " + attrs if attrs else ""):
                out += [(f" {key}", False), ('="', False)] + ([(value, False)] if value else []) + [('"', False)]
        elif piece:
            out += [(p, False) for p in (parts or {}).get(piece, [piece]) if p]
        prev = piece if piece in MARKERS else None if piece else prev
    return out


@pytest.fixture(scope="module")
def k3_dir():
    from kimitui.engine.demo.k3 import ensure_demo_k3_checkpoint

    return ensure_demo_k3_checkpoint()


@pytest.fixture(scope="module")
def k3_tok(k3_dir):
    return Tokenizer.from_pretrained(k3_dir)


@pytest.fixture(scope="module")
def oracle(k3_dir):
    """tokenization_kimi.TikTokenTokenizer._encode_chat_segments, over tiktoken itself."""
    cfg = json.loads((k3_dir / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding(
        "k3-demo",
        pat_str=KIMI_PAT_STR,
        mergeable_ranks=load_tiktoken_ranks(k3_dir / "tiktoken.model"),
        special_tokens=specials,
    )

    def encode(segments: list[tuple[str, bool]]) -> list[int]:
        return [
            i
            for text, control in segments
            for i in (enc.encode(text, allowed_special="all") if control else enc.encode(text, disallowed_special=()))
        ]

    return encode


def check(k3_tok, oracle, messages, golden, parts=None, **kwargs):
    """Byte for byte, segment for segment, id for id."""
    segments = build_segments(messages, **kwargs)
    assert "".join(s.text for s in segments) == golden
    want = reference_segments(golden, parts)
    assert [(s.text, s.control) for s in segments] == want
    ids = encode_segments(segments, k3_tok)
    assert ids == oracle(want)
    return ids


def test_tool_choice_auto_and_named_render_no_message(k3_tok, oracle):
    """encoding_k3: only "required" and "none" add a tool-choice message; a named function is a dict
    and equals neither (vllm renderers/kimi_k3.py passes it through as a dict)."""
    golden = DECLARE + HI + GEN_RESPONSE
    check(k3_tok, oracle, USER, golden, tools=[TOOL], thinking=False)
    check(k3_tok, oracle, USER, golden, tools=[TOOL], thinking=False, tool_choice="auto")
    check(
        k3_tok,
        oracle,
        USER,
        golden,
        tools=[TOOL],
        thinking=False,
        tool_choice={"type": "function", "function": {"name": "f"}},
    )


def test_tool_choice_none_keeps_tools_and_forbids_calls(k3_tok, oracle):
    """encoding_k3: tools are declared whatever the choice; "none" adds its message after the conversation."""
    check(
        k3_tok,
        oracle,
        USER,
        DECLARE + EFFORT.format("max") + HI + CHOICE_NONE + GEN_THINK,
        tools=[TOOL],
        tool_choice="none",
    )


def test_tool_choice_required(k3_tok, oracle):
    """The required message, in a prompt a third-party test pins (by sha256) to encoding_k3.py's output
    (tests/engine/text/test_xtml.py TOOL_PROMPT)."""
    from tests.engine.text.test_xtml import TOOL_PROMPT, WEATHER_TOOL

    msgs = [{"role": "user", "content": "What's the weather in San Francisco?"}]
    assert CHOICE_REQUIRED in TOOL_PROMPT
    check(k3_tok, oracle, msgs, TOOL_PROMPT, tools=[WEATHER_TOOL], thinking=False, tool_choice="required")


@pytest.mark.parametrize("bad", ["sometimes", {"type": "function"}, {"function": {"name": "f"}}, 3])
def test_tool_choice_bad_values(bad):
    with pytest.raises(OptionError, match="tool_choice") as e:
        render_text(USER, tools=[TOOL], tool_choice=bad)
    assert e.value.param == "tool_choice"


def test_response_format_json_object_and_schema(k3_tok, oracle):
    """encoding_k3: response-format messages after the tool-choice one; the schema key-sorted at every
    depth, compact; found under json_schema.schema, json_schema.json_schema, or json_schema itself."""
    check(
        k3_tok, oracle, USER, HI + JSON_OBJECT + GEN_RESPONSE, thinking=False, response_format={"type": "json_object"}
    )
    for js in ({"name": "person", "strict": True, "schema": SCHEMA}, {"json_schema": SCHEMA}, SCHEMA):
        check(
            k3_tok,
            oracle,
            USER,
            HI + JSON_SCHEMA + GEN_RESPONSE,
            thinking=False,
            response_format={"type": "json_schema", "json_schema": js},
        )
    check(
        k3_tok,
        oracle,
        USER,
        DECLARE + EFFORT.format("high") + HI + CHOICE_REQUIRED + JSON_SCHEMA + GEN_THINK,
        tools=[TOOL],
        thinking_effort="high",
        tool_choice="required",
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    assert render_text(USER, response_format={"type": "text"}) == render_text(USER)
    with pytest.raises(OptionError, match="response_format.type must be one of text, json_object, json_schema"):
        render_text(USER, response_format={"type": "yaml"})
    with pytest.raises(OptionError, match='needs a "json_schema" object') as e:
        render_text(USER, response_format={"type": "json_schema"})
    assert e.value.param == "response_format.json_schema"


def test_thinking_effort_only_low_high_max(k3_tok, oracle):
    """encoding_k3 ``_VALID_THINKING_EFFORTS = {"low", "high", "max"}`` (its message text still names
    medium, byte for byte)."""
    for effort in ("low", "high", "max"):
        check(k3_tok, oracle, USER, EFFORT.format(effort) + HI + GEN_THINK, thinking_effort=effort)
    for bad in ("medium", "extreme", ""):
        with pytest.raises(OptionError, match=r"thinking_effort must be one of low, high, max") as e:
            render_text(USER, thinking_effort=bad)
        assert e.value.param == "thinking_effort" and isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "reasoning,want",
    [
        ("none", (False, "max")),
        ("minimal", (True, "low")),
        ("low", (True, "low")),
        ("high", (True, "high")),
        ("xhigh", (True, "max")),
        ("max", (True, "max")),
        (None, (True, "max")),
    ],
)
def test_reasoning_effort_mapping(reasoning, want):
    """vllm renderers/kimi_k3.py: "none" turns thinking off, K3's values pass through; ours also maps
    OpenAI's minimal -> low and xhigh -> max."""
    assert resolve_effort(None, None, reasoning) == want


def test_reasoning_effort_precedence_and_refusals(k3_tok):
    # explicit options win over reasoning_effort, as vLLM setdefault()s them
    assert resolve_effort(None, "high", "low") == (True, "high")
    assert resolve_effort(True, None, "none") == (True, "max")
    for bad in ("medium", "turbo"):
        with pytest.raises(
            OptionError, match=r"reasoning_effort must be one of none, minimal, low, high, xhigh, max"
        ) as e:
            resolve_effort(None, None, bad)
        assert e.value.param == "reasoning_effort"
    fmt = chat_format_for(k3_tok)
    assert k3_tok.decode(fmt.encode(USER, reasoning_effort="none").ids) == HI + GEN_RESPONSE
    low = fmt.encode(USER, reasoning_effort="minimal")
    assert k3_tok.decode(low.ids) == EFFORT.format("low") + HI + GEN_THINK and low.started_in_thinking


CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "fa", "arguments": '{"x": 1}'}},
    {"id": "call_b", "type": "function", "function": {"name": "fb", "arguments": "{}"}},
]
ASSISTANT = (
    '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools'
    '<|sep|><|open|>call tool="fa" index="1"<|sep|><|open|>argument key="x" type="number"<|sep|>1'
    '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="fb" index="2"<|sep|><|close|>call<|sep|>'
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)


def _result(tool, index, body):
    return (
        f'<|open|>message role="tool" tool="{tool}" index="{index}"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'
    )


def test_tool_results_reordered_to_call_order(k3_tok, oracle):
    """encoding_k3 normalize_xtml_tool_result_messages: a run of results all matched by tool_call_id
    is sorted to the calls' order and named after the matched call (a stale name is overwritten);
    ``index`` counts results since the assistant turn."""
    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_b", "name": "stale", "content": "B"},
        {"role": "tool", "tool_call_id": "call_a", "content": "A"},
    ]
    golden = HI + ASSISTANT + _result("fa", 1, "A") + _result("fb", 2, "B") + GEN_RESPONSE
    check(k3_tok, oracle, msgs, golden, thinking=False)
    assert msgs[2]["name"] == "stale"  # the caller's messages are not changed


def test_tool_results_with_an_unmatched_id_stay_as_sent(k3_tok, oracle):
    """A run with any result not matched to a call is left in order; names then come from the
    message, else from the call at the same position."""
    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_b", "content": "B"},
        {"role": "tool", "tool_call_id": "nope", "content": "A"},
    ]
    golden = HI + ASSISTANT + _result("fa", 1, "B") + _result("fb", 2, "A") + GEN_RESPONSE
    check(k3_tok, oracle, msgs, golden, thinking=False)


def test_multipart_text_is_tokenised_per_part(k3_tok, oracle):
    """encoding_k3 _render_content_segments: one segment per text part, never joined."""
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "user", "content": "x"},
    ]
    golden = (
        '<|open|>message role="user"<|sep|>Hello world<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hi there<|close|>response<|sep|>'
        '<|close|>message<|sep|><|end_of_msg|><|open|>message role="user"<|sep|>x<|close|>message<|sep|>'
        "<|end_of_msg|>" + GEN_RESPONSE
    )
    ids = check(
        k3_tok,
        oracle,
        msgs,
        golden,
        parts={"Hello world": ["Hello ", "world"], "Hi there": ["Hi ", "there"]},
        thinking=False,
    )
    joined = [
        {**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"]}
        for m in msgs
    ]
    assert encode_segments(build_segments(joined, thinking=False), k3_tok) != ids  # the split is visible


def test_attribute_pieces_are_tokenised_one_by_one(k3_tok, oracle):
    """encoding_k3 _attr: `` name``, ``="``, value and ``"`` are four segments; merged they can
    tokenize differently (here ``=":`` is one pre-token)."""
    msgs = [{"role": "user", "name": ":bot", "content": "x"}]
    golden = '<|open|>message role="user" name=":bot"<|sep|>x<|close|>message<|sep|><|end_of_msg|>' + GEN_RESPONSE
    ids = check(k3_tok, oracle, msgs, golden, thinking=False)
    assert ids != k3_tok.encode(golden, allow_special=True)


def test_whitespace_only_reasoning_is_dropped(k3_tok, oracle):
    """encoding_k3 _render_assistant_segments: reasoning is written only when ``.strip()`` leaves
    something, and then unstripped; the think channel is always there."""
    turn = (
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>{}<|close|>think<|sep|><|open|>response'
        "<|sep|>ok<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    for reasoning, shown in ((" \n\t ", ""), (None, ""), (" why \n", " why \n")):
        msgs = USER + [{"role": "assistant", "content": "ok", "reasoning_content": reasoning}] + USER
        check(k3_tok, oracle, msgs, EFFORT.format("max") + HI + turn.format(shown) + HI + GEN_THINK)


def test_assistant_name_and_tool_extension(k3_tok, oracle):
    """encoding_k3: an assistant ``name`` is an attribute; a system message carrying ``tools`` is the
    lazy-loading tool declaration (its content is not rendered)."""
    msgs = USER + [
        {"role": "assistant", "name": "kimi", "content": "ok"},
        {"role": "system", "content": "ignored", "tools": [TOOL]},
    ]
    golden = (
        HI + '<|open|>message role="assistant" name="kimi"<|sep|><|open|>response<|sep|>ok<|close|>response'
        '<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role="system" type="tool-declare"<|sep|>'
        "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access "
        "to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
        '[{"function":{"name":"f","parameters":{"type":"object"}},"type":"function"}]\n```<|close|>message'
        "<|sep|><|end_of_msg|>" + GEN_RESPONSE
    )
    check(k3_tok, oracle, msgs, golden, thinking=False)


@pytest.mark.parametrize("args", ["[1, 2]", '"text"', [1], 7])
def test_tool_arguments_must_be_an_object(args):
    """encoding_k3 normalize_tool_arguments: JSON that is not an object, or a non-string non-dict, is refused."""
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}]
    with pytest.raises(XtmlError, match=r"messages\[0\]\.tool_calls\[0\]: tool call arguments must be a JSON object"):
        render_text(msgs)


def _slices_oracle(s: str, limit: int) -> list[str]:
    # tokenization_kimi._split_whitespaces_or_nonwhitespaces, restated: a new slice starts where a
    # run of one kind (space / non-space) would exceed `limit`.
    out, start, run, space = [], 0, 0, s[:1].isspace()
    for i, c in enumerate(s):
        if c.isspace() != space:
            space, run = c.isspace(), 1
        else:
            run += 1
            if run > limit:
                out.append(s[start:i])
                start, run = i, 1
    return out + [s[start:]]


def test_long_runs_are_sliced_like_the_reference(k3_tok):
    texts = ["a" * 25_000, "a" * 25_001, " " * 60_000 + "ab" + "c" * 50_001, "x\u3000" * 10 + "\u3000" * 25_003]
    for t in texts:
        assert text_slices(t) == _slices_oracle(t, 25_000)
    big = ("word " * 100_000)[:450_000]
    assert text_slices(big) == [big[:400_000], big[400_000:]]
    long = ("the" * 9000)[:25_003]  # cut at 25,000 splits a "the": visible in the ids
    segments = build_segments([{"role": "user", "content": long}], thinking=False)
    want = []
    for s in segments:
        if s.control:
            want.append(k3_tok.token_to_id(s.text))
        else:
            cut = [long[:25_000], long[25_000:]] if s.text == long else [s.text]
            want += [i for piece in cut for i in k3_tok.encode(piece)]
    assert long in [s.text for s in segments] and encode_segments(segments, k3_tok) == want
