"""Theme specs (plain data from ``themes``) -> Textual themes; which theme to start with; persistence."""

from __future__ import annotations

import logging
from pathlib import Path

from textual.app import App
from textual.theme import Theme

from kimitui.themes import ThemeSpec, load_themes
from kimitui.tui.user_settings import read_settings, write_value

log = logging.getLogger(__name__)

DEFAULT_THEME = "kimitui-dark"


def to_textual(spec: ThemeSpec) -> Theme:
    return Theme(name=spec.name, dark=spec.dark, variables=dict(spec.variables), **spec.colors)


def register_themes(app: App, user_themes: Path | None = None) -> list[str]:
    """Register built-in and user themes on ``app``; returns problems worth a notification."""
    specs, errors = load_themes(user_themes)
    for spec in specs:
        try:
            app.register_theme(to_textual(spec))
        except Exception as e:  # a color Textual rejects: skip that theme, keep the app
            errors.append(f"{spec.source}: {e}")
    for e in errors:
        log.warning("theme not loaded: %s", e)
    return errors


def initial_theme(app: App, requested: str | None, settings_file: Path | None = None) -> tuple[str, str | None]:
    """(theme to use, warning or None): ``--theme`` beats the saved choice beats the default."""
    saved = read_settings(settings_file).get("tui", {}).get("theme")
    available = set(app.available_themes)
    if requested:
        if requested in available:
            return requested, None
        return (
            saved if saved in available else DEFAULT_THEME,
            f"unknown theme {requested!r}; available: {', '.join(sorted(available))}",
        )
    if isinstance(saved, str) and saved in available:
        return saved, None
    return DEFAULT_THEME, None


def save_theme(name: str, settings_file: Path | None = None) -> str | None:
    """Persist the choice under ``[tui] theme``; returns an error message instead of raising."""
    try:
        write_value("tui", "theme", name, settings_file)
    except (OSError, ValueError) as e:
        log.warning("could not save the theme choice: %s", e)
        return str(e)
    return None
