"""The C++ few-row kernels as the install compiles them (x86-64-v3, or plain x86-64) against the same
sources compiled with -march=native for this CPU, in one process, alternating.

The wheel cannot know its user's CPU, so it ships portable variants (kernels/cpu/build.py); this says what
that costs here. ``-march=native`` is compiled just in time on the first run (cached afterwards).

    python -m benchmarks.cpu_variants [--repeats 7] [--rows 1,4,16]
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

from kimitui.kernels.cpu import build as _build  # the engine's OpenMP settings before torch, as the engine runs

import torch  # noqa: E402

SHAPES = [
    ("K2 q_a_proj-like 1536x7168", 1536, 7168),
    ("expert w13 4096x2048", 4096, 2048),
    ("dense 7168x2048", 7168, 2048),
]


def _variant(name: str):
    os.environ[_build.ENV_VARIANT] = name
    try:
        return _build.load_extension(_build.FEW_ROWS, logging.getLogger("cpu_variants"), f"few-row kernels ({name})")
    finally:
        del os.environ[_build.ENV_VARIANT]


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        samples.append((time.perf_counter() - t0) / 20)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,4,16")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    installed = _build.variant_for(_build.FEW_ROWS)
    mods = {installed: _variant(installed), "native": _variant("native")}
    print(f"installed variant: {installed}; torch threads {torch.get_num_threads()}")
    print(f"{'shape':<28}{'dtype':>9}{'rows':>5}{installed + ' us':>16}{'native us':>12}{'native/installed':>18}")
    for label, n, k in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(n, k).to(dtype)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k).to(dtype)
                a = b = 0.0
                for _ in range(2):  # alternate: this host's speed moves within minutes
                    a += _time(lambda: mods[installed].linear(x, w), args.repeats)
                    b += _time(lambda: mods["native"].linear(x, w), args.repeats)
                print(
                    f"{label:<28}{str(dtype).split('.')[1]:>9}{rows:>5}{a / 2 * 1e6:>16.1f}{b / 2 * 1e6:>12.1f}"
                    f"{b / a:>18.2f}"
                )


if __name__ == "__main__":
    main()
