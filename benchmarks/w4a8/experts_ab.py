"""W4A8 against the float products for the CPU's packed experts (``KIMITUI_CPU_W4A8``), alternating in
one process: the shapes of ``benchmarks/vs_llama_cpp.py``'s checkpoints (K2: hidden 1280, 48 experts of
width 384, top-6, INT4 g32; K3: a 640-wide latent, 48 experts of width 768, top-6, MXFP4), bf16
activations, one layer's routed experts per call over a cycle of layers (so each call reads its
experts from memory, not cache).

    python benchmarks/w4a8/experts_ab.py [--batches 1,4,16] [--layers 8] [--rounds 7] [--threads 2]

Per batch: the median time of each path over rounds (the paths alternate within a round), the
ratio, and the packed bytes of the touched experts per second.
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kimitui import engine  # noqa: E402,F401
import torch  # noqa: E402

from kimitui.kernels.cpu import quant_moe as cpu_quant_moe  # noqa: E402
from kimitui.kernels.cpu import quant_moe_layout as layout  # noqa: E402

SHAPES = {"k2": ("int4", 1280, 384, 48, 6), "k3": ("mxfp4", 640, 768, 48, 6)}


def experts(fmt, hidden, inter, e, seed):
    g = torch.Generator().manual_seed(seed)

    def matrix(n, k):
        if fmt == "int4":
            packed = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), generator=g, dtype=torch.int32)
            scale = (torch.rand(e, n, k // 32, generator=g) * 0.02).bfloat16()
        else:
            packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
            scale = torch.randint(118, 124, (e, n, k // 32), generator=g, dtype=torch.uint8)
        return packed, scale

    return cpu_quant_moe.prepare(fmt, *matrix(2 * inter, hidden), *matrix(hidden, inter))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="k2,k3")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=16, help="calls per timing (cycling the layers)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"isa {cpu_quant_moe.isa()}, int8 path {cpu_quant_moe.w4a8()} (paths: {cpu_quant_moe.supported_w4a8()})")
    for shape in a.shapes.split(","):
        fmt, hidden, inter, e, top_k = SHAPES[shape]
        layers = [experts(fmt, hidden, inter, e, s) for s in range(a.layers)]
        per_expert = 2 * layout.matrix_bytes(fmt, inter, hidden) + layout.matrix_bytes(fmt, hidden, inter)
        for n in (int(b) for b in a.batches.split(",")):
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, hidden, generator=g).bfloat16()
            ids = [
                torch.randperm(e, generator=g)[:top_k].repeat(n, 1)
                if n == 1
                else torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(n)])
                for _ in layers
            ]
            wts = torch.rand(n, top_k, generator=g)
            touched = sum(len(set(i.flatten().tolist())) for i in ids) / len(ids)

            def run(path, calls=a.calls):
                t0 = time.perf_counter()
                for c in range(calls):
                    li = c % len(layers)
                    cpu_quant_moe.moe(x, ids[li], wts, fmt, layers[li], None, None, None, w4a8=path)
                return (time.perf_counter() - t0) / calls

            paths = {"float": False, "w4a8": True}
            times = {p: [] for p in paths}
            for p in paths.values():
                run(p, len(layers))  # warm
            for _ in range(a.rounds):
                for name, p in paths.items():
                    times[name].append(run(p))
            med = {k: statistics.median(v) for k, v in times.items()}
            gbs = {k: touched * per_expert / v / 1e9 for k, v in med.items()}
            print(
                f"{shape} {fmt} batch {n:>3}: float {med['float'] * 1e3:.3f} ms ({gbs['float']:.1f} GB/s) | "
                f"w4a8 {med['w4a8'] * 1e3:.3f} ms ({gbs['w4a8']:.1f} GB/s) | float / w4a8 {med['float'] / med['w4a8']:.2f}x"
            )


if __name__ == "__main__":
    main()
