"""Routing statistics on disk: tokens routed to each expert per MoE layer, saved after a run so the
next start keeps the hottest experts on the GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROUTING_STATS_FORMAT = "kimitui.routing_stats/1"


def load_routing_stats(path: str | Path) -> dict[int, list[float]] | list:
    """Read tokens-per-expert counts written by ``save_routing_stats`` (or a bare dict / nested list).

    A missing file raises FileNotFoundError (a first run has none yet: callers may go on without);
    a file that is there but unreadable as statistics raises ValueError."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: routing statistics file not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and "tokens_per_expert" in data:
        data = data["tokens_per_expert"]
    if isinstance(data, dict):
        try:
            return {int(k): list(v) for k, v in data.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{p}: routing statistics keys must be layer indices") from None
    if isinstance(data, list):
        return data
    raise ValueError(f"{p}: routing statistics must be a dict of layer -> counts or a nested list")


def save_routing_stats(path: str | Path, stats: dict[int, Any] | list) -> None:
    """Write tokens-per-expert counts ({layer: [count per expert]}; a list is indexed by layer)."""
    if isinstance(stats, dict):
        items = {str(int(k)): [float(x) for x in v] for k, v in stats.items()}
    else:
        items = {str(i): [float(x) for x in v] for i, v in enumerate(stats) if v}
    Path(path).write_text(json.dumps({"format": ROUTING_STATS_FORMAT, "tokens_per_expert": items}) + "\n")
