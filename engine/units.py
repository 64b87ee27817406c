"""Byte units and integer ceiling division, defined once for the planner, the placement and the
block manager."""

from __future__ import annotations

GiB = 1 << 30  # the unit published checkpoint sizes, rocm-smi and nvidia-smi use


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers, without floats."""
    return -(-a // b)
