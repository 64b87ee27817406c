"""Inputs a careless or hostile client sends: each a one-line 4xx naming the field or the limit,
never a 5xx or a 200 for something malformed; a seeded fuzz run of a few hundred such requests
leaves the server healthy."""

from __future__ import annotations

import json
import os
import random

import httpx
import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.server import BackgroundServer, create_app
from kimitui.server.limits import MAX_JSON_DEPTH, MAX_PROMPTS, MAX_SCHEMA_DEPTH, MAX_STOP_CHARS, MAX_STOP_STRINGS

MODEL = "kimitui-demo"
MSGS = [{"role": "user", "content": "hi"}]
ROUTES = {  # a valid body for each route that reads one
    "/v1/completions": {"prompt": "hello", "max_tokens": 1},
    "/v1/chat/completions": {"messages": MSGS, "max_tokens": 1},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}


class _Panic(BaseException):
    """Stands in for pyo3's PanicException: a Rust panic, a BaseException."""


class _PanickingTokenizer:
    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, *args, **kwargs):
        if "boom" in text:
            raise _Panic("called `Result::unwrap()` on an `Err` value")
        return self._tok.encode(text, *args, **kwargs)


class _PanickingLLM:
    def __init__(self, llm):
        self._llm = llm
        self.tokenizer = _PanickingTokenizer(llm.tokenizer)

    def __getattr__(self, name):
        return getattr(self._llm, name)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=128, max_num_seqs=4, kv_cache_tokens=1024))
    srv = BackgroundServer(port=0).start(create_app(llm, MODEL))
    panic = BackgroundServer(port=0).start(create_app(_PanickingLLM(llm), MODEL))
    yield srv.url, panic.url
    srv.stop()
    panic.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def url(servers):
    return servers[0]


def post(url: str, path: str, body, content_type: str | None = "application/json") -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(url + path, content=content, headers=headers, timeout=60)


def four_xx(r: httpx.Response, *words: str, param: str | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert "\n" not in err["message"] and all(w in err["message"] for w in words), err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/tokenize", "prompt")])
def test_huge_run_of_one_letter_is_refused_before_tokenizing(url, path, field):
    r = post(url, path, {"prompt": "a" * 10_000_000, "max_tokens": 1})
    four_xx(r, "characters", "before tokenizing", param=field)


def test_huge_chat_message_is_refused_before_tokenizing(url):
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 10_000_000}]})
    four_xx(r, "characters", param="messages")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "boom", "max_tokens": 1}, "prompt"),
        ("/tokenize", {"prompt": "boom"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 1}, "messages"),
    ],
)
def test_tokenizer_panic_is_400(servers, path, body, param):
    four_xx(post(servers[1], path, body), "tokenizer failed", "_Panic", param=param)
    assert httpx.get(servers[1] + "/health").status_code == 200


def test_deeply_nested_body_is_400(url):
    four_xx(post(url, "/v1/completions", b"[" * 100_000), "nested")
    deep = {"prompt": "x", "max_tokens": 1, "user": json.loads("[" * 200 + "]" * 200)}
    four_xx(post(url, "/v1/completions", deep), f"more than {MAX_JSON_DEPTH} levels", param="user" + ".0" * 63)


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH // 2 + 1, 450])
def test_deep_response_format_schema_is_400(url, levels):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(levels)}}
    for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "x"})):
        four_xx(post(url, path, {**body, "max_tokens": 1, "response_format": fmt}), "nested")


def test_schema_just_inside_the_limit_is_taken(url):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_schema(MAX_SCHEMA_DEPTH // 2 - 1)}}
    r = post(url, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", list(ROUTES))
def test_lone_surrogate_in_model_is_400(url, path):
    r = post(url, path, {**ROUTES[path], "model": "\ud800"})  # json.dumps writes it as \ud800
    four_xx(r, "lone surrogate", param="model")


def test_lone_surrogate_anywhere_is_400_and_pairs_are_fine(url):
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ok \udfff"}], "max_tokens": 1})
    four_xx(r, "lone surrogate", param="messages.0.content")
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": ["\ud83d"]})
    four_xx(r, "lone surrogate", param="stop.0")
    r = post(url, "/tokenize", {"prompt": "smile \U0001f600"})  # an escaped pair, \ud83d\ude00
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "function", "function": {"description": "no name"}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": ""}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "a string"}}], "tools.0.function.parameters"),
        ([{"type": "function", "function": "f"}], "tools.0.function"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type"),
        (["f"], "tools.0"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": _nested_schema(MAX_SCHEMA_DEPTH // 2 + 1)}}],
            "tools.0.function.parameters",
        ),
    ],
)
@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_malformed_tools_are_400_whatever_tool_choice_says(url, tools, param, choice):
    body = {"messages": MSGS, "max_tokens": 1, "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    four_xx(post(url, "/v1/chat/completions", body), param=param)


def test_malformed_tools_on_tokenize_are_400(url):
    r = post(url, "/tokenize", {"messages": MSGS, "tools": [{"type": "function", "function": {}}]})
    four_xx(r, param="tools.0.function.name")


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "text/html; charset=utf-8"]
)
def test_non_json_media_types_are_415(url, content_type):
    r = post(url, "/v1/completions", ROUTES["/v1/completions"], content_type=content_type)
    assert r.status_code == 415
    four_xx(r, "application/json", param="Content-Type")


