"""Theme files (TOML) -> plain ``ThemeSpec`` data. No Textual here: themes are data, and
``kimitui.tui.theming`` turns specs into Textual ``Theme`` objects.

A theme file::

    name = "kimitui-dark"
    dark = true
    [colors]            # Textual's theme slots; primary is required, the rest optional
    primary = "#4EA3FF"
    background = "#0E1116"
    [variables]         # optional Textual CSS variables, e.g. "footer-key-foreground"
    "block-cursor-background" = "#4EA3FF"

Built-in themes live next to this file; users add theirs in ``$XDG_CONFIG_HOME/kimitui/themes``.
A user theme with a built-in's name replaces it.
"""

from __future__ import annotations

import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass, field
from pathlib import Path

from kimitui.paths import user_themes_dir

COLOR_SLOTS = (
    "primary",
    "secondary",
    "accent",
    "warning",
    "error",
    "success",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)
_COLOR = re.compile(r"^#(?:[0-9a-fA-F]{3}|[0-9a-fA-F]{6}|[0-9a-fA-F]{8})$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class ThemeError(ValueError):
    """A theme file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class ThemeSpec:
    """One theme as data: Textual's color slots (hex strings) plus extra CSS variables."""

    name: str
    colors: dict[str, str]
    dark: bool = True
    variables: dict[str, str] = field(default_factory=dict)
    source: str = ""  # file it came from, for error messages and `kimitui info`


def builtin_dir() -> Path:
    return Path(__file__).resolve().parent


def user_dir() -> Path:
    """``$XDG_CONFIG_HOME/kimitui/themes`` (XDG default ``~/.config``): kimitui.paths owns the rule."""
    return user_themes_dir()


def parse_theme(text: str, source: str = "<string>") -> ThemeSpec:
    """Validate one theme document; raises ThemeError with a message a user can act on."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ThemeError(f"{source}: not valid TOML: {e}") from None
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ThemeError(f"{source}: 'name' must be lower-case letters, digits, '-' or '_', got {name!r}")
    dark = raw.get("dark", True)
    if not isinstance(dark, bool):
        raise ThemeError(f"{source}: 'dark' must be true or false, got {dark!r}")
    colors = raw.get("colors", {})
    if not isinstance(colors, dict):
        raise ThemeError(f"{source}: [colors] must be a table")
    unknown = sorted(set(colors) - set(COLOR_SLOTS))
    if unknown:
        raise ThemeError(f"{source}: unknown color slot(s) {', '.join(unknown)}; known: {', '.join(COLOR_SLOTS)}")
    if "primary" not in colors:
        raise ThemeError(f"{source}: [colors] needs at least 'primary'")
    for slot, value in colors.items():
        if not isinstance(value, str) or not _COLOR.match(value):
            raise ThemeError(f'{source}: colors.{slot} must be a hex color like "#4EA3FF", got {value!r}')
    variables = raw.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ThemeError(f"{source}: [variables] must map names to strings")
    return ThemeSpec(name=name, colors=dict(colors), dark=dark, variables=dict(variables), source=source)


def load_theme_file(path: str | Path) -> ThemeSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ThemeError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_theme(text, str(path))


def load_themes(user_themes: str | Path | None = None) -> tuple[list[ThemeSpec], list[str]]:
    """Built-in themes, then user themes (which override built-ins of the same name).

    Returns ``(specs, errors)``: a broken user file is reported, never fatal.
    ``user_themes`` defaults to ``user_dir()``; pass a path to read another folder.
    """
    by_name: dict[str, ThemeSpec] = {}
    errors: list[str] = []
    folders = [builtin_dir(), Path(user_themes) if user_themes is not None else user_dir()]
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.toml")):
            try:
                spec = load_theme_file(path)
            except ThemeError as e:
                errors.append(str(e))
                continue
            by_name[spec.name] = spec
    return list(by_name.values()), errors
