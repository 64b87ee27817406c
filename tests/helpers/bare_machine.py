"""The lent GPU machine's Python, imitated on this one: the packages it lacks cannot be imported.

That machine's python3 has torch, triton, safetensors, tokenizers, transformers and pytest but none
of the app's packages (textual, FastAPI and what they pull in). ``write_sitecustomize(folder)``
writes a ``sitecustomize.py`` that puts a ``sys.meta_path`` finder in front of every other, raising
ImportError for those packages; with ``folder`` on PYTHONPATH every Python process started from
there (and its children, which inherit PYTHONPATH) runs as it would on that machine.
"""

from __future__ import annotations

from pathlib import Path

# in this project's venv but not on the lent machine (its package list: the device notes' KINDS.md). sniffio is
# not on that list either, but this venv's anyio pytest plugin imports it when pytest starts: blocking it
# would test this venv's anyio, not our code
ABSENT = (
    "textual",
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "pydantic_core",
    "openai",
    "platformdirs",
    "truststore",
    "linkify_it",
    "mdit_py_plugins",
    "opentelemetry",
    "jiter",
    "annotated_types",
    "typing_inspection",
    "pytest_asyncio",
)

_SITECUSTOMIZE = '''
import sys

ABSENT = frozenset({absent!r})


class _AbsentOnTheGpuMachine:
    """Finds nothing it is not asked about; refuses the packages the lent GPU machine lacks."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ImportError(f"{{name}} is not installed on the bare GPU machine (blocked by tests/helpers/bare_machine.py)")
        return None


sys.meta_path.insert(0, _AbsentOnTheGpuMachine())
'''


def write_sitecustomize(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sitecustomize.py"
    path.write_text(_SITECUSTOMIZE.format(absent=tuple(ABSENT)))
    return path
