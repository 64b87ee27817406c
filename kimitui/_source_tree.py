"""Where ``kimitui.engine``, ``kimitui.kernels`` and ``kimitui.themes`` find their modules.

The repository keeps those packages in its top-level folders ``engine/``, ``kernels/`` and ``themes/``,
which hold no ``__init__.py``: from the repository root (on ``sys.path`` whenever tests or ``python -m``
run there) a bare ``import kernels`` must find Hugging Face's package, not ours. Each package's
``__init__.py`` lives under ``kimitui/`` instead. A built wheel (and so a plain ``pip install``) places
the folder's modules beside it, so nothing more is needed there; in a checkout, or an editable install
of one, the package's ``__init__`` calls ``with_folder`` to add the top-level folder to its ``__path__``.
docs/architecture.md ("Import names") has the whole picture.
"""

from __future__ import annotations

import os


def with_folder(path: list[str], folder: str, marker: str) -> list[str]:
    """``path`` (a package's ``__path__``) plus the checkout's ``folder`` when the package's own folder
    holds only its ``__init__`` (a checkout) and ``folder`` holds ``marker`` (so a stranger's folder of
    the same name, say a ``site-packages/engine``, is never taken)."""
    here = os.path.abspath(path[0])
    if os.path.isfile(os.path.join(here, marker)):  # installed from a wheel: the modules are here
        return path
    checkout = os.path.dirname(os.path.dirname(here))
    source = os.path.join(checkout, folder)
    if os.path.isfile(os.path.join(source, marker)) and os.path.isfile(os.path.join(checkout, "pyproject.toml")):
        return [*path, source]
    return path
