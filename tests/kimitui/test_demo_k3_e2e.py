"""The built-in K3 demo (``--model demo-k3``) end to end, as a user meets it: the TUI through the
pilot, ``kimitui serve``'s app through the official ``openai`` client, and ``kimitui bench``.

The demo is a real-layout Kimi K3 checkpoint (KDA + NoPE gated MLA, latent MoE with MXFP4 experts,
XTML chat format, specials at ids 163584+) with random weights, so these tests check that every
path runs and reports honestly, never what the text says. A few tokens each keep them quick.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from kimitui.cli import main
from kimitui.engine import AsyncLLM, EngineArgs, SamplingParams
from kimitui.engine.text.chat_format import chat_format_for
from kimitui.server import BackgroundServer, create_app
from kimitui.tui.app import KimiApp
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.widgets.chat.message import AssistantMessage
from kimitui.tui.widgets.chat.prompt import PromptInput
from tests.kimitui.tui_fakes import SharedLLM, screen_text, wait_for

ARGS = EngineArgs(model="demo-k3", max_model_len=1024, kv_cache_tokens=4096, device="cpu", max_num_seqs=4)
SERVED = "kimitui-demo-k3"
END_OF_MSG = 163586  # K3's <|end_of_msg|>: the stop token of its XTML chat format
VOCAB = 163840


@pytest.fixture(scope="module")
def llm():
    # conftest points XDG_CACHE_HOME at a per-session temp dir: the checkpoint is written once here.
    engine = AsyncLLM(engine_args=ARGS)
    yield engine
    engine.shutdown()


def _chat(llm: AsyncLLM, messages: list[dict], **params):
    fmt = chat_format_for(llm.tokenizer)
    params = SamplingParams(stop_token_ids=fmt.stop_token_ids(), **params)

    async def run():
        async for out in llm.generate(fmt.encode(messages).ids, params):
            pass
        return out.outputs[0]

    return asyncio.run(run())


def test_engine_is_k3_and_says_it_is_noise(llm):
    assert llm.config.is_demo
    assert chat_format_for(llm.tokenizer).stop_token_ids()[0] == END_OF_MSG
    out = _chat(llm, [{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.0, seed=3)
    assert len(out.token_ids) <= 6 and all(0 <= t < VOCAB for t in out.token_ids)


def test_tui_reply_streams_into_a_thinking_block(llm, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))

    async def scenario():
        app = KimiApp(
            ARGS,
            engine_factory=lambda args, progress: SharedLLM(llm),
            generation=GenerationSettings(max_tokens=8, temperature=0.0),
        )
        async with app.run_test(size=(180, 50)) as pilot:
            await wait_for(pilot, lambda: app.screen.id == "main")
            await pilot.pause(0.05)
            app.screen.query_one(PromptInput).cursor_blink = False
            text = screen_text(app)
            assert "random weights: output is noise" in text
            assert "effort max" in text  # K3's XTML takes a thinking effort; the status line names it
            await pilot.press(*"hi there", "enter")
            await wait_for(pilot, lambda: app.bridge.reply is not None)
            await wait_for(pilot, lambda: app.bridge.reply.done, timeout=120)
            await pilot.pause(0.1)
            turns = app.chats.current.turns
            assert [t.role for t in turns] == ["user", "assistant"]
            # The prompt ends inside <|open|>think<|sep|>: a random reply is reasoning, shown in the block.
            assert turns[1].reasoning
            block = app.screen.query_one(AssistantMessage).query_one(".thinking")
            assert block.display
            screen = screen_text(app)
            assert "thinking" in screen and " ms" in screen and "tok/s" in screen
            assert "<|open|>" not in screen and "<|end_of_msg|>" not in screen

    asyncio.run(scenario())


def test_server_with_openai_client(llm):
    server = BackgroundServer(port=0).start(create_app(llm, SERVED))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [SERVED]
        r = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        msg = r.choices[0].message
        # K3 thinks by default: an unclosed think section is reasoning_content, never raw XTML.
        assert msg.model_extra.get("reasoning_content") or msg.content
        assert "<|open|>" not in (msg.content or "") + (msg.model_extra.get("reasoning_content") or "")
        assert 1 <= r.usage.completion_tokens <= 6 and r.choices[0].finish_reason in ("stop", "length")
        off = client.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        assert not off.choices[0].message.model_extra.get("reasoning_content")
        chunks = list(
            client.chat.completions.create(
                model=SERVED,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        *deltas, usage = chunks
        assert deltas[0].choices[0].delta.role == "assistant"
        assert 1 <= usage.usage.completion_tokens <= 4
        done = client.completions.create(
            model=SERVED, prompt="Hello", max_tokens=3, temperature=0, seed=1, extra_body={"ignore_eos": True}
        )
        assert done.usage.completion_tokens == 3
    finally:
        server.stop()


@pytest.fixture
def end_of_msg_first(llm):
    """Random weights almost never pick <|end_of_msg|>: lift its logit so the very first token is it."""

    def lift(module, inputs, logits):  # logits: [N, V] fp32
        logits[:, END_OF_MSG] += 1e4
        return logits

    handle = llm.engine.model.lm_head.register_forward_hook(lift)
    yield
    handle.remove()


def test_reply_ends_at_end_of_msg(llm, end_of_msg_first):
    out = _chat(llm, [{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    assert out.finish_reason == "stop" and out.token_ids[-1:] == [END_OF_MSG] and len(out.token_ids) == 1
    server = BackgroundServer(port=0).start(create_app(llm, SERVED))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
        assert not r.choices[0].message.content  # the stop token itself is never shown
    finally:
        server.stop()


def test_bench_in_process(llm, tmp_path, capsys):
    # `llm` is requested only so the checkpoint is written once; bench loads its own engine.
    rc = main(
        [
            "bench",
            "--model",
            "demo-k3",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--num-prompts",
            "2",
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--max-model-len",
            "256",
            "--kv-cache-tokens",
            "1024",
            "--save-result",
            "--result-dir",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Successful requests:                     2" in out
    (saved,) = tmp_path.glob("*.json")
    result = json.loads(saved.read_text())
    for key in (
        "model_id",
        "completed",
        "total_output_tokens",
        "mean_ttft_ms",
        "mean_tpot_ms",
        "output_throughput",
        "tput_per_gpu",
        "telemetry_backends",
    ):
        assert key in result, key
    assert result["model_id"] == "demo-k3" and result["completed"] == 2 and result["total_output_tokens"] == 8
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
