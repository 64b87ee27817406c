"""The CPU expert executor: expert weights processed per second at decode batch sizes 1, 4, 16,
against the machine's memory copy bandwidth.

Routed experts that live in host RAM (``--cpu-offload``) are computed by the CPU. A decode step
reads every expert some token was routed to, so the executor is memory bound; this prints how
close it gets to the bandwidth a plain tensor copy reaches, for dense fp32 and INT4 experts.

    python benchmarks/cpu_experts.py [--hidden 2048] [--inter 768] [--experts 32] [--top-k 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_transformers import copy_bandwidth  # noqa: E402  (the same copy measure)


def build_stack(fmt: str, hidden: int, inter: int, experts: int):
    from engine.config import ModelConfig, QuantConfig
    from engine.layers.moe import ExpertStack
    from kernels import reference as R
    from kernels.backend import select_backend
    from kernels.settings import KernelSettings

    quant = QuantConfig(method="int4", group_size=32) if fmt == "int4" else None
    cfg = ModelConfig.from_dict({
        "model_type": "kimi_k2", "vocab_size": 8, "hidden_size": hidden, "intermediate_size": inter,
        "moe_intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 1, "kv_lora_rank": 8,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": experts,
        "num_experts_per_tok": 1, "max_position_embeddings": 16})
    cfg = type(cfg)(**{**cfg.__dict__, "quantization": quant})
    stack = ExpertStack(cfg, fmt, experts, torch.device("cpu"))
    stack.ops = select_backend("cpu", torch.float32, KernelSettings.from_env())  # as the model's post_load does
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for e in range(experts):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                w = torch.randn(*shape, generator=g) * 0.02
                if fmt == "int4":
                    packed, scale = R.quantize_int4(w, 32)
                    stack.load(e, proj, "weight_packed", packed)
                    stack.load(e, proj, "weight_scale", scale.to(torch.bfloat16))
                else:
                    stack.load(e, proj, "weight", w)
    per_expert = sum(p[0].numel() * p.element_size() for p in stack.parameters())
    return stack, per_expert


def measure(stack, per_expert: int, batch: int, hidden: int, experts: int, top_k: int, repeats: int = 5,
            dtype: torch.dtype = torch.float32):
    from engine.offload.cpu_experts import CpuExpertExecutor

    executor = CpuExpertExecutor(stack, torch.arange(experts))
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(batch)])
    w = torch.full((batch, top_k), 1.0 / top_k, dtype=dtype)
    executor.submit(x, ids, w).result()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        executor.submit(x, ids, w).result()
        best = min(best, time.perf_counter() - t)
    touched = ids.unique().numel() * per_expert
    return touched / best, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"threads {torch.get_num_threads()} | copy bandwidth (read+write) {bw / 1e9:.2f} GB/s | "
          f"{args.experts} experts of hidden {args.hidden} x inter {args.inter}, top-{args.top_k}")
    print(f"{'format':<14}{'batch':>6}{'step ms':>10}{'expert GB/s':>13}{'of copy bw':>12}")
    # int4: the checkpoint layout, dequantised per call (fp32 models, and the fallback); int4pack:
    # the same weights converted at load to torch's CPU int4 GEMM, which the engine uses for bf16
    # activations (every GPU run: host experts get bf16 activations).
    rows = [("dense", "dense", torch.float32), ("int4", "int4", torch.float32), ("int4", "int4", torch.bfloat16),
            ("int4pack", "int4", torch.bfloat16)]
    for name, fmt, dtype in rows:
        stack, per_expert = build_stack(fmt, args.hidden, args.inter, args.experts)
        if name == "int4pack" and not stack.prepack_for_cpu(dtype):
            print(f"{name:<8} not supported by this torch")
            continue
        label = f"{name} {str(dtype).replace('torch.', '').replace('float32', 'fp32').replace('bfloat16', 'bf16')}"
        for batch in (1, 4, 16):
            rate, step = measure(stack, per_expert, batch, args.hidden, args.experts, args.top_k, dtype=dtype)
            print(f"{label:<14}{batch:>6}{step * 1e3:>10.1f}{rate / 1e9:>13.2f}{rate / bw:>12.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
