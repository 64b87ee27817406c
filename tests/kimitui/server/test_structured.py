"""Structured outputs through the real server on the random-weight demo models: ``response_format``
JSON schemas and objects, ``tool_choice`` "required" and named functions, streaming and not; bad
constraints are one-line 400s; a client that goes away releases the request's matcher."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("llguidance")

from kimitui.engine import AsyncLLM, EngineArgs  # noqa: E402
from kimitui.server import BackgroundServer, create_app  # noqa: E402
from tests.helpers.schema_check import schema_errors  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "temp": {"type": "integer", "minimum": -50, "maximum": 60},
        "sunny": {"type": "boolean"},
        "hours": {"type": "array", "items": {"enum": [6, 12, 18]}, "maxItems": 3},
    },
    "required": ["city", "temp", "sunny"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]
PARAMS = {"ping": {"type": "object", "properties": {}, "additionalProperties": False}, "get_weather": WEATHER}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


def _serve(model, tmp_path_factory, **args):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(
        engine_args=EngineArgs(
            model=model, max_model_len=1024, max_num_seqs=8, kv_cache_tokens=8192, device="cpu", **args
        )
    )
    server = BackgroundServer(port=0).start(create_app(llm, "m"))
    return llm, server


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    llm, server = _serve("demo", tmp_path_factory)
    yield llm, server.url
    server.stop()
    llm.shutdown()


def post(url, path, body, timeout=120):
    return httpx.post(url + path, json=body, timeout=timeout)


def chat(url, **body):
    r = post(url, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 300, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream_chat(url, **body):
    """(content, tool_calls merged by index, finish_reason) of a streamed chat reply."""
    content, calls, finish = "", {}, None
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=120,
        json={"messages": MSGS, "max_tokens": 300, "stream": True, **body},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for c in choice["delta"].get("tool_calls") or ():
                calls.setdefault(c["index"], c)
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _valid(text, schema):
    value = json.loads(text)
    errors = schema_errors(value, schema)
    assert not errors, (text, errors)
    return value


def _many(fn, seeds):
    with ThreadPoolExecutor(len(seeds)) as pool:  # concurrent requests share the engine's steps
        return list(pool.map(fn, seeds))


def test_json_schema_every_seed(k2):
    url = k2[1]
    for choice in _many(lambda s: chat(url, seed=s, temperature=1.0, response_format=RESPONSE_FORMAT), range(8)):
        assert choice["finish_reason"] == "stop"
        _valid(choice["message"]["content"], SCHEMA)


def test_json_schema_streaming_every_seed(k2):
    url = k2[1]
    outs = _many(lambda s: stream_chat(url, seed=s, temperature=1.0, response_format=RESPONSE_FORMAT), range(4))
    for content, calls, finish in outs:
        assert finish == "stop" and not calls
        _valid(content, SCHEMA)
    # the same seed streamed and not streamed writes the same JSON
    assert outs[0][0] == chat(url, seed=0, temperature=1.0, response_format=RESPONSE_FORMAT)["message"]["content"]


def test_json_object(k2):
    url = k2[1]
    replies = _many(
        lambda s: chat(url, seed=s, temperature=1.0, max_tokens=400, response_format={"type": "json_object"}), range(6)
    )
    done = [c["message"]["content"] for c in replies if c["finish_reason"] == "stop"]
    assert done, "no JSON object finished within max_tokens"
    for text in done:
        assert isinstance(json.loads(text), dict)
    for c in replies:
        assert c["message"]["content"].startswith("{")


def test_completions_response_format(k2):
    r = post(
        k2[1],
        "/v1/completions",
        {"prompt": "Weather:", "max_tokens": 300, "seed": 3, "response_format": RESPONSE_FORMAT},
    )
    assert r.status_code == 200, r.text
    _valid(r.json()["choices"][0]["text"], SCHEMA)


def _check_calls(calls, names):
    assert calls
    for c in calls:
        fn = c["function"]
        assert c["type"] == "function" and fn["name"] in names
        _valid(fn["arguments"], PARAMS[fn["name"]])


def test_tool_choice_required(k2):
    url = k2[1]
    for choice in _many(lambda s: chat(url, seed=s, temperature=1.0, tools=TOOLS, tool_choice="required"), range(4)):
        assert choice["finish_reason"] == "tool_calls", choice
        _check_calls(choice["message"]["tool_calls"], {"get_weather", "ping"})
    content, calls, finish = stream_chat(url, seed=1, temperature=1.0, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls"
    _check_calls(calls, {"get_weather", "ping"})


def test_named_tool_choice(k2):
    url = k2[1]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in _many(lambda s: chat(url, seed=s, temperature=1.0, tools=TOOLS, tool_choice=named), range(4)):
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and len(calls) == 1
        _check_calls(calls, {"get_weather"})


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
            "invalid JSON schema: Invalid type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema must be a JSON schema object",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot both",
        ),
    ],
)
def test_bad_constraints_are_one_line_400s(k2, body, param, words):
    r = post(k2[1], "/v1/chat/completions", {"messages": MSGS, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert "\n" not in err["message"]


def test_client_gone_releases_the_matcher(k2):
    llm, url = k2
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": MSGS,
            "max_tokens": 800,
            "stream": True,
            "ignore_eos": True,
            "seed": 0,
            "response_format": {"type": "json_object"},
        },
    ) as r:
        first = next(r.iter_lines())  # the request is running
        assert llm.engine.runner.structured.requests, first
    deadline = time.monotonic() + 30
    while llm.engine.runner.structured.requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not llm.engine.runner.structured.requests


@pytest.mark.slow
def test_k3_json_schema_and_tool_calls(tmp_path_factory):
    llm, server = _serve("demo-k3", tmp_path_factory)
    try:
        off = {"chat_template_kwargs": {"thinking": False}}
        for s in range(2):
            choice = chat(server.url, seed=s, temperature=1.0, response_format=RESPONSE_FORMAT, **off)
            assert choice["finish_reason"] == "stop"
            _valid(choice["message"]["content"], SCHEMA)
            choice = chat(server.url, seed=s, temperature=1.0, tools=TOOLS, tool_choice="required", **off)
            assert choice["finish_reason"] == "tool_calls"
            _check_calls(choice["message"]["tool_calls"], {"get_weather", "ping"})
        content, calls, finish = stream_chat(
            server.url, seed=5, temperature=1.0, response_format=RESPONSE_FORMAT, **off
        )
        assert finish == "stop"
        _valid(content, SCHEMA)
    finally:
        server.stop()
        llm.shutdown()


def test_each_of_n_choices_matches_the_schema(k2):
    llm, url = k2
    r = post(
        url,
        "/v1/chat/completions",
        {
            "messages": MSGS,
            "max_tokens": 300,
            "n": 3,
            "seed": 4,
            "temperature": 1.0,
            "response_format": RESPONSE_FORMAT,
        },
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    for c in choices:
        assert c["finish_reason"] == "stop"
        _valid(c["message"]["content"], SCHEMA)
    assert len({c["message"]["content"] for c in choices}) > 1  # each sample had its own matcher and seed
    assert not llm.engine.runner.structured.requests
