"""Where kimitui keeps the user's files: every XDG base directory in one module (as posting's
``locations.py``, darrenburns/posting).

- config (``$XDG_CONFIG_HOME``, default ``~/.config``): ``kimitui/settings.toml``, ``kimitui/themes/``;
- data (``$XDG_DATA_HOME``, default ``~/.local/share``): saved benchmark runs ``kimitui/bench/`` and
  evaluation results ``kimitui/eval/``;
- state (``$XDG_STATE_HOME``, default ``~/.local/state``): the TUI's log ``kimitui/tui.log``.

The engine's own cache (demo checkpoints, tokenizer files) is the engine's business and lives in its
own paths module. Each function reads the environment when called, so a test (or a user) that sets
``XDG_*_HOME`` is followed at once. As the XDG Base Directory Specification says, a relative value is
invalid and ignored. No Textual here: the CLI, the benchmark code and the TUI all use it.
"""

from __future__ import annotations

import os
from pathlib import Path

APP = "kimitui"


def _base(variable: str, *default: str) -> Path:
    value = os.environ.get(variable, "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path(os.path.expanduser("~"), *default)


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/kimitui`` (default ``~/.config/kimitui``)."""
    return _base("XDG_CONFIG_HOME", ".config") / APP


def data_dir() -> Path:
    """``$XDG_DATA_HOME/kimitui`` (default ``~/.local/share/kimitui``)."""
    return _base("XDG_DATA_HOME", ".local", "share") / APP


def state_dir() -> Path:
    """``$XDG_STATE_HOME/kimitui`` (default ``~/.local/state/kimitui``)."""
    return _base("XDG_STATE_HOME", ".local", "state") / APP


def settings_file() -> Path:
    """The user's settings, ``<config>/settings.toml`` (the TUI's choices, ``[cost]`` for benchmarks)."""
    return config_dir() / "settings.toml"


def user_themes_dir() -> Path:
    """The user's themes, ``<config>/themes``."""
    return config_dir() / "themes"


def bench_runs_dir() -> Path:
    """Saved benchmark runs (vLLM-compatible result JSON), ``<data>/bench``."""
    return data_dir() / "bench"


def eval_results_dir() -> Path:
    """Saved evaluation results, ``<data>/eval``."""
    return data_dir() / "eval"


def tui_log_file() -> Path:
    """The TUI's log (the screen owns stderr while it runs), ``<state>/tui.log``."""
    return state_dir() / "tui.log"


def unique_path(directory: Path, name: str) -> Path:
    """``directory/name``, or ``directory/<stem>-2<suffix>``, ``-3``, ... if that is taken: a result
    finishing in the same second as another gets a numbered name instead of overwriting it."""
    stem, suffix = Path(name).stem, Path(name).suffix
    path, n = directory / name, 2
    while path.exists():
        path, n = directory / f"{stem}-{n}{suffix}", n + 1
    return path
