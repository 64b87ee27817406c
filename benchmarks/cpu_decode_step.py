"""One decode step of an expert-heavy INT4 DeepSeek-V3 / Kimi K2-style checkpoint, CPU only: bytes
of weights the step reads per second, over the read bandwidth measured in the same process.

A single-request decode step reads every dense matrix once (attention, shared expert, router, lm
head: in the compute dtype) plus the top-k routed experts of each MoE layer (packed INT4 + bf16
scales) and one embedding row. Those bytes over the time per output token (TPOT) is the step's
streaming rate; the issue's target is >= 50% of the machine's read bandwidth
(``benchmarks/cpu_experts.py``'s float32 sum over 1 GiB, same threads, same clock).

    python benchmarks/cpu_decode_step.py [--hidden 2048] [--inter 1024] [--experts 64] [--top-k 8]
        [--layers 8] [--heads 8] [--vocab 4096] [--tokens 16] [--threads 2] [--dtype float32]
        [--cpu-offload none] [--profile] [--keep DIR] [--format int4|mxfp4]

The checkpoint (random weights in compressed-tensors pack-quantized INT4 for the routed experts, bf16
for the rest, as Kimi K2.5 ships) is written once into a temporary directory (or ``--keep DIR``,
reused when it exists). Two clocks: wall time, and this process's CPU seconds over its thread count
(closer to the time alone on a machine shared with other jobs; see cpu_experts.best_time).
``--profile`` prints cProfile's top functions (CPU clock) over the decode steps of one request.
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the engine before torch: it sets OpenMP's wait policy, which libgomp reads when torch loads it
from kimitui.engine import LLM, SamplingParams  # noqa: E402
from kimitui.engine.offload import overlap_meter  # noqa: E402

import torch  # noqa: E402

from benchmarks.cpu_experts import read_bandwidth  # noqa: E402


def hf_config(args):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.inter,
        moe_intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=512,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    )


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from transformers' model built on the meta device (no memory)."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out.update({n: tuple(b.shape) for n, b in model.named_buffers() if "e_score_correction_bias" in n})
    return out


def write_checkpoint(path: Path, args) -> None:
    from tests.helpers.checkpoints import rewrite_checkpoint
    from tests.helpers.quantized import _quant_config

    cfg = hf_config(args)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes(cfg).items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            base = name.rsplit(".", 1)[0]
            e, n, k = shape
            fused = name.endswith("gate_up_proj")
            projs = [("gate_proj", n // 2), ("up_proj", n // 2)] if fused else [("down_proj", n)]
            for i in range(e):
                for proj, rows in projs:
                    if args.format == "mxfp4":  # E2M1 bytes, E8M0 scale 2^-9 per 32: |w| <= 6 * 0.002
                        tensors[f"{base}.{i}.{proj}.weight_packed"] = torch.randint(
                            0, 256, (rows, k // 2), dtype=torch.uint8, generator=g
                        )
                        tensors[f"{base}.{i}.{proj}.weight_scale"] = torch.full((rows, k // 32), 118, dtype=torch.uint8)
                        continue
                    # offset-8 nibbles, group 32, bf16 scales: |w| <= 8 * 0.003, activations stay tame
                    tensors[f"{base}.{i}.{proj}.weight_packed"] = torch.randint(
                        -(2**31), 2**31 - 1, (rows, k // 8), dtype=torch.int32, generator=g
                    )
                    tensors[f"{base}.{i}.{proj}.weight_scale"] = torch.full(
                        (rows, k // 32), 0.003, dtype=torch.bfloat16
                    )
                    tensors[f"{base}.{i}.{proj}.weight_shape"] = torch.tensor([rows, k], dtype=torch.int32)
        elif "norm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif "e_score_correction_bias" in name:
            tensors[name] = torch.zeros(shape, dtype=torch.float32)
        else:
            tensors[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    cfg.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = _quant_config(args.format)
    rewrite_checkpoint(path, tensors, config, shards=max(1, len(tensors) // 2000))


def step_bytes(args, compute: torch.dtype) -> dict[str, int]:
    """Weight bytes one single-token decode step reads, by kind."""
    cfg = hf_config(args)
    out = {"dense": 0, "experts": 0, "lm_head": 0, "embedding row": args.hidden * compute.itemsize}
    d, i = args.hidden, args.inter
    # packed nibbles + scales per 32 columns (INT4 bf16, MXFP4 one E8M0 byte)
    per_expert = 3 * d * i // 2 + 3 * d * i // 32 * (1 if getattr(args, "format", "int4") == "mxfp4" else 2)
    for name, shape in shapes(cfg).items():
        n = 1
        for s in shape:
            n *= s
        if name.endswith("gate_up_proj"):
            out["experts"] += args.top_k * per_expert
        elif name.endswith("experts.down_proj") or "embed_tokens" in name:
            continue
        elif name.startswith("lm_head"):
            out["lm_head"] += n * compute.itemsize
        else:  # router weight and bias are kept in float32 whatever the compute dtype
            out["dense"] += n * (4 if ".mlp.gate." in name else compute.itemsize)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (
        ("--hidden", 2048),
        ("--inter", 1024),
        ("--experts", 64),
        ("--top-k", 8),
        ("--layers", 8),
        ("--heads", 8),
        ("--vocab", 4096),
        ("--tokens", 16),
        ("--threads", 2),
        ("--prompt", 32),
    ):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--format", choices=("int4", "mxfp4"), default="int4", help="routed experts' format")
    ap.add_argument("--cpu-offload", default="none", help="LLM(cpu_offload=...): 'none', or a count of experts")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--keep", help="write (or reuse) the checkpoint here instead of a temporary directory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep or tmp)
        if not (path / "config.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            write_checkpoint(path, args)
            print(
                f"wrote {sum(f.stat().st_size for f in path.glob('*.safetensors')) / 1e9:.2f} GB to {path} "
                f"in {time.perf_counter() - t:.0f} s"
            )
        kept = json.loads((path / "config.json").read_text())["quantization_config"].get("format")
        if kept != ("mxfp4-pack-quantized" if args.format == "mxfp4" else "pack-quantized"):
            ap.error(f"--keep {path} holds a {kept} checkpoint, not --format {args.format}")
        return run(path, args)


def run(path: Path, args) -> int:
    offload = args.cpu_offload if args.cpu_offload in ("none", "auto") else int(args.cpu_offload)
    compute = getattr(torch, args.dtype)
    nbytes = step_bytes(args, compute)
    total = sum(nbytes.values())
    with LLM(
        str(path),
        dtype=args.dtype,
        device="cpu",
        max_model_len=args.prompt + args.tokens + 8,
        max_num_seqs=1,
        cpu_offload=offload,
    ) as llm:
        overlap_meter.enable(llm.engine.model)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        times = {"wall": [], "cpu": []}
        # a float32 sum over as many bytes as the step reads, as many times as there were steps, right
        # after the request: it sees about the same load from other jobs, so the ratio holds up better
        # than either time alone. Not between the steps: there it woke torch's OpenMP threads, put the
        # kernels' team to sleep and stood between steps the engine runs back to back (a single-request
        # MXFP4 float32 step measured 10-25% slower so, 2026-12-03).
        paired = torch.ones(total // 4)
        sums = {"wall": [], "cpu": []}

        def decode(record: bool, prof=None):
            llm.engine.add_request(None, list(range(1, args.prompt + 1)), params)
            llm.engine.step()  # prefill
            while llm.engine.has_unfinished_requests():
                w, c = time.perf_counter(), time.process_time()
                if prof is not None:
                    prof.enable()
                llm.engine.step()
                if prof is not None:
                    prof.disable()
                if record:
                    times["wall"].append(time.perf_counter() - w)
                    times["cpu"].append((time.process_time() - c) / torch.get_num_threads())
            for _ in range(len(times["wall"]) if record else 0):
                w, c = time.perf_counter(), time.process_time()
                paired.sum()
                sums["wall"].append(time.perf_counter() - w)
                sums["cpu"].append((time.process_time() - c) / torch.get_num_threads())

        decode(False)  # warm-up: first-touch, lazy builds
        if args.profile:
            # cProfile, not torch.profiler: the C++ kernels are plain extension calls torch does not see
            import cProfile
            import pstats

            prof = cProfile.Profile(time.process_time)
            decode(False, prof)
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        overlap_meter.enable(llm.engine.model)
        decode(True)
        meter = overlap_meter.report(llm.engine.model)["total"]
    bw = {clock: read_bandwidth(clock) for clock in ("wall", "cpu")}
    print(
        f"threads {args.threads} | {args.dtype} | hidden {args.hidden}, expert width {args.inter}, {args.experts} "
        f"experts top-{args.top_k}, {args.layers} layers, vocab {args.vocab} | cpu_offload {args.cpu_offload}"
    )
    print(
        "bytes per step: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in nbytes.items()) + f" = {total / 1e6:.1f} MB"
    )
    print(
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} | load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        "| clock | TPOT ms (median) | TPOT ms (best) | GB/s (median) | read bw GB/s | % of read bw "
        "| paired sum GB/s (median) | % of paired |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for clock, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        pair = total / statistics.median(sums[clock])
        print(
            f"| {clock} | {med * 1e3:.1f} | {best * 1e3:.1f} | {total / med / 1e9:.2f} | {bw[clock] / 1e9:.2f} | "
            f"{total / med / bw[clock]:.0%} | {pair / 1e9:.2f} | {statistics.median(sums[clock]) / med:.0%} |"
        )
    if meter["calls"]:
        print(
            f"host experts: {meter['calls']} layer calls, host {meter['host_s'] * 1e3:.1f} ms, device experts "
            f"{meter['device_s'] * 1e3:.1f} ms, waited at join {meter['wait_s'] * 1e3:.1f} ms, hidden fraction "
            f"{meter['hidden_fraction']:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
