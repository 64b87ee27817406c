"""The one table the GPU one-shot prints (markdown), and the files it leaves in $OUT."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.gpucheck.common import ERROR, FAIL, cells

HEADER = ["section", "check", "status", "max rel err", "time", "reference", "GB/s", "tok/s", "note"]


def markdown(rows, emulate: bool, seconds: float) -> str:
    bad = sum(r.status in (FAIL, ERROR) for r in rows)
    title = (
        f"kimitui gpu_check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{'CPU self-test (emulated device, toy shapes)' if emulate else 'GPU'}, {seconds:.0f} s, "
        f"{bad} failed of {len(rows)} rows"
    )
    lines = [title, "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        lines.append("| " + " | ".join([r.section, r.check, *cells(r)]).replace("\n", " ") + " |")
    return "\n".join(lines)


def write_outputs(folder: Path, table: str, rows: list[dict], emulate: bool, seconds: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu_check.md").write_text(table + "\n")
    (folder / "gpu_check.json").write_text(json.dumps({"emulate": emulate, "seconds": seconds, "rows": rows}, indent=1))
