"""The C++ few-row CPU kernels against the PyTorch path they replace, in one process.

linear: ``kernels.cpu_few_rows.linear`` against ``kernels.cpu_linear.linear_cpu`` (row-blocked MKL
products) for 1-24 rows of the 816M benchmark model's shapes and its LM head. moe: one MoE layer
(64 experts, top-6, hidden 1024, expert width 512) through ``cpu_few_rows.moe`` against
``cpu_moe.moe_experts`` for 1-1024 tokens. mla_decode: one layer's absorbed decode
attention (16 heads, latent 256 + rope 32, 256-token contexts) through ``cpu_few_rows.mla_decode``
against ``reference.mla_decode_reference`` for 1-16 sequences. Each case cycles through several weights so
they come from memory, not cache, and keeps the best of ``--repeats`` timings of each side.

    python benchmarks/cpu_few_rows.py [--threads N] [--repeats 3] [--dtype bfloat16] [--only linear,moe,mla]

``--dtype bfloat16``: bf16 weights, activations and latent cache on both sides (the C++ kernels
widen bf16 in registers and sum in float32; the PyTorch side is oneDNN's bf16 products, AMX where
the CPU has it), and the C++ float32 time of the same shape beside them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimitui.kernels import reference
from kimitui.kernels.cpu import few_rows as cpu_few_rows  # noqa: E402
from kimitui.kernels.cpu import linear as cpu_linear
from kimitui.kernels.cpu import moe as cpu_moe

LINEAR_SHAPES = [
    (1024, 1024, "expert w13"),
    (1024, 512, "expert w2"),
    (5632, 1024, "dense w13"),
    (32000, 1024, "LM head"),
]
LINEAR_ROWS = [1, 2, 3, 4, 8, 16, 24]
MOE_TOKENS = [1, 4, 16, 64, 128, 256, 512, 1024]


def best_time(fn, repeats: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def cycling(fn, weights):
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        return fn(weights[state["i"]])

    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--only", default="linear,moe,mla", help="comma-separated subset of linear, moe, mla")
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    only = set(args.only.split(","))
    tol = dict(rtol=1e-4, atol=1e-3) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    if not cpu_few_rows.available():
        print("the C++ extension does not build here; nothing to compare")
        return 1
    print(f"threads: {args.threads} | extension ready in {time.perf_counter() - t:.1f} s | torch {torch.__version__}")
    torch.manual_seed(0)

    size = torch.finfo(dt).bits // 8
    f32_col = f"{'C++ f32 us':>12}" if dt != torch.float32 else ""
    if "linear" in only:
        print(
            f"\n{'linear ' + args.dtype:<24}{'rows':>5}{'PyTorch us':>12}{'C++ us':>10}{'ratio':>8}{'C++ GB/s':>10}"
            f"{f32_col}"
        )
    for n, k, name in LINEAR_SHAPES if "linear" in only else []:
        weights = [torch.randn(n, k).to(dt) for _ in range(max(2, (256 << 20) // (n * k * size)))]
        for m in LINEAR_ROWS:
            x = torch.randn(m, k).to(dt)
            torch.testing.assert_close(cpu_few_rows.linear(x, weights[0]), cpu_linear.linear_cpu(x, weights[0]), **tol)
            base = best_time(cycling(lambda w: cpu_linear.linear_cpu(x, w), weights), args.repeats, 20)
            ours = best_time(cycling(lambda w: cpu_few_rows.linear(x, w), weights), args.repeats, 20)
            extra = ""
            if dt != torch.float32:
                w32, x32 = [w.float() for w in weights[: max(2, len(weights) // 2)]], x.float()
                extra = (
                    f"{best_time(cycling(lambda w: cpu_few_rows.linear(x32, w), w32), args.repeats, 20) * 1e6:>12.0f}"
                )
            print(
                f"{name + f' {n}x{k}':<24}{m:>5}{base * 1e6:>12.0f}{ours * 1e6:>10.0f}{base / ours:>7.2f}x"
                f"{n * k * size / ours / 1e9:>10.1f}{extra}"
            )

    e, d, inter, top_k = 64, 1024, 512, 6
    layers = (
        [((torch.randn(e, 2 * inter, d) * 0.03).to(dt), (torch.randn(e, d, inter) * 0.03).to(dt)) for _ in range(3)]
        if "moe" in only
        else []
    )
    if "moe" in only:
        print(f"\n{'MoE layer (64 experts)':<24}{'tokens':>7}{'PyTorch ms':>12}{'C++ ms':>9}{'ratio':>8}")
    for tokens in MOE_TOKENS if "moe" in only else []:
        x = torch.randn(tokens, d).to(dt)
        weights, ids = torch.randn(tokens, e).softmax(-1).topk(top_k)
        torch.testing.assert_close(
            cpu_few_rows.moe(x, ids, weights, *layers[0]), cpu_moe.moe_experts(x, ids, weights, *layers[0]), **tol
        )
        calls = max(2, 64 // tokens)
        base = best_time(cycling(lambda w: cpu_moe.moe_experts(x, ids, weights, *w), layers), args.repeats, calls)
        ours = best_time(cycling(lambda w: cpu_few_rows.moe(x, ids, weights, *w), layers), args.repeats, calls)
        print(f"{'':<24}{tokens:>7}{base * 1e3:>12.2f}{ours * 1e3:>9.2f}{base / ours:>7.2f}x")

    heads, r, rope, block_size, context = 16, 256, 32, 16, 256
    if "mla" in only:
        print(f"\n{'MLA decode (1 layer)':<24}{'seqs':>7}{'PyTorch ms':>12}{'C++ ms':>9}{'ratio':>8}")
    for seqs in (1, 4, 16) if "mla" in only else []:
        blocks = context // block_size
        cache = torch.randn(seqs * blocks * block_size * 4, r + rope).to(dt)  # contexts scattered over a larger cache
        tables = torch.randperm(seqs * blocks * 4)[: seqs * blocks].view(seqs, blocks).int()
        lens = torch.full((seqs,), context, dtype=torch.int32)
        q = torch.randn(seqs, heads, r + rope).to(dt)
        want = reference.mla_decode_reference(q, cache, tables, lens, context, block_size, r, 0.1)
        torch.testing.assert_close(
            cpu_few_rows.mla_decode(q, cache, tables, lens, block_size, r, 0.1),
            want,
            **(dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else tol),
        )
        base = best_time(
            lambda: reference.mla_decode_reference(q, cache, tables, lens, context, block_size, r, 0.1),
            args.repeats,
            20,
        )
        ours = best_time(lambda: cpu_few_rows.mla_decode(q, cache, tables, lens, block_size, r, 0.1), args.repeats, 20)
        print(f"{'':<24}{seqs:>7}{base * 1e3:>12.2f}{ours * 1e3:>9.2f}{base / ours:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
