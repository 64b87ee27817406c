"""Bad requests get the right status and a message naming the problem; auth; engine failures."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.server import BackgroundServer, create_app

MODEL = "kimitui-demo"
MAX_MODEL_LEN = 512
BODY_LIMIT = 64 * 1024
KEY = "sk-test-key"


class _Exploding:
    """The real engine, except that generation fails after the request was accepted."""

    def __init__(self, llm):
        self._llm = llm

    def __getattr__(self, name):
        return getattr(self._llm, name)

    async def generate(self, prompt, params=None, request_id=None):
        raise RuntimeError("boom")
        yield  # an async generator, like AsyncLLM.generate

    def start(self, prompt, params=None, request_id=None):  # the eager form streamed requests take
        return self.generate(prompt, params, request_id)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, kv_cache_tokens=2048))
    open_srv = BackgroundServer(port=0).start(create_app(llm, MODEL, max_body_bytes=BODY_LIMIT))
    auth_srv = BackgroundServer(port=0).start(create_app(llm, MODEL, api_key=KEY))
    boom_srv = BackgroundServer(port=0).start(create_app(_Exploding(llm), MODEL))
    yield {"open": open_srv.url, "auth": auth_srv.url, "boom": boom_srv.url}
    for s in (open_srv, auth_srv, boom_srv):
        s.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def url(servers):
    return servers["open"]


def post(url: str, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        url + path, content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=30
    )


def error_of(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_malformed_json_is_400(url):
    r = post(url, "/v1/completions", b'{"prompt": "x",')
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
    r = post(url, "/v1/completions", b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in error_of(r)["message"]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
    ],
)
def test_validation_errors_name_the_field(url, path, body, field):
    r = post(url, path, body)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == field and field in err["message"]


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"top_p": 2.0}, "top_p", "top_p must be in (0, 1]"),
        ({"temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in 0..20"),
        ({"n": 0}, "n", "n must be in 1..128"),
        ({"n": 2, "best_of": 1}, "best_of", "best_of must be in n..128"),
        ({"n": 1, "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be >= 0"),  # 0 is taken: prompt log-probs only, as vLLM
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 100]"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [1, 999999]}, "prompt", "outside the vocabulary"),
        ({"prompt": "\ud800"}, "prompt", "lone surrogate"),
        ({"seed": 2**70}, "seed", "seed must be in"),  # would overflow the batch's int64 tensors
        ({"top_k": 2**70}, "top_k", "top_k must be in"),
    ],
)
def test_bad_parameter_values_are_400(url, body, field, words):
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == field and words in err["message"]


def test_neutral_unsupported_fields_are_accepted(url):
    # vllm bench sends repetition_penalty 1.0 and logprobs null; unknown fields are ignored.
    r = post(
        url,
        "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": 1,
            "repetition_penalty": 1.0,
            "logprobs": None,
            "user": "me",
            "frequency_penalty": 0,
        },
    )
    assert r.status_code == 200


def test_penalties_reach_the_sampler(url):
    body = {"prompt": [5, 6, 5, 6, 5, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    # negative penalties reward repeats: a random-weight model, which rarely repeats, starts to
    r = post(
        url, "/v1/completions", {**body, "repetition_penalty": 0.2, "frequency_penalty": -2.0, "presence_penalty": -2.0}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] != plain


def test_context_overflow_names_both_numbers(url):
    prompt = [5] * 40
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 5000})
    msg = error_of(r)["message"]
    assert r.status_code == 400
    assert msg == "prompt has 40 tokens and max_tokens is 5000: together 5040 exceed max_model_len 512"
    r = post(
        url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}
    )
    assert r.status_code == 400 and "max_completion_tokens is 5000" in error_of(r)["message"]
    r = post(url, "/v1/completions", {"prompt": [5] * MAX_MODEL_LEN})
    assert r.status_code == 400 and "no room" in error_of(r)["message"]


def test_chat_specific_errors(url):
    msgs = [{"role": "user", "content": "x"}]
    r = post(url, "/v1/chat/completions", {"messages": msgs, "top_logprobs": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice, says in (
        ("sometimes", "must be one of auto, none, required"),
        ({"type": "function"}, "named"),
        ({"type": "function", "function": {"name": "g"}}, "'g', which is not in tools"),
    ):
        r = post(url, "/v1/chat/completions", {"messages": msgs, "tool_choice": choice, "tools": tools})
        assert r.status_code == 400 and error_of(r)["param"] == "tool_choice" and says in error_of(r)["message"]
    r = post(url, "/v1/chat/completions", {"messages": msgs, "tool_choice": "required"})
    assert r.status_code == 400 and "needs tools" in error_of(r)["message"]
    r = post(url, "/v1/chat/completions", {"messages": msgs, "response_format": {"type": "yaml"}})
    assert r.status_code == 400 and error_of(r)["param"] == "response_format"
    r = post(url, "/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"thinking": "yes"}})
    assert r.status_code == 400 and "true or false" in error_of(r)["message"]
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and "image_url" in error_of(r)["message"]


def test_unknown_model_is_404(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert "gpt-4" in str(e.value)


def test_body_over_limit_is_413(url):
    r = post(url, "/v1/completions", {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1})
    assert r.status_code == 413 and "limit" in error_of(r)["message"]

    def chunked():  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b"y" * 4096
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunked(), timeout=30)
    assert r.status_code == 413


def test_unknown_route_is_json_404(url):
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)["message"]


def test_auth(servers):
    url = servers["auth"]
    body = {"prompt": "x", "max_tokens": 1}
    assert post(url, "/v1/completions", body).status_code == 401
    assert post(url, "/v1/completions", body, {"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    assert post(url, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    # Without a key configured, any or no header is fine.
    assert post(servers["open"], "/v1/completions", body, {"Authorization": "Bearer whatever"}).status_code == 200


def test_engine_failure_is_a_500_for_that_request_only(servers):
    boom = servers["boom"]
    r = post(boom, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and "boom" in error_of(r)["message"]
    r = post(boom, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert "boom" in json.loads(events[0])["error"]["message"] and events[-1] == "[DONE]"
    # The same engine keeps serving everyone else.
    assert post(servers["open"], "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
