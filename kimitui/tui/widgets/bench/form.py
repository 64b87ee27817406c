"""The benchmark form: a preset picker, one input per BenchmarkConfig flag that matters, the
note saying what a preset lost to the model's context, and Run / Cancel."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Checkbox, Input, Label, Select, Static

from kimitui.tui.benchmark.setup import PRESETS, preset, preset_form

# (field, label, Textual input type, placeholder): the type restricts what can be typed.
FIELDS = [
    ("input_len", "input len (tokens)", "integer", ""),
    ("output_len", "output len (tokens)", "integer", ""),
    ("range_ratio", "range ratio [0, 1)", "number", "0"),
    ("num_prompts", "num prompts", "integer", ""),
    ("max_concurrency", "max concurrency", "integer", "no cap"),
    ("request_rate", "request rate (req/s)", "text", "inf"),
    ("temperature", "temperature", "number", "engine default"),
    ("seed", "seed", "integer", "0"),
    ("num_warmups", "warm-up requests", "integer", "0"),
    ("sweep", "sweep concurrency", "text", "e.g. 1,2,4,8"),
    ("pricing_tiers", "pricing $/GPU/h", "text", "name=usd, ..."),
    ("usd_per_kwh", "$ per kWh", "number", "n/a: no electricity cost"),
    ("label", "label", "text", "optional, names the saved run"),
]


class BenchForm(Vertical):
    DEFAULT_CSS = """
    BenchForm { height: auto; }
    BenchForm .bench-field { height: 1; margin-bottom: 1; }
    BenchForm .bench-field Label { width: 22; }
    BenchForm .bench-field Input { width: 1fr; }
    BenchForm #bench-preset { margin-bottom: 1; }
    BenchForm #bench-clip-note { color: $warning; height: auto; }
    BenchForm #bench-form-error { color: $error; height: auto; }
    BenchForm #bench-buttons { height: 1; margin-top: 1; }
    BenchForm #bench-buttons Button { margin-right: 2; }
    """

    def __init__(self, form: dict[str, str], max_model_len: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.initial = form
        self.max_model_len = max_model_len

    def compose(self) -> ComposeResult:
        yield Select(
            [(p.title, p.key) for p in PRESETS],
            prompt="preset…",
            id="bench-preset",
            compact=True,
            value=self.initial.get("preset", Select.NULL),
            allow_blank=True,
        )
        yield Static("", id="bench-clip-note", markup=False)
        for name, label, kind, placeholder in FIELDS:
            with Horizontal(classes="bench-field"):
                yield Label(label)
                yield Input(
                    self.initial.get(name, ""), type=kind, placeholder=placeholder, id=f"bench-{name}", compact=True
                )
        yield Checkbox(
            "ignore EOS (exact output lengths, as vLLM)",
            self.initial.get("ignore_eos", "true") == "true",
            id="bench-ignore_eos",
            compact=True,
        )
        yield Static("", id="bench-form-error", markup=False)
        with Horizontal(id="bench-buttons"):
            yield Button("Run  ^R", variant="primary", id="bench-run", compact=True)
            yield Button("Cancel  ^X", variant="error", id="bench-cancel", disabled=True, compact=True)

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "bench-preset" and event.value is not Select.NULL:
            self.apply_preset(str(event.value))

    def apply_preset(self, key: str) -> str | None:
        """Fill the fields from a preset clipped to the context; returns (and shows) the clip note."""
        values, note = preset_form(preset(key), self.max_model_len)
        for name, value in values.items():
            self.query_one(f"#bench-{name}", Input).value = value
        self.query_one("#bench-clip-note", Static).update(note or "")
        self.show_error(None)
        return note

    def values(self) -> dict[str, str]:
        form = {name: self.query_one(f"#bench-{name}", Input).value for name, *_ in FIELDS}
        form["ignore_eos"] = "true" if self.query_one("#bench-ignore_eos", Checkbox).value else "false"
        return form

    def set_values(self, form: dict[str, str]) -> None:
        for name, *_ in FIELDS:
            if name in form:
                self.query_one(f"#bench-{name}", Input).value = form[name]

    def show_error(self, error: str | None) -> None:
        self.query_one("#bench-form-error", Static).update(error or "")

    def set_running(self, running: bool) -> None:
        self.query_one("#bench-run", Button).disabled = running
        self.query_one("#bench-cancel", Button).disabled = not running
