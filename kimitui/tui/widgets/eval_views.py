"""Text views of evaluation results for the evaluation screen: the KL statistics with one column
per path (llama.cpp's rows), the recall table per length and depth, and a per-depth recall bar
chart in block characters (plain text, so snapshots and narrow terminals both work)."""

from __future__ import annotations

from typing import Any

from kimitui.eval.recall import format_table

BAR_WIDTH = 40
_EIGHTHS = " ▏▎▍▌▋▊▉█"


def kl_table(summary: dict[str, Any]) -> str:
    """Mean / p99 / max KL, top-1 agreement and positions, for the prefill path, the decode path and both."""
    cols = [("prefill", summary["prefill"]), ("decode", summary["decode"]), ("all", summary)]

    def cell(s: dict, key: str, fmt: str) -> str:
        v = s.get(key)
        return (
            "-"
            if v is None
            else format(v * 100 if fmt.endswith("%") else v, fmt.rstrip("%")) + ("%" if fmt.endswith("%") else "")
        )

    rows = [
        ("positions", "positions", "d"),
        ("mean KL", "mean_kl", ".6f"),
        ("median KL", "median_kl", ".6f"),
        ("p99 KL", "p99_kl", ".6f"),
        ("max KL", "max_kl", ".6f"),
        ("top-1 agreement", "top1_agreement", ".2f%"),
        ("RMS Δp", "rms_delta_p", ".3f%"),
        ("PPL(Q)", "ppl", ".4f"),
        ("PPL(base)", "ppl_base", ".4f"),
    ]
    head = f"{'':<16}" + "".join(f"{name:>14}" for name, _ in cols)
    lines = [
        f"KL divergence: {summary.get('tested', '?')}",
        f"  against {summary.get('reference', '?')}",
        "",
        head,
        "-" * len(head),
    ]
    for label, key, fmt in rows:
        lines.append(f"{label:<16}" + "".join(f"{cell(s, key, fmt):>14}" for _, s in cols))
    if summary.get("approximate"):
        lines.append("note: top-k log-probs on one side: an approximation (a lower bound of the full KL)")
    return "\n".join(lines)


def recall_table(result: dict[str, Any]) -> str:
    return format_table(result)


def recall_by_depth(result: dict[str, Any]) -> list[tuple[float, int, int]]:
    """(depth, found, total) over every context length, in the run's depth order."""
    sums: dict[float, list[int]] = {d: [0, 0] for d in result["depths"]}
    for r in result["results"]:
        for d in r["depths"]:
            acc = sums.setdefault(d["depth"], [0, 0])
            acc[0] += d["found"]
            acc[1] += d["total"]
    return [(d, f, t) for d, (f, t) in sums.items()]


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A left-aligned bar of ``fraction`` (clipped to 0..1) of ``width`` cells, in eighths."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(width)


def recall_plot(result: dict[str, Any], width: int = BAR_WIDTH) -> str:
    """Recall per depth (all lengths together) as horizontal bars, 0 at the left and 100% at the right."""
    lines = ["Recall per depth (all context lengths)"]
    for depth, found, total in recall_by_depth(result):
        frac = found / total if total else 0.0
        lines.append(f"depth {depth:>4g} │{bar(frac, width)}│ {frac:6.1%} ({found}/{total})")
    return "\n".join(lines)
