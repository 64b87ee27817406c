"""The thinking-effort setting: validated, chosen in the settings modal, rendered for K3, kept from K2."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from textual.app import App
from textual.widgets import Select, Switch

from kimitui.engine.text.chat_format import chat_format_for
from kimitui.engine.text.tokenizer import Tokenizer
from kimitui.tui.bridges.local import EngineBridge
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.chat.session import Chat, Turn
from kimitui.tui.screens.settings import SettingsScreen


def test_generation_settings_effort():
    assert GenerationSettings().thinking_effort == "max"
    assert GenerationSettings(thinking_effort="low").thinking_effort == "low"
    with pytest.raises(ValueError, match="thinking effort must be one of low, high, max"):
        GenerationSettings(thinking_effort="turbo")


class _Host(App):
    def __init__(self, screen: SettingsScreen):
        super().__init__()
        self.modal = screen
        self.result = "unset"

    def on_mount(self) -> None:
        self.push_screen(self.modal, lambda r: setattr(self, "result", r))


@pytest.mark.parametrize("supported", [True, False])
def test_settings_modal_effort_selector(supported):
    async def scenario():
        app = _Host(SettingsScreen(GenerationSettings(thinking_effort="high"), effort_supported=supported))
        async with app.run_test(size=(120, 50)) as pilot:
            await pilot.pause(0.1)
            select = app.screen.query_one("#set-effort", Select)
            assert select.value == "high" and select.disabled is not supported
            # beside the thinking switch, on the same row
            assert select.parent is app.screen.query_one("#set-thinking", Switch).parent
            if supported:
                select.value = "low"
            await pilot.press("ctrl+s")
            await pilot.pause(0.1)
        return app.result

    result = asyncio.run(scenario())
    assert result.thinking_effort == ("low" if supported else "high")


@pytest.fixture(scope="module")
def k3_tok():
    from kimitui.engine.demo.k3 import ensure_demo_k3_checkpoint

    return Tokenizer.from_pretrained(ensure_demo_k3_checkpoint())


def _bridge(tok):
    bridge = EngineBridge(app=None, engine_args=None)
    bridge.llm = SimpleNamespace(tokenizer=tok)
    bridge.chat_format = chat_format_for(tok)
    return bridge


def test_bridge_renders_k3_effort_and_history(k3_tok):
    bridge = _bridge(k3_tok)
    assert bridge.effort_supported
    chat = Chat(turns=[Turn("user", "hi"), Turn("assistant", "hello", reasoning="greet"), Turn("user", "more")])
    prompt = bridge.prompt_for(chat, GenerationSettings(thinking_effort="high"))
    text = k3_tok.decode(prompt.ids)
    assert "`thinking_effort=high`" in text and "<|open|>think<|sep|>greet<|close|>think<|sep|>" in text
    assert prompt.started_in_thinking and text.endswith("<|open|>think<|sep|>")
    off = bridge.prompt_for(chat, GenerationSettings(thinking=False, thinking_effort="high"))
    assert not off.started_in_thinking and "thinking_effort" not in k3_tok.decode(off.ids)


def test_bridge_k2_ignores_effort(tmp_path):
    from kimitui.engine.demo.bpe_train import demo_corpus, train_ranks, write_kimi_tokenizer_files

    write_kimi_tokenizer_files(tmp_path, train_ranks(demo_corpus()[:200_000], 512))
    bridge = _bridge(Tokenizer.from_pretrained(tmp_path))
    assert not bridge.effort_supported
    chat = Chat(turns=[Turn("user", "hi")])
    low = bridge.prompt_for(chat, GenerationSettings(thinking_effort="low"))
    assert low == bridge.prompt_for(chat, GenerationSettings()) and low.note is None


@pytest.mark.parametrize("supported", [True, False])
def test_status_line_names_the_effort_for_k3(supported):
    from textual.widgets import Static

    from kimitui.tui.chat.session import ChatHistory
    from kimitui.tui.widgets.chat.pane import ChatPane

    bridge = SimpleNamespace(effort_supported=supported, generating=False, llm=None, reply=None)

    class Host(App):
        def compose(self):
            yield ChatPane(bridge, ChatHistory(), lambda: GenerationSettings(thinking_effort="high"))

    async def scenario():
        app = Host()
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.pause(0.1)
            return str(app.query_one("#chat-status", Static).render())

    status = asyncio.run(scenario())
    assert ("thinking on (effort high) ·" in status) is supported and "thinking on" in status
