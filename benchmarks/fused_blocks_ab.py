"""The CPU's one-call paths against what they replace, alternating in one process, whole requests:

- ``packed-ffn``: a packed-expert layer's FFN half as one C++ call (``packed_ffn_block``) against the one-call
  Python block (``PackedFfnBlock``, the same kernels with Python between);
- ``loop``: a decode step's layers in one loop of C++ calls (``Backend.run_fused_layers``) against the layers
  called one by one;
- ``k3-moe``: Kimi K3's (latent) MoE as one C++ call (``latent_moe_block``) against the module op by op;
- ``k3-attention``: Kimi K3's attention layers' decode steps as one C++ call each (``kda_block``, the gated NoPE
  ``attention_block``: ``kernels/cpu/k3_blocks.py``) against the layers op by op.

    python benchmarks/fused_blocks_ab.py --model DIR --what packed-ffn|loop|k3-moe|k3-attention [--dtype bfloat16]
        [--prompt 64] [--tokens 64] [--rounds 6] [--threads 2]

``DIR``: a K2-shaped checkpoint with packed (INT4 / MXFP4) experts for ``packed-ffn`` and ``loop`` (any DeepSeek-V3
checkpoint for ``loop``), a K3-shaped one for ``k3-moe`` and ``k3-attention`` (``benchmarks/vs_llama_cpp.py`` writes both into its work
dir). Prints the median time per request of each side, their ratio and the median of the paired ratios, and
whether the greedy tokens agree (the bf16 one-call blocks round once where the op-by-op path rounds after each
product, so a random model's tokens may part after a few steps).
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimitui.engine import LLM, SamplingParams  # noqa: E402
from kimitui.engine.layers.latent_moe import KimiMoE  # noqa: E402
from kimitui.kernels.cpu.packed_ffn_block import PackedFfnBlock, PackedFfnWeights  # noqa: E402

import torch  # noqa: E402


def switches(llm: LLM, what: str):
    """(name of the new path, name of the old one, set(new: bool)) for ``what``."""
    model = llm.engine.runner.model.model
    if what == "loop":
        fast = getattr(model, "run_fused", None)
        if fast is None:
            raise SystemExit("no fused decoder layers here (the C++ CPU kernels, a DeepSeek-V3 checkpoint)")

        def set_loop(on: bool) -> None:
            model.run_fused = fast if on else None

        return "one loop", "layer by layer", set_loop
    if what == "packed-ffn":
        layers = [
            layer for layer in model.layers if isinstance(getattr(layer.fused, "ffn_weights", None), PackedFfnWeights)
        ]
        if not layers:
            raise SystemExit("no packed-expert FFN block here (a checkpoint with INT4 / MXFP4 experts)")
        cxx = {id(layer): layer.fused.ffn_weights for layer in layers}
        py = {
            id(layer): PackedFfnBlock.build(layer.post_attention_layernorm, layer.mlp, layer.fused.backend)
            for layer in layers
        }

        def set_ffn(on: bool) -> None:
            for layer in layers:
                layer.fused.ffn_weights = cxx[id(layer)] if on else None
                layer.fused.packed_ffn = None if on else py[id(layer)]

        return "C++ block", "Python block", set_ffn
    if what == "k3-attention":
        attns = [layer.self_attn for layer in model.layers if getattr(layer.self_attn, "fused", None) is not None]
        if not attns:
            raise SystemExit("no one-call K3 attention here (a Kimi Linear / K3 checkpoint, the C++ CPU kernels)")
        blocks = {id(a): a.fused for a in attns}

        def set_attention(on: bool) -> None:
            for a in attns:
                a.fused = blocks[id(a)] if on else None

        return "C++ attention", "op by op", set_attention
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, KimiMoE) and layer.mlp.fused is not None]
    if not moes:
        raise SystemExit("no one-call K3 MoE here (a Kimi Linear / K3 checkpoint with packed experts)")
    fused = {id(m): m.fused for m in moes}

    def set_moe(on: bool) -> None:
        for m in moes:
            m.fused = fused[id(m)] if on else None

    return "C++ MoE", "op by op", set_moe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--what", choices=("packed-ffn", "loop", "k3-moe", "k3-attention"), required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=args.prompt + args.tokens + 8,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    new, old, use = switches(llm, args.what)
    rng = random.Random(0)
    vocab = llm.engine.config.vocab_size
    prompt = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.prompt)]}]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    times = {True: [], False: []}
    tokens = {}
    for on in (True, False):  # first calls out of the timed ones
        use(on)
        llm.generate(prompt, params)
    for r in range(args.rounds):
        for on in (True, False) if r % 2 else (False, True):
            use(on)
            t = time.perf_counter()
            out = llm.generate(prompt, params)
            times[on].append(time.perf_counter() - t)
            tokens[on] = out[0].outputs[0].token_ids
    a, b = statistics.median(times[False]), statistics.median(times[True])
    paired = statistics.median(x / y for x, y in zip(times[False], times[True]))
    print(
        f"{args.what}: {old} {a * 1e3:.1f} ms per request, {new} {b * 1e3:.1f} ms: {a / b:.3f}x "
        f"(paired {paired:.3f}x, {args.rounds} rounds, {args.prompt} + {args.tokens} tokens, {args.dtype}); "
        f"same greedy tokens: {tokens[True] == tokens[False]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
