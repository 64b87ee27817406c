"""Saved benchmark runs: one vLLM-compatible result JSON per finished run (each sweep point is
one run) under ``$XDG_DATA_HOME/kimitui/bench/``, so `kimitui bench` tooling and vLLM's
scripts read them too. No Textual here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimitui.bench.runner import default_result_filename, save_result
from kimitui.paths import bench_runs_dir, unique_path


@dataclass(frozen=True)
class SavedRun:
    path: Path
    title: str
    result: dict[str, Any]


def save_run(result: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``result`` under vLLM's default name; a run finishing in the same second as another
    (sweep points, tiny runs) gets a numbered name instead of overwriting it."""
    directory = directory or bench_runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return save_result(result, str(directory), unique_path(directory, default_result_filename(result)).name)


def run_title(result: dict[str, Any]) -> str:
    """``20260101-120000  my-label  32/8 x4 c2  123.4 tok/s``: what a list row says about a run."""
    conc = result.get("max_concurrency")
    shape = (
        f"{result.get('random_input_len', '?')}/{result.get('random_output_len', '?')} "
        f"x{result.get('num_prompts', '?')} c{'-' if conc is None else conc}"
    )
    tput = result.get("output_throughput")
    speed = "" if tput is None else f"  {tput:,.1f} out tok/s"
    label = result.get("label") or result.get("model_id") or ""
    return f"{result.get('date', '?')}  {label}  {shape}{speed}"


def list_runs(directory: Path | None = None) -> list[SavedRun]:
    """Saved runs, newest first; files that are not run results (sweep summaries, junk) are skipped."""
    directory = directory or bench_runs_dir()
    if not directory.is_dir():
        return []
    runs = []
    for path in directory.glob("*.json"):
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(result, dict) and "completed" in result and "duration" in result:
            runs.append(SavedRun(path, run_title(result), result))
    runs.sort(key=lambda r: (str(r.result.get("date", "")), r.path.stat().st_mtime, r.path.name), reverse=True)
    return runs
