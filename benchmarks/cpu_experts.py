"""CPU experts at Kimi shapes: packed INT4 / MXFP4 MoE kernels against torch's int4 GEMM, a dense
float32 GEMM of the same shape, kt-kernel (when importable), and the machine's read bandwidth.

Routed experts in host RAM (``--cpu-offload``, or every expert of a CPU-only run) are computed by
``kernels.cpu_quant_moe``. A decode step reads every expert some token was routed to, so the figure
that matters at small batches is packed bytes of the distinct experts touched per second, over the
read bandwidth measured here (a float32 sum over 1 GiB, same threads). Large batches are compute
bound: there the comparison is a dense float32 GEMM with the same token counts per expert.

    python benchmarks/cpu_experts.py [--shapes k2,k3] [--formats int4,mxfp4] [--batches 1,4,16,64,256]
        [--experts 32] [--top-k 8] [--threads 2] [--repeats 3] [--no-kt]

Weights are random packed bytes and scales (a kernel's speed does not depend on their values).
kt-kernel runs when ``import kt_kernel`` works in this interpreter (see benchmarks/README.md for how
it was installed); ``benchmarks/kt_experts.py`` writes the same weights in its checkpoint layout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_moe, cpu_quant_moe, reference as R  # noqa: E402

SHAPES = {"k2": (7168, 2048), "k3": (3584, 3072)}  # (hidden, expert width): Kimi K2, K3 latent


def read_bandwidth(clock: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second by a float32 sum over ``nbytes`` (torch's threads), on the same clock as
    the kernels (see best_time)."""
    src = torch.ones(nbytes // 4)
    return nbytes / best_time(src.sum, repeats, clock)


def packed_experts(fmt: str, e: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        if fmt == "int4":
            out[name] = torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), dtype=torch.int32, generator=g)
            out[f"{name}_scale"] = (torch.rand(e, n, k // 32, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
        else:
            out[name] = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
            out[f"{name}_scale"] = torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8, generator=g)
    return out


def best_time(fn, repeats: int, clock: str) -> float:
    """Best of ``repeats`` after a warm-up call. ``clock="cpu"``: this process's CPU seconds over its
    thread count, which on a machine shared with other jobs stays near the time the step takes alone
    (wall time there grows with every other process); ``"wall"``: elapsed seconds."""
    fn()  # warm-up (first touch, lazy builds)
    best = float("inf")
    now = time.perf_counter if clock == "wall" else time.process_time
    scale = 1 if clock == "wall" else torch.get_num_threads()
    for _ in range(repeats):
        t = now()
        fn()
        best = min(best, (now() - t) / scale)
    return best


def dense_step(x, ids, w13, w2):
    # The same token counts per expert through float32 BLAS, one expert's dense weights reused for all
    # (same FLOPs and matrix shapes; the weights are far larger than the caches either way).
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows = (ids == e).any(dim=1).nonzero().squeeze(1)
        gu = x[rows] @ w13.t()
        inter = gu.shape[1] // 2
        out.index_add_(0, rows, (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2.t())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="k2,k3")
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-kt", action="store_true", help="skip kt-kernel even when importable")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="wall", help="see best_time")
    ap.add_argument("--dense-from", type=int, default=64, help="time the dense GEMM from this batch on")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kt = None
    if not args.no_kt:
        try:
            from benchmarks import kt_experts as kt
        except Exception as exc:  # not installed, or its import fails here: say why, go on
            print(f"kt-kernel: not run ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    bw = read_bandwidth(args.clock)
    print(f"threads {args.threads} | read bandwidth {bw / 1e9:.2f} GB/s | ISA {cpu_quant_moe.isa()} | "
          f"{args.experts} experts, top-{args.top_k} | {args.clock} clock | "
          f"{kt.variant() if kt is not None else 'kt-kernel not run'}")
    print("| shape | format | batch | ours bf16 ms | ours fp32 ms | GB/s (bf16) | % read bw bf16 / fp32 "
          "| torch int4pack ms | kt-kernel ms | dense fp32 ms | vs int4pack | vs kt | vs dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        hidden, inter = SHAPES[shape]
        for fmt in args.formats.split(","):
            w = packed_experts(fmt, args.experts, hidden, inter)
            per_expert = sum(t[0].numel() * t.element_size() for t in w.values())
            packs = None
            if fmt == "int4" and cpu_moe.int4pack_cpu_supported(2 * inter, hidden, 32):
                packs = [[cpu_moe.prepack_int4_cpu(w[n][i], w[f"{n}_scale"][i], k, 32, torch.bfloat16)
                          for i in range(args.experts)] for n, k in (("w13", hidden), ("w2", inter))]
                packs = [torch.stack([p[0] for p in packs[0]]), torch.stack([p[1] for p in packs[0]]),
                         torch.stack([p[0] for p in packs[1]]), torch.stack([p[1] for p in packs[1]])]
            kt_run = kt.prepare(fmt, w, hidden, inter, args) if kt is not None else None
            tiled = cpu_quant_moe.prepare(fmt, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])  # once, as at load
            dense13, dense2 = torch.randn(2 * inter, hidden) * 0.02, torch.randn(hidden, inter) * 0.02
            for batch in (int(b) for b in args.batches.split(",")):
                g = torch.Generator().manual_seed(batch)
                x = torch.randn(batch, hidden, generator=g)
                ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k] for _ in range(batch)])
                tw = torch.rand(batch, args.top_k, generator=g)
                xb = x.bfloat16()
                def step(xx):
                    return cpu_quant_moe.moe(xx, ids, tw, fmt, tiled, None, None, None)

                ours = {dt: best_time(lambda xx=xx: step(xx), args.repeats, args.clock)
                        for dt, xx in (("bf16", xb), ("fp32", x))}
                int4pack = (best_time(lambda: cpu_moe.moe_experts_int4pack_cpu(xb, ids, tw.bfloat16(), *packs, 32),
                                      args.repeats, args.clock) if packs is not None else None)
                kt_t = best_time(lambda: kt_run(xb, ids, tw), args.repeats, args.clock) if kt_run is not None else None
                dense = (best_time(lambda: dense_step(x, ids, dense13, dense2), args.repeats, args.clock)
                         if batch >= args.dense_from else None)
                touched = ids.unique().numel() * per_expert
                rate = touched / ours["bf16"]

                def ms(t):
                    return "-" if t is None else f"{t * 1e3:.1f}"

                def ratio(t):
                    return "-" if t is None else f"{t / ours['bf16']:.2f}x"

                print(f"| {shape} {hidden}/{inter} | {fmt} | {batch} | {ms(ours['bf16'])} | {ms(ours['fp32'])} | "
                      f"{rate / 1e9:.2f} | {rate / bw:.0%} / {touched / ours['fp32'] / bw:.0%} | {ms(int4pack)} | "
                      f"{ms(kt_t)} | {ms(dense)} | {ratio(int4pack)} | {ratio(kt_t)} | {ratio(dense)} |", flush=True)
            del w, packs, kt_run, tiled
    return 0


if __name__ == "__main__":
    sys.exit(main())
