"""The dependency directions of DESIGN.md section 1, checked by import-linter."""

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
    # DESIGN.md section 2: engine.py holds LLMEngine and AsyncLLM; the package root re-exports them.
    import engine
    from engine.async_llm import AsyncLLM
    from engine.engine import AsyncLLM as from_engine_module
    from engine.engine import LLMEngine

    assert from_engine_module is AsyncLLM is engine.AsyncLLM
    assert LLMEngine.__module__ == "engine.engine"
