"""Packaging: one import name (``kimitui``) that leaves Hugging Face's ``kernels`` (which transformers imports)
alone from any directory; a wheel that installs only ``kimitui``, with the C++ CPU kernels compiled into it,
and runs from a fresh venv without compiling anything; start-ups killed at random never block the next."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

_PROBE = """
import json, kernels
from transformers import DeepseekV3ForCausalLM
try:
    from engine import LLM
    bare_engine = "imported"
except ImportError as e:
    bare_engine = "ImportError"
from kimitui.engine import LLM, SamplingParams
print(json.dumps({"kernels": getattr(kernels, "__file__", None), "bare_engine": bare_engine}))
"""


def _hf_kernels_dir() -> Path | None:
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(dist.locate_file("kernels")).resolve()


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", **extra)
    return env


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_transformers_and_hugging_face_kernels_win_from_any_directory(where, tmp_path):
    cwd = ROOT if where == "repo root" else tmp_path
    proc = subprocess.run([PY, "-c", _PROBE], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    hf = _hf_kernels_dir()
    assert hf is not None, "transformers needs Hugging Face's kernels package; it is not installed"
    assert Path(got["kernels"]).resolve().parent == hf  # its kernels/__init__.py, never our folder
    assert got["bare_engine"] == "ImportError"  # `from engine import LLM` names no module of ours


def _build_wheel(dest: Path) -> Path:
    # --no-build-isolation: the C++ kernels compile against this venv's torch (setup.py), and nothing is
    # downloaded; the objects an editable install compiled in build/ are reused, so this links in seconds
    proc = subprocess.run(
        [PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), "."],
        cwd=ROOT,
        env=_env(KIMITUI_BUILD_CPU_KERNELS="this"),  # the variant `make venv` compiled (a release wheel has all)
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (wheel,) = dest.glob("kimitui-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_installs_only_kimitui_with_compiled_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kimitui", "kimitui-0.1.0.dist-info"}
    for needed in (
        "kimitui/engine/__init__.py",
        "kimitui/engine/llm.py",
        "kimitui/engine/models/deepseek_v3.py",
        "kimitui/engine/demo/data/demo_corpus.txt",
        "kimitui/kernels/__init__.py",
        "kimitui/kernels/backend.py",
        "kimitui/kernels/cpu/csrc/cpu_few_rows.cpp",
        "kimitui/themes/__init__.py",
        "kimitui/themes/kimitui-dark.toml",
        "kimitui/tui/app.tcss",
    ):
        assert needed in names, needed
    built = [n for n in names if n.startswith("kimitui/kernels/cpu/_cpu_") and n.endswith(".so")]
    keys = [n for n in names if n.endswith(".buildkey")]
    assert built and len(keys) == len(built), (built, keys)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (not editable); the other dependencies come from this venv's
    site-packages through a .pth line (nothing is downloaded)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    vpy = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "zz_deps.pth").write_text("\n".join(ours) + "\n")
    subprocess.run(
        [PY, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=600,
        env=_env(),
    )
    return venv


def _run_fresh(venv: Path, args: list[str], tmp_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = _env(
        TORCH_EXTENSIONS_DIR=str(tmp_path / "jit"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
    )
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_installed_wheel_runs_info_and_the_demo_without_compiling(installed, tmp_path):
    vpy = str(installed / "bin" / "python")
    info = _run_fresh(installed, [str(installed / "bin" / "kimitui"), "info"], tmp_path)
    assert info.returncode == 0, info.stderr[-3000:]
    code = (
        "import json, kernels, kimitui\n"
        "from kimitui.kernels.cpu import few_rows as cpu_few_rows, quant_moe as cpu_quant_moe\n"
        "from kimitui.engine import LLM, SamplingParams\n"
        "out = LLM(max_model_len=256).generate('Hello', SamplingParams(max_tokens=4, temperature=0.0))\n"
        "print(json.dumps({'tokens': out[0].outputs[0].token_ids, 'kimitui': kimitui.__file__,"
        " 'kernels': kernels.__file__, 'few_rows': cpu_few_rows._module().__file__,"
        " 'quant_moe': cpu_quant_moe._module().__file__}))\n"
    )
    run = _run_fresh(installed, [vpy, "-c", code], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got["tokens"]) == 4
    for key in ("kimitui", "few_rows", "quant_moe"):  # the wheel's files, not the checkout's
        assert str(installed) in got[key], (key, got[key])
    assert Path(got["kernels"]).resolve().parent == _hf_kernels_dir()
    assert not (tmp_path / "jit").exists() or not any((tmp_path / "jit").rglob("*.so")), "compiled at run time"
    assert "compiling" not in run.stderr


def test_killed_startups_never_block_the_next(tmp_path):
    # Ten engines started and killed with SIGKILL at random moments of start-up (demo checkpoint being
    # written, kernels loading, weights loading), then one more: it comes up, and nothing compiled at run time.
    env = _env(TORCH_EXTENSIONS_DIR=str(tmp_path / "jit"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = (
        "from kimitui.engine import LLM, SamplingParams\n"
        "out = LLM(max_model_len=256).generate('Hi', SamplingParams(max_tokens=2, temperature=0.0))\n"
        "print('UP', out[0].outputs[0].token_ids)\n"
    )
    rng = random.Random(1234)
    for _ in range(10):
        proc = subprocess.Popen([PY, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.3, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    last = subprocess.run([PY, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0 and "UP" in last.stdout, last.stderr[-3000:]
    assert "compiling" not in last.stderr
    assert not (tmp_path / "jit").exists() or not any((tmp_path / "jit").rglob("*.so")), "compiled at run time"
