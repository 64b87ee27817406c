"""OpenAI's ``response_format`` and ``tool_choice`` as constraints in the Kimi reply formats.

A chat reply is not bare JSON: it follows the format the model was trained on, and the server's
reply parsers (engine/text/k2.py for K2, engine/text/xtml/reply.py for K3) read it back. So the grammar
covers the reply from the end of the reasoning section (``reasoning_end``) to its stop token:

Kimi K2 (chat template of moonshotai/Kimi-K2-Instruct; vLLM's kimi_k2 tool parser):
- JSON: the content is the JSON text itself.
- tool calls: ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json arguments}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``.

Kimi K3 (XTML, engine/text/xtml/render.py; every marker is its own token, named by id in the grammar):
- JSON: the response channel holds it: ``<|open|>response<|sep|>JSON<|close|>response<|sep|>``
  (its opener is already in the prompt when thinking is off), then ``<|close|>message<|sep|>``.
- tool calls: an empty response element, then ``<|open|>tools<|sep|>`` with one ``<|open|>call
  tool="NAME" index="N"<|sep|>...<|close|>call<|sep|>`` per call, each argument an element
  ``<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`` (strings raw, other
  values JSON), as K3 renders tool calls; a tool whose parameters are not a plain object of typed
  properties takes its arguments as one ``<|open|>json type="object"<|sep|>...`` block, which the
  reply parser also reads.

JSON inside these grammars allows no free whitespace by default (see ``StructuredOutputs``).
"""

from __future__ import annotations

import json

from kimitui.engine.structured.grammar import json_schema_text
from kimitui.engine.structured.params import StructuredOutputs
from kimitui.engine.text.k2 import (
    THINK_CLOSE,
    TOOL_CALL_ARG,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
)
from kimitui.engine.text.xtml.render import CLOSE, OPEN, SEP, escape_attr
from kimitui.engine.text.xtml.reply import THINK_END

ANY_OBJECT = {"type": "object"}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_XTML_TYPES = {
    "string": "string",
    "integer": "number",
    "number": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "object",
    "array": "array",
}


def _is_xtml(fmt) -> bool:
    return getattr(fmt, "name", "") == "xtml"


def _token(tokenizer, text: str) -> str:
    """Lark for exactly this token (by id, so the same text spelled in pieces does not match)."""
    tid = tokenizer.token_to_id(text)
    if tid is None:
        raise ValueError(f"the tokenizer has no token {text!r}, which this chat format's replies need")
    return f"<[{tid}]>"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def response_format_constraint(
    fmt, tokenizer, schema: dict | None, started_in_thinking: bool, any_whitespace: bool = False
) -> StructuredOutputs:
    """``schema`` None: any JSON object (``json_object``). ``fmt``: the ChatFormat of the prompt."""
    if not _is_xtml(fmt):
        end = THINK_CLOSE if started_in_thinking else None
        if schema is None:
            return StructuredOutputs(json_object=True, any_whitespace=any_whitespace, reasoning_end=end)
        return StructuredOutputs(json=schema, any_whitespace=any_whitespace, reasoning_end=end)
    o, c, s = (_token(tokenizer, m) for m in (OPEN, CLOSE, SEP))
    head = f'{o} "response" {s} ' if started_in_thinking else ""
    lark = (
        f'start: {head}body {c} "response" {s} {c} "message" {s}\n'
        f"body: %json {json_schema_text(schema or ANY_OBJECT, any_whitespace)}\n"
    )
    return StructuredOutputs(
        grammar=lark, any_whitespace=any_whitespace, reasoning_end=THINK_END if started_in_thinking else None
    )


def tool_call_constraint(
    fmt, tokenizer, tools: list[dict], name: str | None, started_in_thinking: bool, any_whitespace: bool = False
) -> StructuredOutputs:
    """One or more calls of any of ``tools`` (``tool_choice: "required"``), or exactly one call of
    the tool ``name`` (a named ``tool_choice``). ``tools``: OpenAI tool dicts."""
    functions = [_function(t) for t in tools]
    if not functions:
        raise ValueError("tool_choice 'required' or a named function needs tools")
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    build = _xtml_tools if _is_xtml(fmt) else _k2_tools
    lark = build(
        tokenizer,
        functions,
        single=name is not None,
        started_in_thinking=started_in_thinking,
        any_whitespace=any_whitespace,
    )
    end = (THINK_END if _is_xtml(fmt) else THINK_CLOSE) if started_in_thinking else None
    return StructuredOutputs(grammar=lark, any_whitespace=any_whitespace, reasoning_end=end)


