"""The few-row MoE (``kernels/cpu/few_rows.py`` ``moe``) on bf16 experts: the AMX-BF16 expert product
(``cpu_moe_amx.cpp``, the weight as the A operand as it lies) against the earlier path (widening loops
below 6 pairs, oneDNN's bf16 product from 6 on), alternating in one process.

    python benchmarks/cpu_moe_amx.py [--rows 8,16,32,64,128] [--per-expert 1,2,4,6,8,16,32,64]
        [--lm-rows 17,32,64,128] [--vocab 32000]
        [--hidden 1024] [--inter 256] [--experts 32] [--top-k 4] [--layers 7] [--repeats 15]

``--lm-rows``: the LM head (``--vocab`` x hidden, bf16) at those row counts, ``linear_amx`` against
``F.linear`` (oneDNN, which lays the weight out again on every call), bf16 rows in and out.

``--rows``: T rows per layer routed at random (top-k of E, uniform, as random weights route), the
decode step's case; ``--per-expert``: every expert gets exactly m pairs (the crossover). Each timed
call runs the MoE of ``--layers`` layers, each with its own experts (the defaults are the bf16
checkpoint of benchmarks/vs_vllm_cpu.py: 7 MoE layers, 48 MB of experts each, so the weights come
from memory, as in a decode step), and the two paths take turns call by call; the table gives medians
per layer of wall time and of CPU time (this process's CPU seconds over its threads, closer to the
time alone on a shared machine) and new / old ratios. Needs a CPU with AMX-BF16 (says so and stops
elsewhere).
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimitui import engine  # noqa: E402,F401
import torch  # noqa: E402

from kimitui.kernels.cpu import few_rows  # noqa: E402

OFF = (1 << 40, 0)  # moe_amx_rows(lo, hi) with lo > hi: no expert on AMX


def layers(n: int, e: int, hidden: int, inter: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w13 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, hidden, inter, generator=g) / inter**0.5).to(torch.bfloat16)
        out.append((w13, w2))
    return out


def random_routing(t: int, e: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


def even_routing(m: int, e: int, k: int) -> torch.Tensor:
    """Every expert gets exactly m pairs: T = e * m / k tokens (rounded up), ids round robin."""
    t = -(-e * m // k)
    ids = (torch.arange(t * k) % e).view(t, k)
    return ids


def time_pair(old, new, repeats: int) -> dict[str, list[float]]:
    """Alternate old() and new(), call by call, each first in every other round; per call wall and
    CPU seconds."""
    threads = torch.get_num_threads()
    times = {"old_wall": [], "new_wall": [], "old_cpu": [], "new_cpu": []}
    for i in range(repeats + 1):
        for name, fn in (("old", old), ("new", new)) if i % 2 else (("new", new), ("old", old)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            w1, c1 = time.perf_counter(), time.process_time()
            if i:  # the first round warms both up
                times[f"{name}_wall"].append(w1 - w0)
                times[f"{name}_cpu"].append((c1 - c0) / threads)
    return times


def row(label: str, tm: dict[str, list[float]], per: int = 1) -> str:
    med = {k: statistics.median(v) * 1e3 / per for k, v in tm.items()}
    return (
        f"| {label} | {med['old_wall']:.3f} | {med['new_wall']:.3f} | {med['old_wall'] / med['new_wall']:.2f}x | "
        f"{med['old_cpu']:.3f} | {med['new_cpu']:.3f} | {med['old_cpu'] / med['new_cpu']:.2f}x |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-rows", default="17,32,64,128")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", default="8,16,32,64,128")
    ap.add_argument("--per-expert", default="1,2,4,6,8,16,32,64")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not few_rows.available() or not few_rows._module().moe_amx_usable():
        print("this CPU (or OS, or build) has no usable AMX-BF16: nothing to compare")
        return 1
    mod = few_rows._module()
    saved_rows = mod.moe_amx_rows(1, 1 << 40)
    mod.moe_amx_rows(*saved_rows)

    def with_rows(rows, fn):
        def run():
            mod.moe_amx_rows(*rows)
            try:
                fn()
            finally:
                mod.moe_amx_rows(*saved_rows)

        return run

    print(
        f"hidden {args.hidden}, expert width {args.inter}, {args.experts} experts top-{args.top_k}, "
        f"{args.layers} layers, {torch.get_num_threads()} threads, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    print("| case | old ms/layer | new ms/layer | new/old speed | old CPU ms | new CPU ms | CPU speed |")
    print("|---|---|---|---|---|---|---|")
    lm_rows = [int(r) for r in args.lm_rows.split(",") if r]
    if lm_rows:
        head = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5).to(torch.bfloat16)
        for m in lm_rows:
            x = torch.randn(m, args.hidden).to(torch.bfloat16)
            tm = time_pair(
                lambda: torch.nn.functional.linear(x, head), lambda: few_rows.linear_amx(x, head), args.repeats
            )
            print(row(f"LM head {args.vocab} x {args.hidden}, {m} rows (ms/call)", tm), flush=True)
        del head
    ws = layers(args.layers, args.experts, args.hidden, args.inter)
    scratch = torch.empty(0)
    cases = [("rows", int(r)) for r in args.rows.split(",") if r] + [
        ("pairs/expert", int(m)) for m in args.per_expert.split(",") if m
    ]
    for kind, n in cases:
        if kind == "rows":
            ids = random_routing(n, args.experts, args.top_k, seed=n)
        else:
            ids = even_routing(n, args.experts, args.top_k)
        t = ids.shape[0]
        x = torch.randn(t, args.hidden)
        wts = torch.rand(t, args.top_k)

        def run():
            for w13, w2 in ws:
                few_rows.moe(x, ids, wts, w13, w2, scratch)

        tm = time_pair(with_rows(OFF, run), with_rows((1, 1 << 40), run), args.repeats)
        print(row(f"MoE, {n} {kind}", tm, args.layers), flush=True)
    print(f"load average at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
