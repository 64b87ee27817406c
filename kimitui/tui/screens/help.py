"""Every key, and what the panels mean."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from kimitui.tui.screens.job import ESC_CONFIRM_S

KEYS = [
    ("Enter", "send the prompt"),
    ("Shift+Enter, Ctrl+J", "newline in the prompt (Ctrl+J works in every terminal)"),
    ("Esc", "stop the reply being generated"),
    ("Ctrl+N", "new chat"),
    ("F3", "chats of this session"),
    ("F2", "settings: temperature, top-p, top-k, max tokens, thinking, system prompt"),
    ("Ctrl+T", "thinking on/off"),
    ("F4", "next theme (the choice is saved)"),
    ("F5", "benchmark screen: presets, sweeps, saved runs (there F6: next tab)"),
    ("F8", "hardware panel: compact rows or history graphs (power with the cap, utilisation, memory, node total)"),
    ("F9", "evaluation screen: KL against float32, long-context recall, saved results"),
    ("  Ctrl+R / Ctrl+X", "(F5, F9) run / cancel the run and stay to see what finished"),
    ("  Esc", f"(F5, F9) back; during a run it warns, a second Esc within {ESC_CONFIRM_S:g} s cancels it"),
    ("Ctrl+P", "command palette: every action, themes"),
    ("F1", "this help"),
    ("Ctrl+Q", "quit"),
]

PANELS = """\
throughput: decode tok/s now and over the last 60 s; prefill tok/s; TTFT (time to first token) and \
TPOT (time per output token after the first) of the last reply; requests; KV cache use.

hardware: per GPU, power against its cap, utilisation, HBM used/total, temperature; host CPU, RAM \
and CPU package power; energy per output token over the last minute. n/a means the source is \
missing: `kimitui info` says why."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        width = max(len(k) for k, _ in KEYS)
        keys = "\n".join(f"{k:<{width}}  {what}" for k, what in KEYS)
        with VerticalScroll(id="help-box"):
            yield Static("kimitui keys", classes="modal-title")
            yield Static(keys, id="help-keys", markup=False)
            yield Static(PANELS, id="help-panels", markup=False)
            yield Static("Esc closes", classes="modal-hint")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "help"