def _function(tool: dict) -> dict:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError("every tool needs function.name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
    return {"name": fn["name"], "parameters": params or _NO_ARGUMENTS}


def _k2_tools(tokenizer, functions, *, single: bool, started_in_thinking: bool, any_whitespace: bool) -> str:
    sb, se, cb, ca, ce = (
        _token(tokenizer, t) for t in (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_ARG, TOOL_CALL_END)
    )
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [f"start: {sb} {'call' if single else 'call+'} {se}", f"call: {calls}", "IDX: /[0-9]{1,3}/"]
    for i, f in enumerate(functions):
        lines.append(f"call_{i}: {cb} {_lit('functions.' + f['name'] + ':')} IDX {ca} args_{i} {ce}")
        lines.append(f"args_{i}: %json {json_schema_text(f['parameters'], any_whitespace)}")
    return "\n".join(lines) + "\n"


def _xtml_tools(tokenizer, functions, *, single: bool, started_in_thinking: bool, any_whitespace: bool) -> str:
    o, c, s = (_token(tokenizer, m) for m in (OPEN, CLOSE, SEP))

    def close(tag: str) -> str:
        return f'{c} "{tag}" {s}'

    # K3 renders an (empty) response element before the tool section; with thinking off the prompt
    # has already opened it.
    head = f'{o} "response" {s} ' if started_in_thinking else ""
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [
        f'start: {head}{close("response")} {o} "tools" {s} {"call" if single else "call+"} '
        f"{close('tools')} {close('message')}",
        f"call: {calls}",
        "IDX: /[1-9][0-9]{0,2}/",
    ]
    for i, f in enumerate(functions):
        opener = (
            f'{o} {_lit("call tool=" + chr(34) + escape_attr(f["name"]) + chr(34) + " index=" + chr(34))} IDX "\\"" {s}'
        )
        args = _xtml_arguments(f["parameters"], i, o, s, close, any_whitespace)
        lines.append(f"call_{i}: {opener} {args[0]} {close('call')}")
        lines += args[1:]
    return "\n".join(lines) + "\n"


def _xtml_arguments(schema: dict, i: int, o: str, s: str, close, any_whitespace: bool) -> list[str]:
    """[the arguments' expression, its rules...]: one element per property, in schema order
    (required ones mandatory), or one JSON block when the schema has no simple shape."""
    props = schema.get("properties")
    simple = (
        schema.get("type") in (None, "object")
        and isinstance(props, dict)
        and all(isinstance(p, dict) and _xtml_type(p) is not None for p in props.values())
    )
    if not simple:
        block = f'{o} "json type=\\"object\\"" {s} args_{i} {close("json")}'
        return [block, f"args_{i}: %json {json_schema_text(schema, any_whitespace)}"]
    required = set(schema.get("required") or ())
    parts, rules = [], []
    for j, (key, prop) in enumerate(props.items()):
        kind = _xtml_type(prop)
        head = f"{o} {_lit('argument key=' + chr(34) + escape_attr(key) + chr(34) + ' type=' + chr(34) + kind + chr(34))} {s}"
        rules.append(f"arg_{i}_{j}: {head} value_{i}_{j} {close('argument')}")
        rules.append(f"value_{i}_{j}: {_xtml_value(prop, kind, any_whitespace)}")
        parts.append(f"arg_{i}_{j}" if key in required else f"arg_{i}_{j}?")
    return [" ".join(parts) or '""', *rules]


def _xtml_type(prop: dict) -> str | None:
    """The XTML ``type`` attribute of a property, or None when it has no single one."""
    t = prop.get("type")
    if isinstance(t, str):
        if t == "string" and "pattern" in prop:
            return None  # a raw string value cannot carry a JSON-schema pattern here
        return _XTML_TYPES.get(t)
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "string"
    return None


def _xtml_value(prop: dict, kind: str, any_whitespace: bool) -> str:
    """A property's value as K3 writes it: strings raw (never containing ``<|``, which would read as
    a marker), everything else JSON."""
    if kind != "string":
        return f"%json {json_schema_text(prop, any_whitespace)}"
    enum = prop.get("enum")
    if enum:
        return " | ".join(_lit(v) for v in enum)
    lo, hi = int(prop.get("minLength", 0)), prop.get("maxLength")
    if hi is not None:
        return f"/[^<]{{{lo},{int(hi)}}}/"
    return f"/([^<]|<[^|]){{{lo},}}/"
