"""Concurrency sweeps: the throughput-vs-interactivity frontier and InferenceX's ladder.

Interactivity (tok/s per user) = 1000 / median TPOT ms; throughput = total tok/s per GPU
(InferenceX's `median_intvty` and `tput_per_gpu`), or of the whole host when the run had no GPU. The ladder reads the frontier at fixed
per-user speeds by linear interpolation between neighbouring frontier points (InferenceX's
dashboard draws a monotone cubic through them; linear never overshoots the measurements).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

LADDER_TARGETS = (30, 50, 75, 100, 150, 200)


@dataclass(frozen=True)
class SweepPoint:
    """One measured operating point."""

    concurrency: int | None
    interactivity: float  # tok/s per user
    tput_per_gpu: float  # total tok/s per GPU


def parse_concurrency_list(text: str) -> tuple[int, ...]:
    """`--sweep-concurrency 1,2,4,8` -> (1, 2, 4, 8)."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ValueError(f"--sweep-concurrency expects integers like 1,2,4,8, got {text!r}") from e
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--sweep-concurrency needs positive integers, got {text!r}")
    return levels


def point_from_result(result: dict[str, Any]) -> SweepPoint | None:
    """A point from a saved result; None when no TPOT was measured (all outputs <= 1 token)."""
    tpot = result.get("median_tpot_ms")
    if not tpot or result.get("completed", 0) == 0:
        return None
    tput = result["tput_per_gpu"] if result.get("num_gpus", 1) else result["total_token_throughput"]
    return SweepPoint(result.get("max_concurrency"), 1000.0 / tpot, float(tput))


def frontier(points: Iterable[SweepPoint]) -> list[SweepPoint]:
    """Pareto front: points no other point beats in both interactivity and throughput,
    sorted by interactivity ascending (so throughput descends along it)."""
    front: list[SweepPoint] = []
    # Walk from the most interactive point down: a point joins when its throughput beats
    # everything more interactive than it.
    best = float("-inf")
    for p in sorted(points, key=lambda p: (-p.interactivity, -p.tput_per_gpu)):
        if p.tput_per_gpu > best:
            front.append(p)
            best = p.tput_per_gpu
    return front[::-1]


def ladder(front: Sequence[SweepPoint], targets: Sequence[float] = LADDER_TARGETS) -> dict[float, float | None]:
    """Tokens/s per GPU at each per-user target, interpolated along the frontier; None where
    the target lies outside the frontier's interactivity range."""
    pts = sorted(front, key=lambda p: p.interactivity)
    out: dict[float, float | None] = {}
    for target in targets:
        out[target] = None
        for a, b in zip(pts, pts[1:] or pts):
            if a.interactivity <= target <= b.interactivity:
                span = b.interactivity - a.interactivity
                w = 0.0 if span == 0 else (target - a.interactivity) / span
                out[target] = a.tput_per_gpu + w * (b.tput_per_gpu - a.tput_per_gpu)
                break
    return out


def format_ladder(values: dict[float, float | None], cost_per_mtok: Any = None, per: str = "GPU") -> str:
    """The ladder as a text table; "-" where the frontier does not reach.
    `cost_per_mtok(tput_per_gpu) -> dict[tier, $]` adds cost columns when given; ``per``: "GPU", or
    "host" for a run without GPUs."""
    lines = ["{s:{c}^{n}}".format(s=" Throughput at interactivity targets ", n=50, c="=")]
    for target, tput in values.items():
        cells = "-" if tput is None else f"{tput:,.1f}"
        if cost_per_mtok is not None and tput is not None:
            cells += "  " + "  ".join(f"{k} ${v:.3f}/M" for k, v in cost_per_mtok(tput).items() if v is not None)
        lines.append("{:<40} {:<10}".format(f"tok/s/{per} at {target:g} tok/s/user:", cells))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_frontier(front: Sequence[SweepPoint | dict[str, Any]], per: str = "GPU") -> str:
    """The frontier as a text table, most interactive point first (accepts `asdict` points); ``per``:
    "GPU", or "host" for a run without GPUs."""
    rows = [p if isinstance(p, dict) else asdict(p) for p in front]
    lines = ["{s:{c}^{n}}".format(s=" Throughput vs interactivity frontier ", n=50, c="=")]
    lines.append("{:<14}{:>18}{:>18}".format("concurrency", "tok/s/user", f"tok/s/{per}"))
    for p in sorted(rows, key=lambda p: -p["interactivity"]):
        conc = "-" if p["concurrency"] is None else str(p["concurrency"])
        lines.append("{:<14}{:>18,.2f}{:>18,.2f}".format(conc, p["interactivity"], p["tput_per_gpu"]))
    if not rows:
        lines.append("(no point measured a TPOT: outputs of one token only?)")
    lines.append("=" * 50)
    return "\n".join(lines)
