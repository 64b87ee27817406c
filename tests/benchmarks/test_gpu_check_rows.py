"""The GPU one-shot's bookkeeping, checked on the CPU: rows are written as they are measured, the C++
build happens before (and outside) the offload section's limit, and the fla-core environment row
says PASS only when fla-core really imports, at the pinned version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpucheck import carried, main, prebuild
from benchmarks.gpucheck.common import ERROR, FAIL, PASS, SKIP, Deadline, Row, Sink
from tests.helpers.bare_machine import write_sitecustomize

REPO = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_rows_are_written_as_they_are_measured(tmp_path):
    out = tmp_path / "rows.jsonl"
    sink = Sink(str(out), "kernels", Deadline(60))
    seen = []

    def check():
        yield Row("kernels", "first shape", PASS)
        seen.append([r["check"] for r in _rows(out)])  # the first row is on disk before the second runs
        yield Row("kernels", "second shape", PASS)
        raise RuntimeError("the third shape ran out of memory")

    sink.run("fused MoE", check)
    assert seen == [["first shape"]]
    rows = _rows(out)
    assert [r["check"] for r in rows] == ["first shape", "second shape", "fused MoE"]
    assert rows[-1]["status"] == ERROR and "ran out of memory" in rows[-1]["note"]


def test_a_generator_check_stops_at_the_deadline(tmp_path):
    out = tmp_path / "rows.jsonl"
    sink = Sink(str(out), "kernels", Deadline(0.3))

    def check():
        for i in range(100):
            time.sleep(0.2)
            yield Row("kernels", f"shape {i}", PASS)

    sink.run("GEMMs", check, min_left=0.0)
    rows = _rows(out)
    assert rows[-1]["status"] == SKIP and rows[-1]["check"] == "GEMMs: the rest"
    assert 1 <= len(rows) - 1 <= 3


def _prebuild(tmp_path, code, limit=30.0, **env):
    return prebuild.Prebuild(
        {**os.environ, "KIMITUI_CPU_KERNELS": "1", **env}, limit, tmp_path / "build.log", code=code
    )


def test_prebuild_rows(tmp_path):
    row, extra = _prebuild(tmp_path, 'print("BUILT True True")').finish()
    assert row.status == PASS and extra == {}
    row, extra = _prebuild(tmp_path, 'print("warning: no compiler"); print("BUILT False True")').finish()
    assert row.status == FAIL and "no compiler" in row.note and extra == {"KIMITUI_CPU_KERNELS": "0"}
    row, extra = _prebuild(tmp_path, "raise SystemExit(3)").finish()
    assert row.status == FAIL and "exit code 3" in row.note and extra == {"KIMITUI_CPU_KERNELS": "0"}
    row, extra = _prebuild(tmp_path, "raise SystemExit(3)", KIMITUI_CPU_KERNELS="0").finish()
    assert row.status == SKIP and extra == {}


def test_an_overrunning_build_is_killed_and_its_lock_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    old_lock = tmp_path / "ext" / "kimitui_cpu_few_rows_old" / "lock"
    old_lock.parent.mkdir(parents=True)
    old_lock.touch()
    os.utime(old_lock, (time.time() - 3600, time.time() - 3600))  # another build's, from before: kept
    # a "build" that takes its lock and a compiler child, then never ends
    code = (
        "import os, subprocess, time; d = os.environ['TORCH_EXTENSIONS_DIR'] + '/kimitui_cpu_few_rows_new'; "
        "os.makedirs(d); open(d + '/lock', 'w').close(); "
        "p = subprocess.Popen(['sleep', '300']); open(d + '/child', 'w').write(str(p.pid)); time.sleep(300)"
    )
    build = _prebuild(tmp_path, code, limit=3.0, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    t = time.monotonic()
    row, extra = build.finish()
    assert time.monotonic() - t < 10
    assert row.status == ERROR and "3 s limit" in row.note and extra == {"KIMITUI_CPU_KERNELS": "0"}
    assert not (tmp_path / "ext" / "kimitui_cpu_few_rows_new" / "lock").exists() and old_lock.exists()
    child = int((tmp_path / "ext" / "kimitui_cpu_few_rows_new" / "child").read_text())
    time.sleep(0.5)
    assert not _running(child)  # the compiler stand-in went with its session


def _running(pid: int) -> bool:
    try:  # a killed child nobody reaped yet is a zombie ("Z"): not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_offload_waits_for_the_build_outside_its_limit(tmp_path, monkeypatch):
    calls = []

    class FakeBuild:
        proc = None

        def __init__(self, env, limit_s, log_path):
            calls.append(("build started", limit_s))

        def finish(self):
            calls.append(("build waited",))
            return Row("offload", prebuild.CHECK, ERROR, note="overran"), {"KIMITUI_CPU_KERNELS": "0"}

    def fake_section(name, emulate, seconds, workdir, log, extra_env=None):
        calls.append((name, extra_env))
        return [Row(name, "a row", PASS)]

    monkeypatch.setattr(main, "Prebuild", FakeBuild)
    monkeypatch.setattr(main, "run_section", fake_section)
    monkeypatch.setattr(main, "env_rows", lambda emulate: [])
    main.main(["--emulate", "--sections", "kernels,offload", "--out", str(tmp_path)])
    assert calls == [
        ("build started", main.BUILD_LIMIT[1]),
        ("kernels", {}),
        ("build waited",),
        ("offload", {"KIMITUI_CPU_KERNELS": "0"}),
    ]
    checks = [r["check"] for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]]
    assert checks.index(prebuild.CHECK) < checks.index("a row", checks.index("section time") + 1)
    calls.clear()
    main.main(["--emulate", "--sections", "kernels", "--out", str(tmp_path)])
    assert calls == [("kernels", {})]  # no offload section: nothing to build


def test_carried_wheels_are_the_pinned_fla_core_and_einops(tmp_path):
    for name in (
        "fla_core-0.5.0-py3-none-any.whl",
        "fla_core-0.6.0-py3-none-any.whl",
        "fla_core-0.7.1-py3-none-any.whl",
        "einops-0.8.1-py3-none-any.whl",
    ):
        (tmp_path / name).touch()
    assert [w.name for w in carried.carried_wheels(tmp_path)] == [
        "fla_core-0.6.0-py3-none-any.whl",
        "einops-0.8.1-py3-none-any.whl",
    ]


def _env(*front: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, front), str(REPO)])
    return env


def _blocker(folder: Path, *extra: str) -> Path:
    """A sitecustomize folder blocking the bare machine's absent packages and ``extra``."""
    write_sitecustomize(folder)
    text = (folder / "sitecustomize.py").read_text()
    (folder / "sitecustomize.py").write_text(text.replace("ABSENT = frozenset(", f"ABSENT = frozenset({extra!r} + "))
    return folder


