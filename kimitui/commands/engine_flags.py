"""Engine flags shared by the TUI, ``bench`` and ``serve`` (names as vLLM's where vLLM has one)."""

from __future__ import annotations

import argparse

from kimitui.engine.args import EngineArgs


def cpu_offload_arg(value: str) -> str | int:
    """argparse type of ``--cpu-offload``: auto, none, or a non-negative number of experts per layer."""
    if value in ("auto", "none"):
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or a number of experts, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of experts, got {n}")
    return n


def speculative_config_arg(value: str) -> dict:
    """argparse type of ``--speculative-config``: a JSON object checked as EngineArgs will check it."""
    from kimitui.engine.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    import json

    return json.loads(value)


def add_engine_arguments(p: argparse.ArgumentParser, model_required: bool = False, subcommand: bool = False) -> None:
    """``subcommand``: the flags are also accepted before the subcommand (``kimitui --model X serve``);
    their defaults are suppressed here so argparse does not overwrite values given up front."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        required=model_required,
        help="checkpoint directory (Kimi K2.x / DeepSeek-V3 / Kimi K3 safetensors), or demo / demo-k3 "
        "for a built-in random-weight model; default: demo",
    )
    g.add_argument(
        "--gpus",
        "--tensor-parallel-size",
        dest="gpus",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel size (number of devices; gloo processes on a CPU)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute dtype; auto = checkpoint dtype on GPU, float32 on CPU",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (ROCm GPUs are cuda too)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="L", help="context limit (prompt + output)")
    g.add_argument("--max-num-seqs", type=int, default=64, metavar="S", help="concurrent sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="T", help="token budget per step")
    g.add_argument("--gpu-memory-gb", type=float, default=None, metavar="G", help="memory per GPU to use")
    g.add_argument(
        "--cpu-offload",
        type=cpu_offload_arg,
        default="auto",
        metavar="auto|none|N",
        help="routed experts kept in host RAM: planner decides, none, or N per MoE layer",
    )
    g.add_argument(
        "--numa",
        default="auto",
        choices=["auto", "off"],
        help="host-RAM experts on a multi-socket CPU: auto = split per NUMA node, computed there; off",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA/HIP graph capture of decode steps (run every step eagerly)",
    )
    g.add_argument(
        "--lazy-graph-capture",
        action="store_true",
        help="capture each decode graph batch bucket on its first step instead of at start-up",
    )
    g.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N", help="cap the KV cache at N tokens")
    g.add_argument(
        "--routing-stats",
        default=None,
        metavar="FILE",
        help="tokens per expert per layer from an earlier run (JSON): hottest experts stay on the GPUs",
    )
    g.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default=None,
        metavar="JSON",
        help="speculative decoding, vLLM's dict (a recipe's JSON pastes unchanged): {\"method\": "
        '"ngram"|"suffix"|"eagle3", "num_speculative_tokens": K, "model": DIR, "prompt_lookup_min": '
        'N, "prompt_lookup_max": M, "disable_by_batch_size": B, "eagle_aux_hidden_state_layer_ids": '
        '[...], "backoff": false, ...}',
    )
    g.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=512,
        metavar="TOKENS",
        help="hybrid (K3) models: keep a KDA state snapshot every TOKENS prompt tokens for prefix "
        "reuse (a multiple of the block size), besides the prompt's and reply's last full block",
    )
    if subcommand:
        for action in g._group_actions:  # argparse has no public way to re-default a group
            action.default = argparse.SUPPRESS


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.gpus,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        cpu_offload=args.cpu_offload,
        gpu_memory_gb=args.gpu_memory_gb,
        kv_cache_tokens=args.kv_cache_tokens,
        routing_stats=args.routing_stats,
        enforce_eager=args.enforce_eager,
        lazy_graph_capture=getattr(args, "lazy_graph_capture", False),
        numa=args.numa,
        speculative_config=getattr(args, "speculative_config", None),
        state_snapshot_interval=getattr(args, "state_snapshot_interval", 512),
    )
