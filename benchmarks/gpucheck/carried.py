"""Packages the GPU one-shot carries as wheels in ``benchmarks/wheels/`` (git-ignored), and whether
they import where the sections run.

A bare GPU image cannot install anything, so pure-Python wheels are put on the sections'
``PYTHONPATH`` as zips: fla-core, pinned to the version ``kernels/triton/kda_fla.py`` is written against
(0.7 deprecates arguments it passes), and einops, which fla-core imports but does not bring when a
wheel is carried without its dependencies. The environment row runs the same import the engine
does (``kernels.kda_fla.unavailable_reason``) in a child with the sections' environment, so it says
PASS only when fla-core really imports there, and otherwise why not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpucheck.common import FAIL, PASS, SKIP, Row

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "benchmarks" / "wheels"
FLA_VERSION = "0.6.0"
FETCH = f"pip download --no-deps fla-core=={FLA_VERSION} einops -d benchmarks/wheels"

_PROBE = """
import json
from kimitui.kernels.triton import kda_fla
info = {"reason": kda_fla.unavailable_reason()}
if info["reason"] is None:
    import fla
    info.update(version=getattr(fla, "__version__", "unknown"), file=fla.__file__)
print("FLA-PROBE " + json.dumps(info))
"""


def carried_wheels(folder: Path = WHEELS) -> list[Path]:
    """The wheels for the sections' PYTHONPATH: fla-core at the pinned version, and einops."""
    fla = sorted(folder.glob(f"fla_core-{FLA_VERSION}-*.whl"))
    einops = sorted(folder.glob("einops-*.whl"))
    return fla[-1:] + einops[-1:]


def fla_row(env: dict[str, str], emulate: bool, folder: Path = WHEELS) -> Row:
    """Whether fla-core imports in ``env`` (the sections' environment), at the pinned version."""
    names = [w.name for w in carried_wheels(folder)]
    others = sorted(w.name for w in folder.glob("fla_core-*.whl") if w.name not in names)
    where = (f"carried: {', '.join(names)}" if names else "no wheels carried") + (
        f"; ignored (not {FLA_VERSION}): {', '.join(others)}" if others else ""
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _PROBE],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FLA-PROBE ")), None)
        info = (
            json.loads(line.split(" ", 1)[1])
            if line
            else {"reason": f"the import check failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1][:200]}"}
        )
    except subprocess.TimeoutExpired:
        info = {"reason": "the import check did not finish in 120 s"}
    if info["reason"] is not None:
        # Without a GPU nothing runs fla-core; on one, K3's KDA layers are refused without it.
        return Row(
            "env",
            "fla-core",
            SKIP if emulate else FAIL,
            note=f"does not import: {info['reason']} ({where}); K3 on a GPU needs it: {FETCH}",
        )
    if info["version"] != FLA_VERSION:
        return Row(
            "env",
            "fla-core",
            FAIL,
            note=f"fla-core {info['version']} imports ({info['file']}), but "
            f"kimitui is written against {FLA_VERSION}: {FETCH}",
        )
    return Row("env", "fla-core", PASS, note=f"fla-core {info['version']} imports from {info['file']} ({where})")
