"""The OpenAI-compatible server through the official `openai` client, against a real uvicorn."""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest

from kimitui.engine import AsyncLLM, EngineArgs, RequestOutput, SamplingParams
from kimitui.engine.outputs import CompletionOutput
from kimitui.engine.text.chat_format import chat_format_for
from kimitui.server import BackgroundServer, create_app
from kimitui.server import chat as chat_route

MODEL = "kimitui-demo"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, kv_cache_tokens=4096))
    app = create_app(llm, MODEL)
    server = BackgroundServer(port=0).start(app)
    yield llm, app, server
    server.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_text(llm: AsyncLLM, prompt, **params) -> CompletionOutput:
    async def run():
        async for out in llm.generate(prompt, SamplingParams(**params)):
            pass
        return out.outputs[0]

    return asyncio.run(run())


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_matches_engine(served, client):
    llm = served[0]
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    want = engine_text(llm, "Hello there", max_tokens=6, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode("Hello there"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_stream_with_usage(client):
    full = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=7, temperature=0).choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stream me",
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *text_chunks, usage_chunk = chunks
    assert all(len(c.choices) == 1 for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 7


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy picks the top token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_string_plain_and_streamed(client):
    text = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0).choices[0].text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    want = text[: text.find(stop)]
    r = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return (
            client.completions.create(model=MODEL, prompt="Seeded", max_tokens=8, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_several_prompts_one_choice_each(client):
    r = client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 9
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    streamed = client.completions.create(
        model=MODEL, prompt=["one", "two", "three"], max_tokens=3, temperature=0, stream=True
    )
    texts = {0: "", 1: "", 2: ""}
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {c.index: c.text for c in r.choices}


def test_echo_prefixes_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt="Echo this", max_tokens=2, temperature=0, echo=True, logprobs=1)
    assert r.choices[0].text.startswith("Echo this")
    assert r.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no context


def test_max_tokens_defaults_to_remaining_context(client):
    prompt = [7] * (MAX_MODEL_LEN - 5)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert "<|im_end|>" not in msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6


def test_chat_thinking_goes_to_reasoning_content(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "think"}],
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    msg = r.choices[0].message
    # The prompt opens <think>: a reply that never closes it is all reasoning.
    assert msg.model_extra.get("reasoning_content")
    assert not msg.content


def test_chat_stream_with_logprobs_and_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
        )
    )
    *deltas, usage_chunk = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert deltas[-1].choices[0].finish_reason in ("stop", "length")
    n_logprobs = sum(len(c.choices[0].logprobs.content) for c in deltas if c.choices[0].logprobs)
    assert n_logprobs == usage_chunk.usage.completion_tokens
    entry = next(c.choices[0].logprobs.content[0] for c in deltas if c.choices[0].logprobs.content)
    assert len(entry.top_logprobs) == 2 and isinstance(entry.bytes, list)


def _fake_output(text: str, token_ids: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        [1],
        None,
        [CompletionOutput(0, text, token_ids, finish_reason="stop" if finished else None)],
        finished,
    )


TOOL_REPLY = (
    "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_tool_calls_become_openai_tool_calls(served):
    state = served[1].state.server
    chat = chat_route._Chat(
        [1],
        SamplingParams(),
        fmt=chat_format_for(state.tokenizer),
        started_in_thinking=False,
        report_tools=True,
        top_logprobs=None,
    )
    body = chat_route._response(state, "id", chat, _fake_output(TOOL_REPLY + "<|im_end|>", [1, 2], True))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert choice["message"]["tool_calls"] == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    # Streamed in three pieces: the call arrives whole, once, with an index.
    st = chat_route._StreamState(chat)
    pieces = [TOOL_REPLY[:20], TOOL_REPLY[:90], TOOL_REPLY]
    deltas = [
        chat_route._chunk_choice(state, chat, None, st, _fake_output(t, [1] * (i + 1), i == 2).outputs[0], 0)
        for i, t in enumerate(pieces)
    ]
    calls = [c for d in deltas if d for c in d["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_chat_accepts_tools(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=4, tools=tools
    )
    assert r.usage.prompt_tokens > 20  # the tool declaration is part of the prompt


def test_health(served):
    assert httpx.get(served[2].url + "/health").json() == {"status": "ok"}


def test_completion_n_choices_share_one_prompt_and_repeat_with_a_seed(served, client):
    llm = served[0]
    before = llm.engine.stats().computed_prompt_tokens
    prompt = "one prompt, four samples " * 6
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=4, seed=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    p = r.usage.prompt_tokens
    # one pass over the prompt, to the token: the other samples are forked from it
    assert llm.engine.stats().computed_prompt_tokens - before == p
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=4, seed=5, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    streamed = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=4, seed=5, temperature=1.0, stream=True)
    )
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in r.choices}
    assert sum(1 for ch in streamed for c in ch.choices if c.finish_reason == "length") == 4


def test_completion_best_of_and_several_prompts_number_choices(client):
    r = client.completions.create(
        model=MODEL, prompt=["first", "second"], max_tokens=3, n=2, best_of=3, seed=1, temperature=1.0
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12  # the choices returned (best_of sampled more)


def test_chat_n_choices_streamed_with_indices(client):
    msgs = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, n=3, seed=2, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=6, n=3, seed=2, temperature=1.0, stream=True
        )
    )
    content = {}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
    assert content == {c.index: c.message.content or "" for c in r.choices}