def test_json_media_types_and_none_are_read(url):
    for ct in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        assert post(url, "/tokenize", ROUTES["/tokenize"], content_type=ct).status_code == 200, ct


def test_stop_string_count_and_length_limits(url):
    body = {"prompt": "x", "max_tokens": 1}
    four_xx(
        post(url, "/v1/completions", {**body, "stop": ["s"] * (MAX_STOP_STRINGS + 1)}),
        str(MAX_STOP_STRINGS),
        param="stop",
    )
    four_xx(
        post(url, "/v1/completions", {**body, "stop": ["s" * (MAX_STOP_CHARS // 2 + 1)] * 2}),
        str(MAX_STOP_CHARS),
        param="stop",
    )
    four_xx(
        post(url, "/v1/chat/completions", {"messages": MSGS, "stop": ["s"] * 1_000_000}),
        str(MAX_STOP_STRINGS),
        param="stop",
    )
    assert post(url, "/v1/completions", {**body, "stop": ["s"] * MAX_STOP_STRINGS}).status_code == 200


def test_prompts_per_request_limit(url):
    r = post(url, "/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    four_xx(r, str(MAX_PROMPTS), param="prompt")
    r = post(url, "/v1/completions", {"prompt": [[5, 6]] * (MAX_PROMPTS + 1), "max_tokens": 1})
    four_xx(r, str(MAX_PROMPTS), param="prompt")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_numbers_are_400(url, literal):
    four_xx(post(url, "/v1/completions", b'{"prompt": "x", "temperature": ' + literal + b"}"), "not valid JSON")


def test_completions_default_to_16_tokens(url):
    r = post(url, "/v1/completions", {"prompt": [5, 6, 7], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    # near the end of the context: what is left
    r = post(url, "/v1/completions", {"prompt": [5] * 120, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


# -- fuzzing -------------------------------------------------------------------------------------

_FIELDS = {
    "/v1/completions": [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "best_of",
        "stop",
        "seed",
        "logprobs",
        "echo",
        "stream",
        "stream_options",
        "min_tokens",
        "stop_token_ids",
        "presence_penalty",
        "repetition_penalty",
        "response_format",
        "model",
        "logit_bias",
    ],
    "/v1/chat/completions": [
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "tools",
        "tool_choice",
        "response_format",
        "top_logprobs",
        "logprobs",
        "stop",
        "n",
        "chat_template_kwargs",
        "reasoning_effort",
        "stream",
        "model",
        "seed",
    ],
    "/tokenize": ["prompt", "messages", "tools", "return_token_strs", "model", "chat_template_kwargs"],
    "/detokenize": ["tokens", "model"],
}


def _bad_values(rng: random.Random) -> list:
    deep = json.loads("[" * 70 + "]" * 70)
    return [
        None,
        True,
        False,
        0,
        -1,
        1,
        2**31,
        2**63,
        2**70,
        -(2**70),
        1e308,
        -1e308,
        0.5,
        1e-40,
        "",
        "x",
        "\ud800",
        "\udfff x",
        "a\x00b",
        "\uffff",
        "\u202e" * 3,
        "9" * 5000,
        "a" * rng.choice([1000, 70_000]),
        [],
        [None],
        [1, "a"],
        [[1, 2], "x"],
        [-1],
        [2**40],
        ["s"] * 200,
        {},
        {"type": "x"},
        {"a": {"b": None}},
        deep,
        {"type": "json_schema", "json_schema": {"schema": _nested_schema(40)}},
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"type": "function", "function": {"name": 5}}],
        [{"role": 7, "content": "x"}],
    ]


def _fuzz_bodies(rng: random.Random, count: int):
    values = _bad_values(rng)
    for _ in range(count):
        path = rng.choice(list(ROUTES))
        body = dict(ROUTES[path])
        fields = _FIELDS[path]
        for field in rng.sample(fields, min(len(fields), rng.choice([1, 1, 2, 3]))):
            body[field] = rng.choice(values)
        raw = json.dumps(body).encode()
        shape = rng.random()
        if shape < 0.05:
            raw = raw[: rng.randrange(len(raw))]  # cut short
        elif shape < 0.08:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))  # not text at all
        elif shape < 0.10:
            raw = raw.replace(b'"', b"\xff", 1)  # invalid UTF-8
        yield path, raw


def test_fuzzed_bad_requests_get_only_2xx_or_4xx(url):
    rng = random.Random(41)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=120) as http:
        for path, raw in _fuzz_bodies(rng, 300):
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert "\n" not in r.json()["error"]["message"]
        assert sum(n for s, n in statuses.items() if s >= 400) > 150, statuses  # mostly refused, as meant
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
