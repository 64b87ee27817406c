"""Where a Kimi K3 batch-1 CPU decode step goes, and the C++ K3 decode pieces against the PyTorch paths
they replace, alternating in one process.

    python benchmarks/k3_cpu_step.py MODEL_DIR [--rounds 5] [--tokens 24] [--prompt 64] [--threads 2]
        [--dtype bfloat16] [--no-profile]

MODEL_DIR: a K3-shaped checkpoint, e.g. the one ``benchmarks/vs_llama_cpp.py`` writes into its work
dir (``<work-dir>/k3-mxfp4``). Two parts:

1. **Profile** (unless ``--no-profile``): wall time per decode step spent in each module and backend
   op (forward hooks and wrappers; nested entries overlap: ``RoutedExperts`` holds the shared experts,
   which run in its join hook; ``LMHead`` is the logits' product).
2. **A/B**: one request of ``--tokens`` greedy tokens after a ``--prompt``-token prefill, alternately
   with the C++ pieces (``kernels.cpu.k3_decode``: KDA decode, attention-residual mix + norm, SiTU;
   the bf16 router and bf16 MLA decode in the few-row kernels) and with the PyTorch paths they
   replaced (``Backend``'s methods on the same backend object); medians over ``--rounds`` of the
   per-step median, wall and CPU clocks (CPU seconds of the process over the step: closer to the time
   alone when other jobs share the cores).
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimitui.engine import LLM, SamplingParams  # noqa: E402 - before torch: OpenMP's wait policy

import torch  # noqa: E402

from kimitui.kernels import reference  # noqa: E402
from kimitui.kernels.backend import Backend  # noqa: E402

_OPS = ("linear", "kda_decode", "attn_res_mix_norm", "rms_norm", "moe_route", "gated_act", "mla_decode", "bmm")
_MODULES = ("KimiDeltaAttention", "MLAttention", "KimiMoE", "RoutedExperts", "Router", "LMHead", "MLP")


def _pytorch_paths(ops, on: bool) -> None:
    """Point ``ops`` (a CpuBackend) at the PyTorch paths the C++ K3 pieces replaced (on), or back."""
    for name in ("moe_route", "mla_decode", "k3_cxx"):
        ops.__dict__.pop(name, None)
    if on:
        ops.k3_cxx = False  # KDA decode, the mixes and SiTU: Backend's PyTorch ops
        ops.moe_route = functools.partial(Backend.moe_route, ops)
        ops.mla_decode = lambda q, cache, tables, lens, max_len, bs, r, scale: reference.mla_decode_reference(
            q, cache, tables, lens, max_len, bs, r, scale
        )


def _decode(eng, params, prompt: int) -> tuple[list[float], list[float]]:
    eng.add_request(None, list(range(1, prompt + 1)), params)
    eng.step()  # prefill
    wall, cpu = [], []
    while eng.has_unfinished_requests():
        w, c = time.perf_counter(), time.process_time()
        eng.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return wall, cpu


def profile(eng, params, prompt: int) -> None:
    model, ops = eng.runner.model, eng.runner.model.model.ops
    acc, calls, on = collections.defaultdict(float), collections.Counter(), [False]

    def timed(f, label):
        def g(*a, **k):
            if not on[0]:
                return f(*a, **k)
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t
                calls[label] += 1

        return g

    originals = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in _MODULES:
            label = f"{name.rsplit('.', 1)[-1]} (MLP)" if kind == "MLP" else kind
            originals.append((m, "forward", m.forward))
            m.forward = timed(m.forward, label)
    for op in _OPS:
        originals.append((ops, op, None))
        setattr(ops, op, timed(getattr(ops, op), f"ops.{op}"))
    on[0] = True
    wall, _ = _decode(eng, params, prompt)
    on[0] = False
    for obj, attr, f in originals:
        if f is None:
            obj.__dict__.pop(attr, None)
        else:
            obj.forward = f
    n = len(wall)
    print(f"profile: {n} decode steps, median {statistics.median(wall) * 1e3:.1f} ms (wall)")
    print("| module or op | ms per step | calls per step |\n|---|---|---|")
    for label, s in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {s / n * 1e3:.2f} | {calls[label] / n:.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=args.prompt + args.tokens + 8,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    eng = llm.engine
    ops = eng.runner.model.model.ops
    if not getattr(ops, "k3_cxx", False):
        raise SystemExit(f"{ops!r}: no C++ K3 decode kernels here (KIMITUI_CPU_KERNELS=0, or they did not build)")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for pytorch in (True, False):  # warm-up: first touch, lazy builds
        _pytorch_paths(ops, pytorch)
        _decode(eng, params, args.prompt)
    if not args.no_profile:
        for pytorch in (True, False):
            _pytorch_paths(ops, pytorch)
            print(f"\n{'PyTorch K3 paths' if pytorch else 'C++ K3 pieces'}:")
            profile(eng, params, args.prompt)
    res = {k: {"wall": [], "cpu": []} for k in ("pytorch", "cxx")}
    print()
    for r in range(args.rounds):
        for key in ("pytorch", "cxx"):
            _pytorch_paths(ops, key == "pytorch")
            wall, cpu = _decode(eng, params, args.prompt)
            res[key]["wall"].append(statistics.median(wall))
            res[key]["cpu"].append(statistics.median(cpu))
        print(
            f"round {r + 1}: PyTorch paths {res['pytorch']['wall'][-1] * 1e3:.1f} ms, C++ pieces "
            f"{res['cxx']['wall'][-1] * 1e3:.1f} ms per step | load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    _pytorch_paths(ops, False)
    for clock in ("wall", "cpu"):
        a, b = statistics.median(res["pytorch"][clock]), statistics.median(res["cxx"][clock])
        print(f"{clock}: PyTorch paths {a * 1e3:.1f} ms, C++ pieces {b * 1e3:.1f} ms per step: {a / b:.2f}x")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
