"""Compile-and-load of the C++ CPU extensions (``kernels.cpu_few_rows``, ``kernels.cpu_quant_moe``).

Both are built on first use by ``torch.utils.cpp_extension.load`` into ``TORCH_EXTENSIONS_DIR``.
A failed build (no compiler, no ninja, an unsupported platform) is not an error: the caller gets
None, logs one warning and keeps its PyTorch path. Each module names its cached copy with
``build_tag`` and what else makes that copy stale (``-march=native`` code depends on the CPU,
portable code does not).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType


def build_tag(sources: list[Path], headers: list[Path], extra: str = "") -> str:
    """A short hash naming one build: torch rebuilds when a source changes, not a header, so the headers'
    text is part of the name, as is the first source's path (two checkouts must not rebuild each
    other's copy) and ``extra`` (whatever else the compiled code depends on)."""
    key = f"{extra} {sources[0].resolve()}".encode() + b"".join(h.read_bytes() for h in headers)
    return hashlib.sha1(key).hexdigest()[:10]


def built(name: str) -> bool:
    """Whether the extension ``name`` is already in the build cache. Only chooses whether to
    announce a compile; torch's helper is private, so any failure says "built"."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False), f"{name}.so").exists()
    except Exception:
        return True


def load_extension(
    name: str,
    sources: list[Path],
    extra_cflags: list[str],
    log: logging.Logger,
    what: str,
    announce: str | None = None,
) -> ModuleType | None:
    """Build (once per ``name``) and import the extension; None, with a warning on ``log`` naming
    ``what`` and the first line of the failure, when it cannot be built. ``announce``: logged at
    INFO before a compile that is not cached yet."""
    try:
        from torch.utils.cpp_extension import load

        if announce is not None and not built(name):
            log.info(announce)
        if shutil.which("ninja") is None:  # the ninja wheel's binary, when its venv is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        return load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=extra_cflags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler or ninja, or an unsupported platform: keep the PyTorch path
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.warning("%s unavailable (%s); using the PyTorch path", what, reason)
        return None
