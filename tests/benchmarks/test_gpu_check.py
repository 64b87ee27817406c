"""benchmarks/gpu_check.py: it imports nothing the bare GPU machine lacks, a failing section becomes
an ERROR row (not a lost run), and its CPU self-test (--emulate) runs every section end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.bare_machine import ABSENT, write_sitecustomize

REPO = Path(__file__).resolve().parents[2]

# everything the one-shot imports on its way, its lazily imported kernels and engine parts included
MODULES = [
    "benchmarks.gpucheck.main",
    "benchmarks.gpucheck.section",
    "benchmarks.gpucheck.small_ops",
    "benchmarks.gpucheck.big_ops",
    "benchmarks.gpucheck.model_checks",
    "benchmarks.gpucheck.offload_check",
    "kimitui.kernels.triton.rms_norm",
    "kimitui.kernels.triton.fused_add_rms_norm",
    "kimitui.kernels.triton.rope_fused",
    "kimitui.kernels.triton.mla_cache_write",
    "kimitui.kernels.triton.moe_router",
    "kimitui.kernels.triton.moe_align",
    "kimitui.kernels.triton.mla_decode",
    "kimitui.kernels.triton.fused_moe",
    "kimitui.kernels.triton.gemm.fp8_block",
    "kimitui.kernels.triton.gemm.w4a16",
    "kimitui.kernels.triton.gemm.mxfp4",
    "kimitui.kernels.kda",
    "kimitui.kernels.triton.kda_fla",
    "kimitui.kernels.triton.backend",
    "kimitui.engine.models.deepseek_v3",
    "kimitui.engine.models.kimi_linear",
    "kimitui.engine.runner.model_runner",
    "kimitui.engine.runner.graphs",
    "kimitui.engine.offload.cpu_experts",
]


def _bare_env(tmp_path: Path, **extra) -> dict[str, str]:
    write_sitecustomize(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k not in ("KIMITUI_EMULATE_DEVICE", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), HF_HUB_OFFLINE="1", **extra)
    return env


def test_gpu_check_imports_nothing_the_bare_machine_lacks(tmp_path):
    code = f"""
import importlib, sys
for name in {ABSENT[:2]!r}:  # the blocker is in place: the app's packages do not import
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{{name}} imported: the bare-machine blocker is not active")
for name in {MODULES!r}:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {ABSENT!r})
print("LOADED", loaded)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_bare_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout


def test_a_crashing_section_is_an_error_row(tmp_path):
    from benchmarks.gpucheck.common import ERROR
    from benchmarks.gpucheck.main import run_section

    with open(tmp_path / "log", "w") as log:
        rows = run_section("no-such-section", emulate=True, seconds=60, workdir=tmp_path, log=log)
    assert [r.status for r in rows] == [ERROR]
    assert rows[0].check == "section process" and "exited with code 1" in rows[0].note
    assert "KeyError" in rows[0].note


@pytest.mark.slow  # about 1.5-2 minutes on a 2-core machine: every section with interpreted Triton kernels
def test_emulated_self_test_runs_every_section(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--emulate", "--out", str(out)],
        cwd=REPO,
        env=_bare_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = json.loads((out / "gpu_check.json").read_text())["rows"]
    table = (out / "gpu_check.md").read_text()
    assert table.count("\n| ") == len(rows) + 1  # header + one line per row
    by_section = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    assert not [r for r in rows if r["status"] in ("FAIL", "ERROR")]
    # the gpu tests were collected on a machine without the app's packages, and skip without a GPU
    assert "skipped" in by_section["tests"][0]["note"] and "0 errors" in by_section["tests"][0]["note"]
    kernel_rows = [r for r in by_section["kernels"] if r["check"] != "section time"]
    assert sum(r["status"] == "pass" for r in kernel_rows) >= 15 and all(
        r["err"] is not None for r in kernel_rows if r["status"] == "pass"
    )
    assert {r["check"] for r in by_section["graphs"]} >= {"capture", "decode step B=1: graph vs eager logits"}
    decode = [r for r in by_section["decode"] if r["tok_s"]]
    assert len(decode) == 6  # K2 shape: batch 1 and 4, eager and graphs; K3 shape: batch 1 and 4, eager


def test_fla_core_imports_from_its_wheels_as_zips():
    from benchmarks.gpucheck.carried import FETCH, carried_wheels

    wheels = carried_wheels()
    if len(wheels) < 2:
        pytest.skip(f"fla-core 0.6.0 and einops wheels not both in benchmarks/wheels ({FETCH})")
    # the carried pair alone (pure Python, as zips): fla's KDA ops import, einops included
    code = """
import fla, einops
import fla.ops.kda, fla.modules.causal_conv1d
print("FILES", fla.__file__, einops.__file__)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, wheels), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{wheels[0]}" in proc.stdout and f"{wheels[1]}" in proc.stdout  # imported from inside the zips
