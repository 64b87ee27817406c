"""Structured outputs without a model: constraints, compiled grammars, masks, the reasoning gate,
speculative draft masks, and the K2 / K3 tool-call and response grammars against replies written
the way the chat renderers write them (and read back by the reply parsers)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from kimitui.engine.engine import _resolve_model  # noqa: E402
from kimitui.engine.structured import StructuredOutputs  # noqa: E402
from kimitui.engine.structured import grammar as grammar_mod  # noqa: E402
from kimitui.engine.structured.bitmask import apply_bitmask, apply_bitmask_torch  # noqa: E402
from kimitui.engine.structured.grammar import GrammarError, check, compiler_for  # noqa: E402
from kimitui.engine.structured.matcher import RequestGrammar  # noqa: E402
from kimitui.engine.structured.reasoning import ReasoningGate  # noqa: E402
from kimitui.engine.text.chat_format import chat_format_for  # noqa: E402
from kimitui.engine.text.constraints import response_format_constraint, tool_call_constraint  # noqa: E402
from kimitui.engine.text.k2 import (
    THINK_CLOSE,
    TOOL_CALL_ARG,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,  # noqa: E402
    TOOL_CALLS_END,
    parse_reply,
)
from kimitui.engine.text.tokenizer import Tokenizer  # noqa: E402
from kimitui.engine.text.xtml.render import build_segments, encode_segments  # noqa: E402
from kimitui.engine.text.xtml.reply import parse_xtml_reply  # noqa: E402
from tests.helpers.schema_check import schema_errors  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.fixture(scope="module")
def k2():
    return Tokenizer.from_pretrained(_resolve_model("demo"))


@pytest.fixture(scope="module")
def k3():
    return Tokenizer.from_pretrained(_resolve_model("demo-k3"))


def _allowed(words: np.ndarray, vocab: int) -> set[int]:
    return set(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].nonzero()[0].tolist())


def _mask(g: RequestGrammar, width: int, vocab: int) -> set[int]:
    row = np.full(width, 0xFFFFFFFF, dtype=np.uint32)
    g.fill(row)
    return _allowed(row, vocab)


def _grammar(tok, spec, stop_ids=None, gate=None):
    comp = compiler_for(tok, tok.vocab_size)
    return RequestGrammar(
        "r", comp.new_matcher(spec), stop_ids if stop_ids is not None else tok.eos_token_ids, comp.eos_id, gate
    ), comp


def _feed(g: RequestGrammar, ids: list[int]) -> None:
    done = list(range(g.num_seen))  # advance() reads only the unseen tail
    g.advance(done + ids) if not g.num_seen else g.advance([0] * g.num_seen + ids)


# -- the constraint and its compilation -------------------------------------------------------


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(json={"type": "object"}, json_object=True)
    with pytest.raises(ValueError, match="JSON schema object"):
        StructuredOutputs(json=[1, 2])
    spec = StructuredOutputs(json={"b": 1, "a": 2})
    assert spec.json == '{"b": 1, "a": 2}'  # key order kept: the output writes properties in it
    assert spec.key == StructuredOutputs(json='{"b": 1, "a": 2}').key


@pytest.mark.parametrize(
    "schema, words",
    [({"type": "nonsense"}, "Invalid type"), ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "nope")],
)
def test_bad_schema_is_one_line(k2, schema, words):
    with pytest.raises(GrammarError) as e:
        check(StructuredOutputs(json=schema), k2, k2.vocab_size)
    assert words in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("invalid JSON schema")


def test_bad_grammar_is_one_line(k2):
    with pytest.raises(GrammarError) as e:
        check(StructuredOutputs(grammar="start: undefined_rule"), k2, k2.vocab_size)
    assert "undefined_rule" in str(e.value) and "\n" not in str(e.value)


def test_missing_library_says_what_to_install(k2, monkeypatch):
    monkeypatch.setattr(grammar_mod, "llguidance", None)
    with pytest.raises(GrammarError, match=r"pip install 'kimitui\[structured\]'"):
        grammar_mod.GrammarCompiler(k2, k2.vocab_size)


def test_compiled_grammars_are_cached(k2):
    comp = compiler_for(k2, k2.vocab_size)
    spec = StructuredOutputs(json=SCHEMA)
    assert comp.compile(spec) is comp.compile(StructuredOutputs(json=dict(SCHEMA)))
    assert compiler_for(k2, k2.vocab_size) is comp


# -- masks --------------------------------------------------------------------------------------


def test_apply_bitmask_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=gen)
    rows = torch.tensor([3, 0])
    bits = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32, generator=gen)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for v in range(70):
            word = int(bits[i, v // 32]) & 0xFFFFFFFF
            if not (word >> (v % 32)) & 1:
                want[r, v] = float("-inf")
    sparse = bits.clone()
    sparse[1] = 0
    sparse[1, 0] = 5  # ids 0 and 2 only: the CPU path's rebuilt row
    want_sparse = want.clone()
    want_sparse[0] = float("-inf")
    want_sparse[0, [0, 2]] = logits[0, [0, 2]]
    for apply in (apply_bitmask, apply_bitmask_torch):  # the CPU path and the device path
        assert torch.equal(apply(logits.clone(), rows, bits), want)
        assert torch.equal(apply(logits.clone(), rows, sparse), want_sparse)
        # a bitmask narrower than the logits masks the ids past it
        got = apply(logits.clone(), rows, bits[:, :2])
        assert torch.isinf(got[rows][:, 64:]).all() and torch.equal(got[1], logits[1])


def test_mask_is_exactly_the_tokens_the_grammar_takes(k2):
    g, comp = _grammar(k2, StructuredOutputs(json=SCHEMA))
    _feed(g, k2.encode('{"name":"ab'))
    width = (comp.vocab_size + 31) // 32
    allowed = _mask(g, width, k2.vocab_size)
    brute = {t for t in range(k2.vocab_size) if g.matcher.validate_tokens([t]) == 1}
    assert allowed == brute and 0 < len(allowed) < k2.vocab_size


def test_grammar_end_becomes_the_requests_stop_ids(k2):
    im_end = k2.token_to_id("<|im_end|>")
    eos = k2.eos_token_ids[0]
    g, comp = _grammar(k2, StructuredOutputs(json=SCHEMA), stop_ids=[im_end])
    width = (comp.vocab_size + 31) // 32
    ids = k2.encode('{"name":"x","n":5}')
    _feed(g, ids)
    assert _mask(g, width, k2.vocab_size) == {im_end}  # not the grammar's own end token (EOS)
    g.advance(ids + [im_end])
    assert g.active and g.matcher.is_stopped() and not g.failed


def test_whitespace_is_off_by_default(k2):
    width = (k2.vocab_size + 31) // 32
    spaces = {t for t in range(k2.vocab_size) if (k2.id_to_bytes(t) or b"x").strip() == b""}
    tight, _ = _grammar(k2, StructuredOutputs(json_object=True))
    loose, _ = _grammar(k2, StructuredOutputs(json_object=True, any_whitespace=True))
    for g in (tight, loose):
        g.advance(k2.encode("{"))
    assert not _mask(tight, width, k2.vocab_size) & spaces
    assert _mask(loose, width, k2.vocab_size) & spaces


def test_reasoning_gate_finds_a_marker_split_across_tokens(k2):
    pieces = [k2.encode(t) for t in ("I think", " </th", "ink>")]
    gate = ReasoningGate("</think>", k2.id_to_bytes)
    assert not any(gate.feed(t) for t in pieces[0] + pieces[1])
    assert any(gate.feed(t) for t in pieces[2]) and gate.open
    special = ReasoningGate(THINK_CLOSE, k2.id_to_bytes)
    assert special.feed(k2.token_to_id("</think>"))


def test_constraint_starts_after_the_reasoning(k2):
    spec = StructuredOutputs(json=SCHEMA, reasoning_end=THINK_CLOSE)
    gate = ReasoningGate(THINK_CLOSE, k2.id_to_bytes)
    g, comp = _grammar(k2, spec, gate=gate)
    reasoning = k2.encode("free text { not json") + [k2.token_to_id("</think>")]
    g.advance(reasoning[:-1])
    assert not g.active and g.matcher.validate_tokens(k2.encode('{"')) == 1  # nothing consumed yet
    g.advance(reasoning)
    assert g.active
    g.advance(reasoning + k2.encode('{"name":"q"'))
    assert not g.failed and not g.matcher.is_accepting()


def test_draft_masks_equal_one_token_at_a_time(k2):
    g, comp = _grammar(k2, StructuredOutputs(json=SCHEMA))
    width = (comp.vocab_size + 31) // 32
    good = k2.encode('{"name":"ab","n":42}')
    rng = random.Random(0)
    for trial in range(6):
        drafts = list(good[: rng.randrange(1, len(good) + 1)])
        if trial % 2:  # a refused draft somewhere: masks stop after it
            drafts[rng.randrange(len(drafts))] = k2.encode(" ")[0]
        before = _mask(g, width, k2.vocab_size)
        rows = np.full((len(drafts) + 1, width), 0xFFFFFFFF, dtype=np.uint32)
        filled = g.fill_drafts(rows, drafts)
        ref, _ = _grammar(k2, StructuredOutputs(json=SCHEMA))
        for j in range(len(drafts) + 1):
            want = _mask(ref, width, k2.vocab_size)
            assert filled[j] and _allowed(rows[j], k2.vocab_size) == want, (trial, j)
            if j == len(drafts) or drafts[j] not in want:
                assert not any(filled[j + 1 :])
                break
            assert ref.matcher.consume_token(drafts[j])
        assert _mask(g, width, k2.vocab_size) == before  # rolled back
    # a draft that ends the request: masks up to it, and the matcher is not left stopped
    drafts = good + [k2.eos_token_ids[0]]
    rows = np.full((len(drafts) + 1, width), 0xFFFFFFFF, dtype=np.uint32)
    assert g.fill_drafts(rows, drafts) == [True] * len(drafts) + [False]
    assert _allowed(rows[-2], k2.vocab_size) == set(k2.eos_token_ids)
    assert not g.matcher.is_stopped() and _mask(g, width, k2.vocab_size) == before


def test_draft_masks_open_the_gate_inside_the_drafts(k2):
    gate = ReasoningGate(THINK_CLOSE, k2.id_to_bytes)
    g, comp = _grammar(k2, StructuredOutputs(json=SCHEMA, reasoning_end=THINK_CLOSE), gate=gate)
    width = (comp.vocab_size + 31) // 32
    drafts = k2.encode("hm") + [k2.token_to_id("</think>")] + k2.encode('{"')
    rows = np.full((len(drafts) + 1, width), 0xFFFFFFFF, dtype=np.uint32)
    filled = g.fill_drafts(rows, drafts)
    n = len(drafts) - len(k2.encode('{"'))  # rows up to the marker are reasoning: unmasked
    assert filled == [False] * n + [True] * (len(drafts) + 1 - n)
    assert not gate.open and g.num_seen == 0  # the real gate and matcher did not move


# -- the chat formats' grammars against replies as the renderers write them --------------------


def _accepts(tok, spec, reply_ids, stop_ids):
    gate = ReasoningGate(spec.reasoning_end, tok.id_to_bytes) if spec.reasoning_end else None
    g, _ = _grammar(tok, spec, stop_ids=stop_ids, gate=gate)
    g.advance(reply_ids)
    return g.active and not g.failed and g.matcher.is_stopped()


@pytest.mark.parametrize("thinking", [False, True])
def test_k2_tool_call_grammar_takes_k2_calls(k2, thinking):
    fmt = chat_format_for(k2)
    args = '{"city":"Paris","days":3}'
    text = (("I should call it" + THINK_CLOSE) if thinking else "") + (
        f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}functions.get_weather:0{TOOL_CALL_ARG}{args}{TOOL_CALL_END}"
        f"{TOOL_CALL_BEGIN}functions.ping:1{TOOL_CALL_ARG}{{}}{TOOL_CALL_END}{TOOL_CALLS_END}"
    )
    ids = k2.encode(text, allow_special=True) + [k2.token_to_id("<|im_end|>")]
    stops = fmt.stop_token_ids()
    assert _accepts(k2, tool_call_constraint(fmt, k2, TOOLS, None, thinking), ids, stops)
    assert not _accepts(k2, tool_call_constraint(fmt, k2, TOOLS, "ping", thinking), ids, stops)
    calls = parse_reply(text, started_in_thinking=thinking).tool_calls
    assert [(c.name, c.arguments_json) for c in calls] == [("get_weather", args), ("ping", "{}")]
    bad = k2.encode(text.replace('"days":3', '"days":9'), allow_special=True)  # maximum 7
    assert not _accepts(k2, tool_call_constraint(fmt, k2, TOOLS, None, thinking), bad, stops)


def _xtml_reply_ids(k3, message: dict, thinking: bool) -> list[int]:
    """Token ids of an assistant message as K3 renders it, after its generation prompt."""
    prompt = encode_segments(build_segments([], thinking=thinking, thinking_effort=None), k3)
    full = encode_segments(
        build_segments([message], thinking=thinking, thinking_effort=None, add_generation_prompt=False), k3
    )
    assert full[: len(prompt)] == prompt
    return full[len(prompt) :]


@pytest.mark.parametrize("thinking", [False, True])
def test_k3_tool_call_grammar_takes_k3_calls(k3, thinking):
    fmt = chat_format_for(k3)
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":3,"unit":"c"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
    ]
    msg = {"role": "assistant", "content": "", "reasoning_content": "let me see", "tool_calls": calls}
    ids = _xtml_reply_ids(k3, msg, thinking)
    stops = fmt.stop_token_ids()
    assert _accepts(k3, tool_call_constraint(fmt, k3, TOOLS, None, thinking), ids, stops)
    assert not _accepts(k3, tool_call_constraint(fmt, k3, TOOLS, "get_weather", thinking), ids, stops)
    parsed = parse_xtml_reply(k3.decode(ids, skip_special_tokens=True), started_in_thinking=thinking)
    assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "unit": "c"}),
        ("ping", {}),
    ]


@pytest.mark.parametrize("thinking", [False, True])
def test_k3_json_response_grammar_takes_a_k3_reply(k3, thinking):
    fmt = chat_format_for(k3)
    value = {"name": "Kimi", "n": 3, "tags": ["a"]}
    msg = {"role": "assistant", "content": json.dumps(value, separators=(",", ":")), "reasoning_content": "ok"}
    ids = _xtml_reply_ids(k3, msg, thinking)
    spec = response_format_constraint(fmt, k3, SCHEMA, thinking)
    assert _accepts(k3, spec, ids, fmt.stop_token_ids())
    parsed = parse_xtml_reply(k3.decode(ids, skip_special_tokens=True), started_in_thinking=thinking)
    assert json.loads(parsed.content) == value and not schema_errors(value, SCHEMA)
    broken = dict(value, n=100)
    msg["content"] = json.dumps(broken, separators=(",", ":"))
    assert not _accepts(k3, spec, _xtml_reply_ids(k3, msg, thinking), fmt.stop_token_ids())


def test_k3_tool_with_untyped_parameters_takes_a_json_block(k3):
    fmt = chat_format_for(k3)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "run",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
                },
            },
        }
    ]
    spec = tool_call_constraint(fmt, k3, tools, "run", False)
    assert 'json type=\\"object\\"' in spec.grammar
    check(spec, k3, k3.vocab_size)


def test_named_tool_must_exist(k2):
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_constraint(chat_format_for(k2), k2, TOOLS, "nope", False)
