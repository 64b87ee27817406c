"""kernels/cpu/build.py's run-time side: the build a process imports (the install's, when its key matches),
the flock that keeps two processes from compiling over each other and cannot outlive its holder, and
torch's stale ``lock`` file cleared instead of waited on forever."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimitui.kernels.cpu import build as _build

_HOLD = """
import sys, time, logging
from pathlib import Path
from kimitui.kernels.cpu.build import BuildLock
with BuildLock(Path(sys.argv[1]), logging.getLogger("t"), "test build"):
    print("HELD", flush=True)
    time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def test_a_killed_holder_releases_the_lock(tmp_path):
    folder = tmp_path / "ext_x86_64_v3_0123"
    proc = _holder(folder)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    t0 = time.monotonic()
    with _build.BuildLock(folder, logging.getLogger("t"), "test build"):
        pass
    assert time.monotonic() - t0 < 1.0


def test_a_waiter_names_the_holder_then_proceeds(tmp_path, caplog):
    folder = tmp_path / "ext"
    proc = _holder(folder)
    try:
        import threading

        threading.Timer(1.0, proc.kill).start()
        with caplog.at_level(logging.WARNING, logger="t"):
            with _build.BuildLock(folder, logging.getLogger("t"), "test build"):
                pass
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert f"waiting for process {proc.pid}" in caplog.text


def test_torchs_stale_lock_file_is_removed(tmp_path, caplog):
    folder = tmp_path / "ext"
    folder.mkdir()
    (folder / "lock").touch()  # what torch's FileBaton leaves when its build is killed
    with caplog.at_level(logging.WARNING, logger="t"):
        with _build.BuildLock(folder, logging.getLogger("t"), "test build"):
            _build.clear_stale_torch_lock(folder, logging.getLogger("t"))
    assert not (folder / "lock").exists()
    assert "left by a build that was killed" in caplog.text


def test_build_key_follows_sources_flags_and_torch(tmp_path):
    ext = _build.FEW_ROWS
    for name in (*ext.sources, *ext.headers):
        (tmp_path / name).write_text((_build.CSRC / name).read_text())
    variant = ext.variants[0][0]
    key = _build.build_key(ext, variant, "2.13.0", tmp_path)
    assert key == _build.build_key(ext, variant, "2.13.0", _build.CSRC)
    assert key != _build.build_key(ext, variant, "2.14.0", tmp_path)
    (tmp_path / ext.headers[0]).write_text((tmp_path / ext.headers[0]).read_text() + "\n// edited\n")
    assert key != _build.build_key(ext, variant, "2.13.0", tmp_path)
    if len(ext.variants) > 1:
        assert _build.build_key(ext, ext.variants[1][0], "2.13.0", _build.CSRC) != key


def test_variant_follows_the_cpu_flags():
    ext = _build.FEW_ROWS
    if len(ext.variants) == 1:
        pytest.skip("one variant on this machine")
    assert _build.variant_for(ext, frozenset({"sse2"})) == "x86_64"
    assert _build.variant_for(ext, _build._X86_64_V3 | {"avx512f"}) == "x86_64_v3"
    assert _build.variant_for(ext, _build._X86_64_V4) == "x86_64_v4"


def test_an_installed_build_is_imported_without_compiling(tmp_path):
    # the checkout's editable install built both extensions in place (make venv): a fresh process with an
    # empty extensions folder imports them, and compiles nothing
    ok = all(
        _build._prebuilt(e, _build.variant_for(e), _build.build_key(e, _build.variant_for(e), _torch()))
        for e in _build.EXTENSIONS
    )
    if not ok:
        pytest.skip("no install-time build of the C++ kernels here (pip install --no-build-isolation -e .)")
    code = (
        "from kimitui.kernels.cpu import few_rows as cpu_few_rows, quant_moe as cpu_quant_moe; "
        "print(cpu_few_rows._module().__file__); print(cpu_quant_moe._module().__file__)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert all("_cpu_" in line and line.endswith(".so") for line in proc.stdout.split())
    assert not (tmp_path / "jit").exists()
    assert "compiling" not in proc.stderr


def _torch() -> str:
    import torch

    return torch.__version__
