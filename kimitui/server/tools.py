"""``tools`` of a chat request, checked whatever ``tool_choice`` says.

With ``tool_choice: "auto"`` the tools only reach the prompt, so a malformed one used to be
rendered as whatever it was (a tool without a name, parameters that are a string) and answered
200. OpenAI refuses such a request with 400; so do we, naming the tool's field.

Accepted shapes: OpenAI's ``{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}`` and the bare function object the chat formats also take.
"""

from __future__ import annotations

from kimitui.server.errors import bad_request
from kimitui.server.limits import MAX_TOOLS, check_schema_depth

MAX_NAME_CHARS = 256


def check_tools(tools: list | None, param: str = "tools") -> None:
    """400 naming the first malformed tool field."""
    if tools is None:
        return
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"{param} has {len(tools)} tools; the limit is {MAX_TOOLS}", param=param)
    for i, tool in enumerate(tools):
        where = f"{param}.{i}"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", param=where)
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise bad_request(f"{where}.type must be 'function', got {tool.get('type')!r}", param=f"{where}.type")
            fn, where = tool["function"], f"{where}.function"
            if not isinstance(fn, dict):
                raise bad_request(f"{where} must be an object", param=where)
        else:
            fn = tool
        _check_function(fn, where)


def _check_function(fn: dict, where: str) -> None:
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise bad_request(f"{where}.name must be a non-empty string", param=f"{where}.name")
    if len(name) > MAX_NAME_CHARS or any(c.isspace() or not c.isprintable() for c in name):
        raise bad_request(
            f"{where}.name must be at most {MAX_NAME_CHARS} printable characters without spaces", param=f"{where}.name"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", param=f"{where}.description")
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
        check_schema_depth(parameters, f"{where}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be true or false", param=f"{where}.strict")
