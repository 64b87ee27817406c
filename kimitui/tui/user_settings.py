"""The user's settings file, ``$XDG_CONFIG_HOME/kimitui/settings.toml``.

Other parts of kimitui own other sections (``[cost]`` belongs to the benchmark code), so the
writer edits one ``key = value`` line inside one table and leaves every other byte alone,
comments included, instead of re-serialising the whole document.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from kimitui.paths import settings_file

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"]+)\s*\]\s*(#.*)?$")


def read_settings(path: Path | None = None) -> dict:
    """The whole document; an absent or unreadable file is an empty one (the UI must start)."""
    path = path or settings_file()
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def set_value(text: str, table: str, key: str, value: str | int | float | bool) -> str:
    """``text`` with ``[table] key = value`` set; every other line is kept as it was."""
    rendered = f"{key} = {_toml_value(value)}"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _table_name(line) == table), None)
    if start is None:
        sep = [""] if lines and lines[-1].strip() else []
        return "\n".join(lines + sep + [f"[{table}]", rendered]) + "\n"
    end = next((i for i in range(start + 1, len(lines)) if _table_name(lines[i]) is not None), len(lines))
    key_re = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start + 1, end):
        if key_re.match(lines[i]):
            lines[i] = rendered
            break
    else:
        lines.insert(start + 1, rendered)
    return "\n".join(lines) + "\n"


def write_value(table: str, key: str, value: str | int | float | bool, path: Path | None = None) -> None:
    """Set one value in the settings file, atomically. Refuses to touch a file it cannot parse
    (rewriting it could lose what the user wrote); raises ValueError then."""
    path = path or settings_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML, not changing it: {e}") from None
    new = set_value(text, table, key, value)
    tomllib.loads(new)  # the writer must never produce a file we cannot read back
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".settings-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _table_name(line: str) -> str | None:
    if line.lstrip().startswith("[["):
        return "[[array]]"  # an array-of-tables header still ends the previous table
    m = _HEADER.match(line)
    return m.group(1).replace('"', "") if m else None


def _toml_value(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string
