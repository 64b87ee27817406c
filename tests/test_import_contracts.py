"""The dependency directions (pyproject.toml [tool.importlinter]: engine never imports the UI,
kernels import only torch and triton, only kimitui.tui imports textual), checked by import-linter."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    pytest.importorskip("importlinter")
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    res = subprocess.run(cmd + ["--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "broken" in res.stdout and "0 broken" in res.stdout


def test_design_module_paths_name_the_public_classes():
    # engine.py holds LLMEngine, async_llm.py holds AsyncLLM; `from engine import AsyncLLM` is the
    # public path. engine.engine has no proxy for it (no module __getattr__).
    from kimitui import engine
    import kimitui.engine.engine as engine_module
    from kimitui.engine.async_llm import AsyncLLM
    from kimitui.engine.engine import LLMEngine

    assert engine.AsyncLLM is AsyncLLM and AsyncLLM.__module__ == "kimitui.engine.async_llm"
    assert LLMEngine.__module__ == "kimitui.engine.engine"
    assert not hasattr(engine_module, "AsyncLLM") and not hasattr(engine_module, "__getattr__")
