"""``response_format`` and ``tool_choice`` -> the engine's structured-output constraint (400s here).

The constraints themselves (JSON in the reply format of K2 or K3, tool calls in the model's own
tool-call syntax) are built by engine.structured.chat_constraints; this module reads the request
fields as OpenAI defines them, and compiles the result once before generation starts, so a bad
schema is a 400 with one line, never an error in the middle of a stream.
"""

from __future__ import annotations

import asyncio

from kimitui.engine.structured import StructuredOutputs
from kimitui.engine.structured.grammar import GrammarError, check
from kimitui.engine.text.constraints import response_format_constraint, tool_call_constraint
from kimitui.server.errors import bad_request
from kimitui.server.limits import check_schema_depth


def response_schema(response_format: dict | None) -> tuple[bool, dict | None]:
    """(constrained, schema) of OpenAI's ``response_format``: ``text`` (or none) is unconstrained,
    ``json_object`` any JSON object (schema None), ``json_schema`` its ``json_schema.schema``."""
    if response_format is None:
        return False, None
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object", param="response_format"
            )
        check_schema_depth(schema, "response_format.json_schema.schema")
        return True, schema
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="response_format"
    )


def named_tool(tool_choice) -> str | None:
    """The function a ``tool_choice`` object names, or None for the string forms; 400 if malformed."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise bad_request(
            'tool_choice must be \'auto\', \'none\', \'required\' or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return name


def chat_constraint(req, fmt, tokenizer, started_in_thinking: bool) -> tuple[StructuredOutputs | None, str]:
    """(the constraint of a chat request or None, the request field it came from)."""
    constrained, schema = response_schema(req.response_format)
    calls = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    if constrained and calls:
        raise bad_request(
            "response_format and tool_choice 'required' / a named function cannot both constrain one reply",
            param="response_format",
        )
    try:
        if calls:
            return tool_call_constraint(
                fmt, tokenizer, req.tools, named_tool(req.tool_choice), started_in_thinking
            ), "tool_choice"
        if constrained:
            return response_format_constraint(fmt, tokenizer, schema, started_in_thinking), "response_format"
    except RecursionError:  # a schema whose $ref chain recurses without end
        raise bad_request(
            "the schema nests too deeply to compile", param="tool_choice" if calls else "response_format"
        ) from None
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice" if calls else "response_format") from None
    return None, ""


def completion_constraint(req) -> StructuredOutputs | None:
    """``response_format`` of a /v1/completions request: the text itself is the JSON."""
    constrained, schema = response_schema(getattr(req, "response_format", None))
    if not constrained:
        return None
    try:
        return StructuredOutputs(json=schema) if schema is not None else StructuredOutputs(json_object=True)
    except RecursionError:
        raise bad_request("the schema nests too deeply to compile", param="response_format") from None
    except ValueError as e:
        raise bad_request(str(e), param="response_format") from None


async def compile_constraint(state, spec: StructuredOutputs | None, param: str) -> None:
    """Compile ``spec`` for the served tokenizer (cached; the engine reuses it) or answer 400."""
    if spec is None:
        return
    tokenizer = state.require_tokenizer("structured outputs")
    try:
        await asyncio.to_thread(check, spec, tokenizer, state.vocab_size)
    except GrammarError as e:
        raise bad_request(str(e), param=param) from None
    except RecursionError:
        raise bad_request("the schema nests too deeply to compile", param=param) from None
