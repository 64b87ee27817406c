"""The GPU one-shot: every section in its own process with its own time limit, one table at the end.

Sections, in order: ``env`` (what the machine has), ``tests`` (``pytest -m gpu`` on the test files
that carry the marker), ``kernels`` (each Triton kernel against its PyTorch reference at Kimi's
shapes), ``model-k2`` (graph capture of the decode step, decode tok/s of a K2.6-shaped model at
batch 1 and 64 with and without graphs), ``model-k3`` (decode tok/s of a K3-shaped model),
``offload`` (how much host-expert time a ``--cpu-offload`` decode hides, where the engine can say).
A section that fails, crashes or overruns its limit becomes rows in the table (the rows it finished
stay); the exit code is 1 when any row failed. The C++ CPU kernels the offload section uses are
compiled from the start in the background under a limit of their own (``prebuild.py``), so no
section's limit includes a first build. ``--emulate`` (automatic without a GPU) runs the same sections on the CPU
with ``KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1`` at toy sizes: the self-test of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.gpucheck.carried import carried_wheels, fla_row
from benchmarks.gpucheck.common import ERROR, FAIL, PASS, SKIP, Row
from benchmarks.gpucheck.prebuild import Prebuild
from benchmarks.gpucheck.report import markdown, write_outputs

REPO = Path(__file__).resolve().parents[2]
# seconds per section: GPU run (7.9 min in all, under the 8 the one-shot is allowed) / CPU self-test
LIMITS = {"tests": (140, 45), "kernels": (130, 60), "model-k2": (80, 50), "model-k3": (75, 110), "offload": (50, 150)}
SECTIONS = list(LIMITS)
# The C++ CPU kernels' build, started with the one-shot: on a GPU it overlaps the 410 s of sections
# before offload, so waiting for it adds nothing unless those ended early (and then 240 + 45 s still
# fit in the 8 minutes); about 1.5 minutes on 2 cores for the self-test.
BUILD_LIMIT = (240, 300)


def child_env(emulate: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = (
        [str(REPO)] + [str(w) for w in carried_wheels()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KIMITUI_KERNELS", None)  # the Triton backend is what is being checked
    if emulate:
        env.update(KIMITUI_EMULATE_DEVICE="1", TRITON_INTERPRET="1")
    else:
        env.pop("KIMITUI_EMULATE_DEVICE", None)
        env.pop("TRITON_INTERPRET", None)
    return env


def env_rows(emulate: bool) -> list[Row]:
    import torch

    rows = []
    if emulate:
        rows.append(
            Row(
                "env",
                "device",
                SKIP,
                note="CPU self-test: KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1, toy shapes, fp16; no GPU numbers",
            )
        )
    else:
        props = torch.cuda.get_device_properties(0)
        rows.append(
            Row(
                "env",
                "device",
                PASS,
                note=f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible",
            )
        )
    backend = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # reported, and the kernel rows will fail naming it
        triton_version = f"not importable ({type(e).__name__}: {e})"
    rows.append(
        Row(
            "env",
            "versions",
            PASS,
            note=f"python {sys.version.split()[0]}, torch {torch.__version__} ({backend}), triton {triton_version}",
        )
    )
    rows.append(fla_row(child_env(emulate), emulate))
    return rows


def gpu_test_files() -> list[str]:
    """Test files carrying the gpu marker (so that app tests needing textual are never collected)."""
    out = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if "pytest.mark.gpu" in path.read_text(errors="replace"):
            out.append(str(path.relative_to(REPO)))
    return out


def test_rows(emulate: bool, seconds: float, log) -> list[Row]:
    files = gpu_test_files()
    env = child_env(emulate=False)  # the GPU tests pick their own device; never the interpreter
    # The CPU side of the engine comparisons runs PyTorch: compiling the C++ CPU kernels on a fresh
    # machine would spend a minute of this section on code that is not under test here.
    env["KIMITUI_CPU_KERNELS"] = "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rfE", "-p", "no:randomly", *files]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as e:
        log.write(_text(e.stdout) + _text(e.stderr))
        return [Row("tests", f"pytest -m gpu ({len(files)} files)", ERROR, note=f"timed out after {seconds:.0f} s")]
    log.write(proc.stdout + proc.stderr)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", proc.stdout)}
    passed, failed = counts.get("passed", 0), counts.get("failed", 0)
    errors = counts.get("error", 0) + counts.get("errors", 0)
    skipped = counts.get("skipped", 0)
    summary = f"{passed} passed, {failed} failed, {errors} errors, {skipped} skipped"
    if not counts and proc.returncode not in (0, 5):  # pytest itself failed (a plugin, collection)
        last = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()][-1:] or [""]
        summary += f"; pytest exited with code {proc.returncode}: {last[0][:200]}"
    if failed or errors or proc.returncode not in (0, 5):  # 5: nothing collected
        status = FAIL
    elif passed:
        status = PASS
    else:
        status = SKIP
    rows = [
        Row(
            "tests",
            f"pytest -m gpu ({len(files)} files)",
            status,
            note=summary + (" (no GPU: every gpu test skips)" if emulate else ""),
        )
    ]
    for line in proc.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            rows.append(Row("tests", line.split(" ", 1)[1].split(" - ")[0], FAIL, note=line.split(" - ", 1)[-1][:200]))
    return rows


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_section(name: str, emulate: bool, seconds: float, workdir: Path, log, extra_env=None) -> list[Row]:
    rows_file = workdir / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.gpucheck.section", name, str(rows_file), str(seconds)]
    err_file = workdir / f"{name}.stderr"
    with open(err_file, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**child_env(emulate), **(extra_env or {})}, stderr=err)
        try:
            rc = proc.wait(timeout=seconds + 10)
            problem = None if rc == 0 else f"exited with code {rc}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            problem = f"killed at its {seconds:.0f} s limit"
    stderr = err_file.read_text(errors="replace")
    log.write(f"===== {name} stderr =====\n{stderr}\n")
    rows = [Row(**json.loads(line)) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    if problem:
        last = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] or ["(no stderr)"]
        rows.append(Row(name, "section process", ERROR, note=f"{problem}; the rows above finished. {last[0][:200]}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The GPU one-shot check of kimitui (see benchmarks/README.md).")
    ap.add_argument(
        "--emulate",
        action="store_true",
        help="run on the CPU with the device path emulated (auto without a GPU): checks the script, measures nothing",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for gpu_check.md / .json / .log (default: $OUT when set)"
    )
    args = ap.parse_args(argv)
    import torch

    emulate = args.emulate or not torch.cuda.is_available()
    if emulate and not args.emulate:
        print("no CUDA/ROCm device: running the CPU self-test (--emulate)", flush=True)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in LIMITS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    t0 = time.monotonic()
    rows = env_rows(emulate)
    with tempfile.TemporaryDirectory(prefix="kimitui-gpucheck-") as tmp:
        log_path = Path(args.out or tmp) / "gpu_check.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            build = (
                Prebuild(child_env(emulate), BUILD_LIMIT[1 if emulate else 0], Path(tmp) / "build.log")
                if "offload" in wanted
                else None
            )
            for name in wanted:
                seconds = LIMITS[name][1 if emulate else 0]
                extra_env = {}
                if name == "offload":
                    print("--- waiting for the C++ CPU kernels' build", flush=True)
                    build_row, extra_env = build.finish()
                    log.write(
                        f"===== build =====\n{build.log_path.read_text(errors='replace') if build.proc else ''}\n"
                    )
                    rows.append(build_row)
                print(f"--- {name} (limit {seconds} s)", flush=True)
                start = time.monotonic()
                if name == "tests":
                    section = test_rows(emulate, seconds, log)
                else:
                    section = run_section(name, emulate, seconds, Path(tmp), log, extra_env)
                rows += section
                rows.append(
                    Row(name, "section time", SKIP if not section else PASS, ms=(time.monotonic() - start) * 1e3)
                )
    total = time.monotonic() - t0
    table = markdown(rows, emulate, total)
    print("\n" + table, flush=True)
    if args.out:
        write_outputs(Path(args.out), table, [asdict(r) for r in rows], emulate, total)
    failed = [r for r in rows if r.status in (FAIL, ERROR)]
    return 1 if failed else 0
