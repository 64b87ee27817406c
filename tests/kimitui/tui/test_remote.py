"""Pilot tests of the TUI attached to a server (`kimitui --base-url`): a scripted server without
/metrics (chat with <think> text, client-measured TTFT/TPOT, the panel saying what is missing),
server errors as one line, a server dying mid-reply and the next message reconnecting, and (slow)
a real `kimitui serve` subprocess on the demo model: chat streams, metrics move, F5 runs."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import pytest

from kimitui.engine import EngineArgs
from kimitui.tui.app import KimiApp
from kimitui.tui.bridges.remote import RemoteBridge
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.messages import ReplyFinished
from kimitui.tui.widgets.chat.prompt import PromptInput
from tests.kimitui.remote_fakes import fake_openai_app, kill, serve
from tests.kimitui.tui_fakes import FakeSampler, screen_text, wait_for

SIZE = (180, 50)


@pytest.fixture(autouse=True)
def homes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


def make_app(url: str, **kw) -> KimiApp:
    gen = kw.pop("generation", GenerationSettings(max_tokens=16, temperature=0.0))
    return KimiApp(
        EngineArgs(),
        sampler=FakeSampler(),
        generation=gen,
        bridge_factory=lambda app: RemoteBridge(app, url, metrics_period_s=0.2, **kw),
    )


async def ready(app, pilot) -> None:
    await wait_for(pilot, lambda: app.screen.id == "main", timeout=30)
    await pilot.pause(0.05)
    app.screen.query_one(PromptInput).cursor_blink = False


async def say(app, pilot, text: str) -> None:
    before = app.bridge.reply
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: app.bridge.reply is not before and app.bridge.reply is not None)


def run(coro):
    return asyncio.run(coro)


def test_chat_without_metrics_splits_thinking_and_says_what_is_missing():
    server = serve(fake_openai_app())
    finished: list[ReplyFinished] = []

    async def scenario():
        app = make_app(server.url + "/v1/")
        hook = lambda m: isinstance(m, ReplyFinished) and finished.append(m)  # noqa: E731
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await ready(app, pilot)
            text = screen_text(app)
            assert "fake-model" in text and "REMOTE" in text and "2,048 tokens" in text
            await say(app, pilot, "hi")
            await wait_for(pilot, lambda: app.bridge.reply.done)
            # the reply streams on its own thread: the screen catches up on the UI loop
            await wait_for(pilot, lambda: "Hello from the fake server." in screen_text(app))
            await pilot.pause(0.6)  # a few stats polls
            text = screen_text(app)
            assert "Hello from the fake server." in text
            # the thinking block is split out of the text (folded or not: the fold follows the pane's timing)
            assert ("▶ thinking" in text or "▼ thinking" in text) and "<think>" not in text
            assert "no /metrics (HTTP 404)" in text and "measured by this client" in text
            assert "requests     n/a running, n/a waiting" in text
            body = app.bridge.request_body(app.chats.current, app.gen_settings)
            assert body["model"] == "fake-model" and body["messages"][-1]["role"] == "assistant"
            kwargs = body["chat_template_kwargs"]
            assert kwargs["thinking"] is app.gen_settings.thinking
            assert kwargs.get("thinking_effort") == (app.gen_settings.thinking_effort if kwargs["thinking"] else None)
            assert "reasoning_content" not in body["messages"][-1]

    try:
        run(scenario())
    finally:
        server.stop()
    msg = finished[0]  # the hook sees the message at each node it bubbles through
    assert msg.error is None and msg.finish_reason == "stop"
    assert (msg.reasoning, msg.content) == ("looking at it", "Hello from the fake server.")
    assert msg.num_tokens == 8 and msg.ttft > 0 and msg.tpot > 0  # measured here, usage from the server
    assert server.running is False


def test_server_error_is_one_line_and_the_app_stays_up():
    server = serve(fake_openai_app())

    async def scenario():
        app = make_app(server.url, generation=GenerationSettings(max_tokens=5000))
        async with app.run_test(size=SIZE) as pilot:
            await ready(app, pilot)
            await say(app, pilot, "hi")
            await wait_for(pilot, lambda: app.bridge.reply.done)
            await pilot.pause(0.1)
            turn = app.chats.current.turns[-1]
            assert "error" in turn.stats and "HTTP 400 Bad Request: max_tokens 5000 > 4096" in turn.stats
            assert "\n" not in turn.stats
            assert app.screen.id == "main" and not app.bridge.generating

    try:
        run(scenario())
    finally:
        server.stop()


def test_server_dying_mid_reply_then_reconnecting():
    fake = fake_openai_app(slow_after=4)
    server = serve(fake)
    port = server.port
    state = {}

    async def scenario():
        app = make_app(server.url)
        async with app.run_test(size=SIZE) as pilot:
            await ready(app, pilot)
            await say(app, pilot, "hi")
            await wait_for(pilot, lambda: fake.state.streaming.is_set() and "Hello" in app.bridge.reply.content)
            await asyncio.to_thread(kill, server)
            await wait_for(pilot, lambda: app.bridge.reply.done, timeout=20)
            await pilot.pause(0.1)
            broken = app.chats.current.turns[-1]
            assert broken.content == "Hello"  # what arrived before the server went away is kept
            assert "closed the connection mid-reply" in broken.stats and "\n" not in broken.stats
            # the server comes back on the same port: the next message simply reaches it
            state["server"] = await asyncio.to_thread(serve, fake_openai_app(), port)
            await say(app, pilot, "again")
            await wait_for(pilot, lambda: app.bridge.reply.done, timeout=20)
            await pilot.pause(0.1)
            assert app.chats.current.turns[-1].content == "Hello from the fake server."
            assert len(app.chats.current.turns) == 4

    try:
        run(scenario())
    finally:
        if "server" in state:
            state["server"].stop()


def test_unreachable_server_and_unknown_model_fail_on_the_connect_screen():
    async def scenario(url, model, expected):
        app = KimiApp(EngineArgs(), sampler=FakeSampler(), bridge_factory=lambda a: RemoteBridge(a, url, model=model))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: "Could not connect to" in screen_text(app), timeout=20)
            assert expected in screen_text(app)

    server = serve(fake_openai_app())
    try:
        run(scenario(server.url, "other", "model 'other' is not served at"))
    finally:
        server.stop()
    run(scenario(server.url, None, "cannot reach the server at"))
    with pytest.raises(ValueError, match="must start with http"):
        RemoteBridge(None, "localhost:8000")


@pytest.mark.slow
def test_tui_against_kimitui_serve_chats_shows_metrics_and_benchmarks(tmp_path_factory):
    """The acceptance path on the demo model: `kimitui serve` in a subprocess, the TUI over it."""
    from kimitui.tui.screens.benchmark import BenchmarkScreen
    from kimitui.tui.widgets.bench.form import BenchForm

    env = {
        **os.environ,
        "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(tmp_path_factory.getbasetemp() / "xdg"),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimitui.cli",
            "serve",
            "--port",
            "0",
            "--max-model-len",
            "512",
            "--kv-cache-tokens",
            "4096",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url, lines, deadline = None, [], time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line):
                url = m.group(1)
        assert url, "".join(lines)
        stats_seen = []

        async def scenario():
            app = make_app(url, generation=GenerationSettings(max_tokens=24, temperature=0.0))
            async with app.run_test(size=SIZE) as pilot:
                await ready(app, pilot)
                assert "kimitui-demo" in screen_text(app) and "(kimitui)" in screen_text(app)
                await say(app, pilot, "hello")
                # metrics move while the reply streams
                await wait_for(pilot, lambda: (app.bridge.stats().decode_tokens_per_s or 0) > 0, timeout=60)
                stats_seen.append(app.bridge.stats())
                await wait_for(pilot, lambda: app.bridge.reply.done, timeout=60)
                await pilot.pause(1.5)
                text = screen_text(app)
                assert "kimitui /metrics" in text and "24 tokens" in text
                turn = app.chats.current.turns[-1]
                print("reply:", turn.stats, "| server:", app.bridge.stats().ttft_p50, app.bridge.stats().tpot_p50)
                assert app.bridge.stats().total_generation_tokens >= 24
                await pilot.press("f5")
                await wait_for(pilot, lambda: isinstance(app.screen, BenchmarkScreen))
                await pilot.pause(0.1)
                screen = app.screen
                screen.query_one(BenchForm).set_values(
                    {
                        "input_len": "16",
                        "output_len": "4",
                        "num_prompts": "2",
                        "max_concurrency": "2",
                        "sweep": "",
                        "num_warmups": "0",
                        "temperature": "0",
                        "label": "",
                    }
                )
                await pilot.press("ctrl+r")
                await wait_for(pilot, lambda: screen.runs_finished > 0, timeout=120)
                await pilot.pause(0.1)
                status = str(screen.query_one("#bench-status").render())
                assert "finished" in status and "2 request(s) completed" in status, status

        run(scenario())
        assert stats_seen[0].flavour == "kimitui"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_agent_telemetry_shows_the_remote_nodes_gpus_with_history():
    """`kimitui agent` on the "GPU node" (fake GPU backends), `--telemetry-url` in the TUI."""
    from kimitui.telemetry import TelemetrySampler
    from kimitui.telemetry.agent import AgentServer
    from kimitui.telemetry.remote import RemoteTelemetry
    from kimitui.tui.widgets.hardware.graphs import HardwareGraphs
    from kimitui.tui.widgets.hardware.panel import HardwarePanel
    from tests.kimitui.telemetry.test_agent import FakeCpu, FakeHost, FakeNodeGpus

    node_sampler = TelemetrySampler(interval_s=0.1, backends=[FakeNodeGpus(700.0), FakeCpu(300.0), FakeHost()])
    node_sampler.start()
    agent = AgentServer(node_sampler.latest, "127.0.0.1", 0, token="t", node="gpu-node").start()
    server = serve(fake_openai_app())
    sampler = TelemetrySampler(interval_s=0.1, backends=[RemoteTelemetry([agent.url], token="t")])

    async def scenario():
        app = KimiApp(EngineArgs(), sampler=sampler, bridge_factory=lambda a: RemoteBridge(a, server.url, num_gpus=2))
        async with app.run_test(size=SIZE) as pilot:
            await ready(app, pilot)
            await wait_for(pilot, lambda: "GPU1 " in screen_text(app) and "701/1400 W" in screen_text(app))
            text = screen_text(app)
            assert "node 1701 W (GPUs 1401 + CPU 300)" in text and "GPUs     2" in text
            panel = app.screen.query_one(HardwarePanel)
            await wait_for(pilot, lambda: len(panel.history.node) >= 5)
            await pilot.press("f8")
            await pilot.pause(0.3)
            assert panel.query_one(HardwareGraphs).display
            assert "power W per GPU" in screen_text(app)

    try:
        run(scenario())
    finally:
        server.stop()
        agent.stop()
        node_sampler.stop()
    assert sampler._closed  # the app stopped the sampler it was given


def test_stop_mid_reply_and_quit_while_streaming():
    fake = fake_openai_app(slow_after=4)
    server = serve(fake)
    timings = {}

    async def scenario():
        app = make_app(server.url)
        async with app.run_test(size=SIZE) as pilot:
            await ready(app, pilot)
            await say(app, pilot, "hi")
            await wait_for(pilot, lambda: fake.state.streaming.is_set() and "Hello" in app.bridge.reply.content)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.bridge.reply.done, timeout=10)
            await pilot.pause(0.1)
            turn = app.chats.current.turns[-1]
            assert turn.content == "Hello" and "stopped" in turn.stats
            fake.state.streaming.clear()
            await say(app, pilot, "again")  # stalls again; quitting must not wait for it
            await wait_for(pilot, lambda: fake.state.streaming.is_set())
            timings["quit"] = time.monotonic()
        timings["left"] = time.monotonic()

    try:
        run(scenario())
    finally:
        server.stop()
    assert timings["left"] - timings["quit"] < 5.0
