"""One short check for a CUDA/ROCm machine: the Triton kernels against their PyTorch references
(bf16, Kimi K2 shapes: time and agreement), then the engine's decode speed on a random
DeepSeek-V3-architecture checkpoint. Meant to be run once when a GPU is at hand, after
``pytest -m gpu tests``:

    python benchmarks/gpu_check.py [--skip-engine]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, repeats: int = 20) -> float:
    """Best wall time of ``fn`` in seconds, the device synchronised around each call."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def row(name: str, fast: float, slow: float, err: float, nbytes: int | None = None) -> None:
    bw = f"{nbytes / fast / 1e9:8.0f} GB/s" if nbytes else " " * 13
    print(f"{name:<44}{fast * 1e6:10.0f} us{slow * 1e6:12.0f} us{slow / fast:8.1f}x{bw}  err {err:.1e}")


def kernels(dev: torch.device) -> None:
    from kernels import dispatch
    from kernels import reference as ref

    print(f"{'kernel (bf16)':<44}{'triton':>13}{'reference':>15}{'ratio':>9}")
    # MLA decode, K2 per-rank heads at TP 4: 16 heads, latent 512 + rope 64, block 16
    r, rope, heads, block = 512, 64, 16, 16
    for batch, ctx in ((1, 4096), (32, 4096), (64, 16384)):
        blocks = -(-ctx // block)
        table = torch.randperm(batch * blocks, device=dev).view(batch, blocks).to(torch.int32)
        cache = torch.randn(batch * blocks * block, r + rope, device=dev, dtype=torch.bfloat16)
        q = torch.randn(batch, heads, r + rope, device=dev, dtype=torch.bfloat16)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        args = (q, cache, table, lens, ctx, block, r, 0.04)
        fast = timed(lambda: dispatch.mla_decode(*args))
        slow = timed(lambda: ref.mla_decode_reference(*args), repeats=3)
        err = rel_err(dispatch.mla_decode(*args), ref.mla_decode_reference(*args))
        row(f"mla_decode B={batch} ctx={ctx}", fast, slow, err, batch * ctx * (r + rope) * 2)
    # Fused MoE, K2 expert shapes per rank at EP 8: 48 experts, hidden 7168, inter 2048, top-8
    e, d, inter, k = 48, 7168, 2048, 8
    w13 = (torch.randn(e, 2 * inter, d, device=dev) / 64).bfloat16()
    w2 = (torch.randn(e, d, inter, device=dev) / 32).bfloat16()
    p13, s13 = (torch.stack(t) for t in zip(*[ref.quantize_int4(w13[i]) for i in range(e)]))
    p2, s2 = (torch.stack(t) for t in zip(*[ref.quantize_int4(w2[i]) for i in range(e)]))
    for t in (1, 64, 2048):
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        weights, ids = torch.rand(t, e, device=dev).topk(k, dim=-1)
        dense = (x, ids, weights, w13, w2)
        fast = timed(lambda: dispatch.moe_experts(*dense), repeats=5)
        slow = timed(lambda: ref.moe_experts_reference(*dense), repeats=2)
        row(f"fused_moe dense T={t}", fast, slow, rel_err(dispatch.moe_experts(*dense), ref.moe_experts_reference(*dense)))
        quant = (x, ids, weights, p13, s13, p2, s2)
        fast = timed(lambda: dispatch.moe_experts_w4a16(*quant), repeats=5)
        slow = timed(lambda: ref.moe_experts_reference_w4a16(*quant), repeats=2)
        row(f"fused_moe int4 T={t}", fast, slow,
            rel_err(dispatch.moe_experts_w4a16(*quant), ref.moe_experts_reference_w4a16(*quant)))


def engine(dev: torch.device) -> None:
    from benchmarks.cpu_vs_transformers import CONFIG, write_checkpoint
    from engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="kimitui-gpu-") as tmp:
        path = Path(tmp)
        write_checkpoint(path)  # the 816M DeepSeek-V3-architecture checkpoint of the CPU benchmark
        llm = LLM(str(path), device=str(dev), dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
                  enable_prefix_caching=False)
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))  # warm-up, compiles
        print(f"\n{'engine, 816M model, bf16, 512 prompt / 128 new':<48}{'tok/s':>10}{'TTFT ms':>10}{'TPOT ms':>10}")
        for concurrency in (1, 16, 64):
            prompts = torch.randint(0, CONFIG["vocab_size"], (concurrency, 512), generator=g).tolist()
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            dt = time.perf_counter() - t
            ttft = sorted(o.metrics.ttft for o in outs)[len(outs) // 2]
            tpot = sorted(o.metrics.tpot for o in outs)[len(outs) // 2]
            print(f"{f'{concurrency} concurrent':<48}{concurrency * 128 / dt:10.1f}{ttft * 1e3:10.1f}{tpot * 1e3:10.2f}")
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA/ROCm device: nothing to check", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)} | torch {torch.__version__} | hip {torch.version.hip} | "
          f"cuda {torch.version.cuda}")
    kernels(dev)
    if not args.skip_engine:
        engine(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
