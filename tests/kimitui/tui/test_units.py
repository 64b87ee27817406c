"""Pieces of the TUI that need no screen: themes, the settings writer, formatting, chat history,
energy per token, model info, the `info` command."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import tomllib

from kimitui.themes import ThemeError, load_themes, parse_theme
from kimitui.tui.chat.model_info import _experts
from kimitui.tui.chat.session import ChatHistory, Turn
from kimitui.tui.chat.token_energy import TokenEnergyMeter
from kimitui.tui.formatting import NA, bar, clean, count, num, used_total
from kimitui.tui.user_settings import read_settings, set_value, write_value
from tests.kimitui.tui_fakes import sample


def test_builtin_themes_load_and_user_themes_override(tmp_path):
    specs, errors = load_themes(tmp_path)
    names = {s.name for s in specs}
    assert {"kimitui-dark", "kimitui-light", "instinct-red"} <= names and not errors
    (tmp_path / "mine.toml").write_text('name = "instinct-red"\n[colors]\nprimary = "#00FF00"\n')
    (tmp_path / "bad.toml").write_text('name = "bad"\n[colors]\nprimary = "red"\n')
    specs, errors = load_themes(tmp_path)
    red = next(s for s in specs if s.name == "instinct-red")
    assert red.colors == {"primary": "#00FF00"}
    assert len(errors) == 1 and "bad.toml" in errors[0] and "hex color" in errors[0]


@pytest.mark.parametrize(
    "text, message",
    [
        ('name = "x"\n', "needs at least 'primary'"),
        ('name = "X Y"\n[colors]\nprimary = "#fff"\n', "'name'"),
        ('name = "x"\n[colors]\nprimary = "#fff"\nprimry = "#fff"\n', "unknown color slot"),
        ('name = "x"\ndark = "yes"\n[colors]\nprimary = "#fff"\n', "'dark'"),
        ("name = ", "not valid TOML"),
    ],
)
def test_theme_errors_name_the_problem(text, message):
    with pytest.raises(ThemeError, match=message):
        parse_theme(text, "t.toml")


def test_themes_package_does_not_import_textual():
    code = "import sys; from kimitui import themes; themes.load_themes(); assert not [m for m in sys.modules if m.startswith('textual')]"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_settings_writer_preserves_other_sections(tmp_path):
    text = '# costs\n[cost]\nusd_per_kwh = 0.2  # ours\n\n[tui]\nother = 1\ntheme = "a"\n[[x]]\nk = 1\n'
    out = set_value(text, "tui", "theme", "instinct-red")
    assert out.replace('theme = "instinct-red"', 'theme = "a"') == text
    assert tomllib.loads(out)["tui"] == {"other": 1, "theme": "instinct-red"}
    assert tomllib.loads(set_value("[cost]\na = 1", "tui", "theme", 'q"uote')) == {
        "cost": {"a": 1},
        "tui": {"theme": 'q"uote'},
    }
    path = tmp_path / "kimitui" / "settings.toml"
    write_value("tui", "theme", "kimitui-light", path)
    assert read_settings(path) == {"tui": {"theme": "kimitui-light"}}
    path.write_text("[cost\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        write_value("tui", "theme", "x", path)
    assert path.read_text() == "[cost\n" and read_settings(path) == {}


def test_formatting_never_invents_numbers():
    assert num(None) == NA and used_total(None, None) == NA and count(None) == NA
    assert count(13_184_096) == "13.2M" and count(1_030_000_000_000) == "1.03T"
    assert bar(None, 4) == "····" and bar(0.5, 4) == "██░░" and bar(2.0, 2) == "██"
    assert clean("a\x7fb\x1b[31mc\n\td") == "ab[31mc\n\td"


def test_chat_history_reuses_an_empty_chat():
    history = ChatHistory()
    first = history.current
    assert history.new() is first
    first.turns += [Turn("user", "hello   world"), Turn("assistant", "hi", reasoning="hmm")]
    second = history.new()
    assert second is not first and len(history.chats) == 2 and first.title == "hello world"
    assert first.messages("be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello   world"},
        {"role": "assistant", "content": "hi", "reasoning_content": "hmm"},
    ]
    assert history.select(first.id) is first


def test_energy_per_token_over_the_last_minute():
    meter = TokenEnergyMeter()
    samples = [sample(1000.0, 5000.0), sample(1060.0, 65000.0)]
    assert meter.joules_per_token(samples, 1060.0) is None  # no token counts yet
    meter.record(1000.0, 100)
    meter.record(1060.0, 6100)
    assert meter.tokens_between(1000.0, 1060.0) == 6000
    assert meter.joules_per_token(samples, 1060.0) == pytest.approx(4 * 60000 / 6000)
    meter.record(1061.0, 6100)
    no_power = [s.__class__(t=s.t, wall=s.wall) for s in samples]
    assert meter.joules_per_token(no_power, 1060.0) is None


def test_expert_placement_text():
    assert _experts(None, "cuda:0") == "all on cuda:0"
    assert _experts(SimpleNamespace(expert_device=((), (0, 1, -1, -1))), "cuda:0") == "2 on GPU, 2 in host RAM (CPU)"
    assert _experts(SimpleNamespace(expert_device=((0, 1),)), "cuda:0") == "all on GPU (2 devices)"
    assert _experts([[], [0, 0, -1, -1, -1]], "cpu") == "2 on cpu, 3 in host RAM (CPU)"


def test_info_command_prints_every_section_without_textual():
    code = (
        "import sys; from kimitui.cli import main; rc = main(['info']); "
        "assert not [m for m in sys.modules if m.startswith('textual')]; sys.exit(rc)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for section in ("devices", "telemetry backends", "versions", "demo checkpoint", "psutil", "textual"):
        assert section in res.stdout


@pytest.mark.parametrize("command", ["serve", "bench", "plan", "info"])
def test_subcommand_help_describes_it_in_a_whole_sentence(command, capsys):
    # Each description is its module docstring's first line; `info`'s used to stop at "versions,".
    from kimitui.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1].replace("\n", " ").strip()
    assert description.startswith(f"`kimitui {command}`") and description.endswith("."), description


def test_enter_right_behind_fast_typing_sends_all_of_it():
    """Enter is a priority binding, seen before the keys queued ahead of it reach the text area:
    a burst (fast typing, a tmux send-keys, a paste without bracketed paste) used to send "H"."""
    import asyncio

    from textual import events
    from textual.app import App, ComposeResult

    from kimitui.tui.widgets.chat.prompt import PromptInput

    sent: list[str] = []

    class Box(App):
        def compose(self) -> ComposeResult:
            yield PromptInput()

        def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
            sent.append(message.text)

    async def scenario():
        app = Box()
        async with app.run_test() as pilot:
            box = app.query_one(PromptInput)
            box.focus()
            await pilot.pause()
            for ch in "Hello there":  # queued on the widget, none handled yet
                box.post_message(events.Key(ch if ch != " " else "space", ch))
            box.action_submit()  # what the binding runs when Enter arrives in the same burst
            await pilot.pause(0.2)

    asyncio.run(scenario())
    assert sent == ["Hello there"]
