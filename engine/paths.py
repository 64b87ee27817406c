"""The engine's one place on disk: its cache under the XDG cache dir (demo checkpoints, converted
tokenizers). The app's config, data and state folders are ``kimitui/paths.py``'s."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/kimitui`` (default ``~/.cache/kimitui``), read when called, so tests may move it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kimitui"
