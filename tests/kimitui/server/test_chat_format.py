"""/v1/chat/completions over both chat formats: chat_template_kwargs reach the renderer, K3 replies parse.

The engine is a scripted stand-in (the K3 model is not needed to check the chat plumbing): it
records the prompt and the sampling params and replies with fixed XTML text in small pieces.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kimitui.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kimitui.engine.text.chat_format import chat_format_for
from kimitui.engine.text.tokenizer import Tokenizer
from kimitui.server import create_app

REPLY = (
    "Think first.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
    'type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    "<|close|>message<|sep|>"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MSGS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo", "reasoning_content": "old"},
    {"role": "user", "content": "weather?"},
]


class ScriptedLLM:
    def __init__(self, tokenizer, reply: str):
        self.tokenizer, self.reply = tokenizer, reply
        self.config = SimpleNamespace(vocab_size=163840, name="scripted")
        self.engine = SimpleNamespace(max_model_len=4096, model_dir="scripted")
        self.calls = []

    async def generate(self, prompt, params, request_id=None):
        self.calls.append((prompt, params))
        ids = self.tokenizer.encode(self.reply)
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.1, token_times=[0.1, 0.2], finished_time=0.2)
        for n in range(7, len(self.reply) + 7, 7):  # cumulative text, 7 characters more each time
            done = n >= len(self.reply)
            text = self.reply[:n]
            yield RequestOutput(
                "r",
                None,
                prompt,
                None,
                [
                    CompletionOutput(
                        0,
                        text,
                        ids[: max(1, len(ids) * min(n, len(text)) // len(self.reply))],
                        finish_reason="stop" if done else None,
                        stop_reason=163586 if done else None,
                    )
                ],
                done,
                metrics,
            )


@pytest.fixture(scope="module")
def k3_tok():
    from kimitui.engine.demo.k3 import ensure_demo_k3_checkpoint

    return Tokenizer.from_pretrained(ensure_demo_k3_checkpoint())


@pytest.fixture(scope="module")
def k2_tok(tmp_path_factory):
    from kimitui.engine.demo.bpe_train import demo_corpus, train_ranks, write_kimi_tokenizer_files

    d = tmp_path_factory.mktemp("k2tok")
    write_kimi_tokenizer_files(d, train_ranks(demo_corpus()[:200_000], 512))
    return Tokenizer.from_pretrained(d)


def _post(llm, body):
    with TestClient(create_app(llm, "scripted")) as client:
        return client.post("/v1/chat/completions", json=body)


def test_k3_kwargs_render_and_reply_parses(k3_tok):
    llm = ScriptedLLM(k3_tok, REPLY)
    kwargs = {"thinking": True, "thinking_effort": "low", "preserve_thinking": False}
    r = _post(llm, {"messages": MSGS, "tools": TOOLS, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    prompt, params = llm.calls[0]
    want = chat_format_for(k3_tok).encode(
        MSGS, tools=TOOLS, thinking=True, thinking_effort="low", preserve_thinking=False
    )
    assert prompt == want.ids
    text = k3_tok.decode(prompt)
    assert "`thinking_effort=low`" in text and "<|open|>think<|sep|><|close|>think<|sep|>" in text
    assert 163586 in params.stop_token_ids and params.skip_special_tokens
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "Think first." and msg["content"] == "Checking."
    assert msg["tool_calls"] == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_k3_defaults_thinking_on_effort_max_and_stream(k3_tok):
    llm = ScriptedLLM(k3_tok, REPLY)
    r = _post(llm, {"messages": MSGS, "tools": TOOLS, "stream": True})
    assert r.status_code == 200
    text = k3_tok.decode(llm.calls[0][0])
    assert "`thinking_effort=max`" in text and "<|open|>think<|sep|>old<|close|>think<|sep|>" in text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Think first."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [t["function"]["name"] for t in calls] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_k3_thinking_off_and_bad_effort(k3_tok):
    llm = ScriptedLLM(k3_tok, "Plain answer.<|close|>response<|sep|><|close|>message<|sep|>")
    r = _post(llm, {"messages": MSGS[:1], "chat_template_kwargs": {"thinking": False}})
    assert r.json()["choices"][0]["message"]["content"] == "Plain answer."
    assert k3_tok.decode(llm.calls[0][0]).endswith("<|open|>response<|sep|>")
    r = _post(llm, {"messages": MSGS, "chat_template_kwargs": {"thinking_effort": "huge"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.thinking_effort"
    r = _post(llm, {"messages": MSGS, "chat_template_kwargs": {"preserve_thinking": "no"}})
    assert r.status_code == 400 and "true or false" in r.json()["error"]["message"]


def test_k2_ignores_effort(k2_tok):
    llm = ScriptedLLM(k2_tok, "r</think>answer")
    r = _post(llm, {"messages": MSGS, "chat_template_kwargs": {"thinking": True, "thinking_effort": "low"}})
    assert r.status_code == 200, r.text
    r2 = _post(llm, {"messages": MSGS, "chat_template_kwargs": {"thinking": True}})
    assert llm.calls[0][0] == llm.calls[1][0]
    assert r.json()["choices"][0]["message"] == r2.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["message"]["reasoning_content"] == "r"


NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


def test_k3_tool_choice_and_response_format_are_rendered(k3_tok):
    """required and a named function are accepted (vllm renderers/kimi_k3.py passes them to
    encoding_k3); none keeps the tools declared; response_format and reasoning_effort reach the prompt."""
    fmt = chat_format_for(k3_tok)
    cases = [
        ({"tool_choice": "required"}, {"tool_choice": "required"}),
        ({"tool_choice": NAMED}, {"tool_choice": NAMED}),
        ({"tool_choice": "none"}, {"tool_choice": "none"}),
        (
            {"response_format": SCHEMA_FORMAT, "reasoning_effort": "minimal"},
            {"response_format": SCHEMA_FORMAT, "reasoning_effort": "minimal"},
        ),
    ]
    for body, options in cases:
        llm = ScriptedLLM(k3_tok, REPLY)
        r = _post(llm, {"messages": MSGS, "tools": TOOLS, **body})
        assert r.status_code == 200, r.text
        assert llm.calls[0][0] == fmt.encode(MSGS, tools=TOOLS, **options).ids
        text = k3_tok.decode(llm.calls[0][0])
        assert 'type="tool-declare"' in text  # tools stay declared, "none" included
        calls = r.json()["choices"][0]["message"].get("tool_calls")
        assert bool(calls) == (body.get("tool_choice") != "none")
    text = k3_tok.decode(fmt.encode(MSGS, tools=TOOLS, tool_choice="none").ids)
    assert "You MUST NOT call any tools in the next message." in text
    text = k3_tok.decode(fmt.encode(MSGS, response_format=SCHEMA_FORMAT, reasoning_effort="minimal").ids)
    assert "`response_format=json_schema`" in text and "`thinking_effort=low`" in text


def test_k3_reasoning_effort_errors_name_the_field(k3_tok):
    llm = ScriptedLLM(k3_tok, REPLY)
    r = _post(llm, {"messages": MSGS, "reasoning_effort": "medium"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "reasoning_effort" and "none, minimal, low, high, xhigh, max" in err["message"]
    r = _post(llm, {"messages": MSGS, "chat_template_kwargs": {"thinking_effort": "medium"}})
    assert r.status_code == 400 and "low, high, max" in r.json()["error"]["message"]
    r = _post(llm, {"messages": MSGS, "reasoning_effort": "none"})
    assert r.status_code == 200 and k3_tok.decode(llm.calls[-1][0]).endswith("<|open|>response<|sep|>")
    assert "thinking_effort" not in k3_tok.decode(llm.calls[-1][0])


def test_k2_tool_choice_none_drops_tools_and_options_pass(k2_tok):
    """K2's chat template has none of these options: the prompt is what it was, the request is accepted."""
    llm = ScriptedLLM(k2_tok, "answer")
    base = {"messages": MSGS, "tools": TOOLS}
    for body in (
        {"tool_choice": "none"},
        {"tool_choice": "required"},
        {"tool_choice": NAMED},
        {"response_format": SCHEMA_FORMAT, "reasoning_effort": "medium"},
    ):
        assert _post(llm, {**base, **body}).status_code == 200
    none, required, named, formatted = (c[0] for c in llm.calls)
    fmt = chat_format_for(k2_tok)
    assert none == fmt.encode(MSGS).ids and required == named == formatted == fmt.encode(MSGS, tools=TOOLS).ids
