"""Saved evaluations: one JSON file per finished KL or recall run under
``$XDG_DATA_HOME/kimitui/eval/``, the same shape `kimitui eval kl|recall --json` writes plus
``kind``, ``date`` and ``model``, so either can be read back. No Textual here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimitui.paths import eval_results_dir, unique_path

KINDS = ("kl", "recall")


@dataclass(frozen=True)
class SavedEval:
    path: Path
    title: str
    result: dict[str, Any]


def save_result(result: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``result`` (with ``kind`` and ``date`` = ``YYYYmmdd-HHMMSS``) as ``<date>-<kind>.json``;
    a second one in the same second gets a numbered name instead of overwriting the first."""
    if result.get("kind") not in KINDS:
        raise ValueError(f"an evaluation result needs kind in {KINDS}, got {result.get('kind')!r}")
    directory = directory or eval_results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = unique_path(directory, f"{result.get('date', 'undated')}-{result['kind']}.json")
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def result_title(result: dict[str, Any]) -> str:
    """``20260101-120000  kl  demo  mean KL 0.000012, top-1 99.8%`` / ``... recall ... 3/10 codes``."""
    head = f"{result.get('date', '?')}  {result['kind']:<6}  {result.get('model', '?')}"
    if result["kind"] == "kl":
        if result.get("mean_kl") is None:
            return f"{head}  no positions"
        return f"{head}  mean KL {result['mean_kl']:.6f}, top-1 {100 * result['top1_agreement']:.1f}%"
    lengths = ",".join(str(n) for n in result.get("context_lengths", []))
    return f"{head}  {result.get('found', 0)}/{result.get('total', 0)} codes at {lengths}"


def list_results(directory: Path | None = None) -> list[SavedEval]:
    """Saved results, newest first; files that are not evaluation results are skipped."""
    directory = directory or eval_results_dir()
    if not directory.is_dir():
        return []
    out = []
    for path in directory.glob("*.json"):
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or result.get("kind") not in KINDS:
            continue
        if result["kind"] == "recall" and not isinstance(result.get("results"), list):
            continue
        if result["kind"] == "kl" and not isinstance(result.get("prefill"), dict):
            continue
        out.append(SavedEval(path, result_title(result), result))
    out.sort(key=lambda r: (str(r.result.get("date", "")), r.path.name), reverse=True)
    return out
