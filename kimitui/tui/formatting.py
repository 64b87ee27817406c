"""How numbers look in the panels. A missing reading is "n/a", never a made-up number."""

from __future__ import annotations

NA = "n/a"


def num(value: float | None, fmt: str = ".1f", unit: str = "") -> str:
    if value is None:
        return NA
    return f"{value:{fmt}}{(' ' + unit) if unit else ''}"


def ms(seconds: float | None) -> str:
    return NA if seconds is None else f"{seconds * 1000:.1f} ms"


def pct(fraction_or_pct: float | None, *, fraction: bool = False) -> str:
    if fraction_or_pct is None:
        return NA
    return f"{fraction_or_pct * (100 if fraction else 1):.0f}%"


def gib(num_bytes: int | float | None, digits: int = 1) -> str:
    return NA if num_bytes is None else f"{num_bytes / 2**30:.{digits}f}"


def used_total(used: int | None, total: int | None, unit: str = "GiB", digits: int = 1) -> str:
    if used is None and total is None:
        return NA
    return f"{gib(used, digits)}/{gib(total, digits)} {unit}"


def count(n: int | None) -> str:
    """Parameter counts and the like: 13.2M, 1.03T."""
    if n is None:
        return NA
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def bar(fraction: float | None, width: int) -> str:
    """A text bar ``█████░░░`` for a 0..1 fraction; blank-dotted when unknown."""
    if width <= 0:
        return ""
    if fraction is None:
        return "·" * width
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return NA
    seconds = max(0, int(round(seconds)))
    m, s = divmod(seconds, 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def clean(text: str) -> str:
    """Drop control characters (random-weight models emit them) that would upset a terminal."""
    return "".join(c for c in text if c in "\n\t" or (c >= " " and not 0x7F <= ord(c) <= 0x9F))


SPARK = "▁▂▃▄▅▆▇█"


def spark(values, floor: float = 0.0) -> str:
    """A one-line text sparkline of ``values`` (None drawn as a space), scaled from ``floor`` to the
    largest value."""
    known = [v for v in values if v is not None]
    if not known:
        return ""
    top = max(known)
    span = (top - floor) or 1.0
    return "".join(
        " " if v is None else SPARK[min(len(SPARK) - 1, max(0, round((v - floor) / span * (len(SPARK) - 1))))]
        for v in values
    )
