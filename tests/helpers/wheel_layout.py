"""The package as a wheel lays it out, staged from the checkout: ``kimitui/`` with ``engine/``, ``kernels/`` and
``themes/`` folded in as ``kimitui/engine/`` etc. (setup.py does the same for a real wheel).

Tools that find modules by walking a package's folder (import-linter's grimp) do not follow the
``__path__`` a checkout's ``kimitui/engine/__init__.py`` sets, so they are run on this copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "kernels", "themes")


def stage_package(dest: Path) -> Path:
    """Copy the checkout's Python files into ``dest/kimitui`` in the wheel's layout; returns ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(ROOT / "kimitui", dest / "kimitui", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", *FOLDERS))
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, dest / "kimitui" / folder, ignore=ignore)
        shutil.copy2(ROOT / "kimitui" / folder / "__init__.py", dest / "kimitui" / folder / "__init__.py")
    return dest