def test_gpu_engine_tests_cpu_side_runs_without_psutil(tmp_path):
    # tests/engine/test_engine_gpu.py compares against a CPU engine, on an image that may lack psutil
    code = """
try:
    import psutil
except ImportError:
    pass
else:
    raise SystemExit("psutil imported: the blocker is not active")
from kimitui.engine.demo import demo_checkpoint
from tests.engine import test_engine_gpu
outs = test_engine_gpu._generate(demo_checkpoint(), "cpu")
print("TOKENS", [len(o.token_ids) for o in outs])
"""
    env = _env(_blocker(tmp_path / "site", "psutil"))
    env["KIMITUI_CPU_KERNELS"] = "0"  # as the one-shot's tests section runs them
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TOKENS [8, 8, 8]" in proc.stdout


@pytest.mark.slow  # three child imports of fla (each loads torch's compiler stack): over a minute on 2 cores
def test_fla_row_passes_only_when_fla_imports(tmp_path):
    pytest.importorskip("fla", reason="fla-core is not installed here")
    pytest.importorskip("einops", reason="einops is not installed here")
    row = carried.fla_row(_env(), emulate=False, folder=tmp_path)
    assert row.status == PASS and "fla-core 0.6.0 imports" in row.note, row.note
    # einops blocked, as on an image where only the fla-core wheel was carried
    blocker = _blocker(tmp_path / "site", "einops")
    for emulate, status in ((False, FAIL), (True, SKIP)):
        row = carried.fla_row(_env(blocker), emulate=emulate, folder=tmp_path)
        assert row.status == status and "does not import" in row.note and "einops" in row.note, row.note
        assert "einops -d benchmarks/wheels" in row.note  # says how to carry it


def test_fla_row_fails_on_another_fla_version(tmp_path):
    fake = tmp_path / "fake"
    for mod in (
        "fla/__init__.py",
        "fla/ops/__init__.py",
        "fla/ops/kda/__init__.py",
        "fla/modules/__init__.py",
        "fla/modules/causal_conv1d.py",
    ):
        (fake / mod).parent.mkdir(parents=True, exist_ok=True)
        (fake / mod).write_text('__version__ = "0.7.0"\n' if mod == "fla/__init__.py" else "")
    row = carried.fla_row(_env(fake), emulate=False, folder=tmp_path)
    assert row.status == FAIL and "fla-core 0.7.0 imports" in row.note and "0.6.0" in row.note, row.note
