"""The dependency directions (pyproject.toml [tool.importlinter]: engine never imports the UI,
kernels import only torch and triton, only kimitui.tui imports textual), checked by import-linter on
the package in its installed layout (tests/helpers/wheel_layout.py: grimp walks folders and would not
see the checkout's engine/, kernels/, themes/)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.wheel_layout import stage_package

ROOT = Path(__file__).resolve().parents[1]


def _lint(tree: Path, config: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        cmd + ["--no-cache", "--config", str(config)], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )


def test_import_linter_contracts_hold(tmp_path):
    pytest.importorskip("importlinter")
    tree = stage_package(tmp_path)
    res = _lint(tree, ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "broken" in res.stdout and "0 broken" in res.stdout


def test_import_linter_sees_the_engine_and_catches_a_breach(tmp_path):
    # the contracts must not pass because the graph is empty: a UI import planted in the engine breaks one
    pytest.importorskip("importlinter")
    tree = stage_package(tmp_path)
    bad = tree / "kimitui" / "engine" / "llm.py"
    bad.write_text(bad.read_text() + "\nimport kimitui.tui.app  # planted by the test\n")
    res = _lint(tree, ROOT / "pyproject.toml")
    assert res.returncode != 0 and "kimitui.engine.llm -> kimitui.tui.app" in res.stdout, res.stdout


def test_design_module_paths_name_the_public_classes():
    # engine.py holds LLMEngine, async_llm.py holds AsyncLLM; `from engine import AsyncLLM` is the
    # public path. engine.engine has no proxy for it (no module __getattr__).
    import kimitui.engine.engine as engine_module
    from kimitui import engine
    from kimitui.engine.async_llm import AsyncLLM
    from kimitui.engine.engine import LLMEngine

    assert engine.AsyncLLM is AsyncLLM and AsyncLLM.__module__ == "kimitui.engine.async_llm"
    assert LLMEngine.__module__ == "kimitui.engine.engine"
    assert not hasattr(engine_module, "AsyncLLM") and not hasattr(engine_module, "__getattr__")


def test_design_public_names_import_from_kimitui_engine():
    from kimitui.engine import (
        LLM,
        AsyncLLM,
        CompletionOutput,
        EngineArgs,
        RequestOutput,  # noqa: F401
        SamplingParams,
        Tokenizer,
    )

    assert Tokenizer.__module__ == "kimitui.engine.text.tokenizer"


def test_import_linter_catches_a_layer_breach_and_a_package_cycle(tmp_path):
    # the scheduler reaching up into the runner breaks the engine's layers; the kernel interface
    # importing its CPU implementation closes a cycle between kernels' sibling packages
    pytest.importorskip("importlinter")
    tree = stage_package(tmp_path)
    for path, planted in (
        ("engine/scheduler/output.py", "import kimitui.engine.runner.model_runner"),
        ("kernels/backend.py", "import kimitui.kernels.cpu.backend"),
    ):
        f = tree / "kimitui" / path
        f.write_text(f.read_text() + f"\n{planted}  # planted by the test\n")
    res = _lint(tree, ROOT / "pyproject.toml")
    assert res.returncode != 0, res.stdout
    assert "kimitui.engine.scheduler.output -> kimitui.engine.runner.model_runner" in res.stdout, res.stdout
    assert "No cycles are allowed in kimitui.kernels" in res.stdout, res.stdout
