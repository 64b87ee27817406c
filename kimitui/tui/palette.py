"""Command palette (Ctrl+P): every action of the app, and one entry per theme."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, help, action on the screen the palette was opened from, or on the app with "app.")
ACTIONS = [
    ("New chat", "start an empty chat (Ctrl+N)", "new_chat"),
    ("Stop generation", "stop the reply being generated (Esc)", "stop"),
    ("Chats", "switch to another chat of this session (F3)", "chats"),
    ("Settings", "temperature, top-p, top-k, max tokens, thinking, system prompt (F2)", "settings"),
    ("Toggle thinking", "thinking block on/off for the next reply (Ctrl+T)", "toggle_thinking"),
    ("Benchmark", "open the benchmark screen (F5)", "benchmark"),
    ("Evaluation", "KL against float32 and long-context recall (F9)", "evaluation"),
    ("Next theme", "cycle through themes; the choice is saved (F4)", "app.next_theme"),
    ("Help", "keys and what the panels mean (F1)", "app.help"),
    ("Quit", "leave kimitui (Ctrl+Q)", "app.quit"),
]


class KimiCommands(Provider):
    def _commands(self):
        screen = self.screen
        for title, help_text, action in ACTIONS:
            if action.startswith("app."):
                yield title, help_text, partial(self.app.run_action, action)
            elif hasattr(screen, f"action_{action}") and screen.check_action(action, ()) is not False:
                yield title, help_text, partial(screen.run_action, action)
        for name in sorted(self.app.available_themes):
            yield (
                f"Theme: {name}",
                "switch theme (saved in settings.toml)",
                partial(self.app.run_action, f"set_theme({name!r})"),
            )

    async def discover(self) -> Hits:
        for title, help_text, callback in self._commands():
            if not title.startswith("Theme:"):
                yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)
