"""`kimitui plan`: where every weight would live (GPU vs host RAM), from config.json alone.

Exit status: 0 the model fits, 1 it does not (or ``--cpu-offload none`` refuses), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kimitui.commands.engine_flags import cpu_offload_arg, speculative_config_arg
from kimitui.engine.config import ConfigError, ModelConfig
from kimitui.engine.plan.planner import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    Placement,
    PlacementError,
    plan_placement,
)
from kimitui.engine.plan.report import render
from kimitui.engine.plan.routing_stats import load_routing_stats
from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.engine.units import GiB

MI355X_MEMORY_GB = 288.0
# One sequence by default: `plan` answers "does one request at full context fit". KV grows
# linearly with --max-num-seqs, so serving plans should pass the concurrency they intend.
DEFAULT_MAX_NUM_SEQS = 1


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", metavar="DIR", help="checkpoint directory (only config.json is read; default: the built-in demo)"
    )
    src.add_argument("--config", metavar="FILE", help="a config.json file")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs (any N; splits are uneven)")
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=MI355X_MEMORY_GB,
        metavar="G",
        help="memory per GPU in GiB (2^30 bytes, as rocm-smi reports; default %(default)s, an MI355X)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="L",
        help="context length per sequence (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        metavar="S",
        help="concurrent sequences, each with a full-length KV cache (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metavar="T",
        help="tokens per engine step, the largest prefill chunk: sizes the activation reserve "
        "(default %(default)s, as kimitui serve)",
    )
    p.add_argument(
        "--cpu-offload",
        type=cpu_offload_arg,
        default="auto",
        metavar="auto|none|N",
        help="auto: experts that do not fit go to host RAM; none: refuse if it does not fit; "
        "N: N routed experts of every MoE layer in host RAM (default auto)",
    )
    p.add_argument("--host-memory-gb", type=float, metavar="G", help="host RAM available for CPU experts, GiB")
    p.add_argument("--routing-stats", metavar="FILE", help="tokens per expert per layer (JSON); hottest stay on GPU")
    p.add_argument(
        "--reserve-gb",
        type=float,
        metavar="G",
        help="per-GPU reserve for activations and workspace, GiB (default: estimated for "
        "--max-num-batched-tokens and --max-num-seqs)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="T",
        help="KV cache block size in tokens (default %(default)s)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default=None,
        metavar="JSON",
        help="count speculative decoding's memory: verification rows, KDA scratch states, an "
        "eagle3 drafter's weights and KV (as the engine flag)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "plan",
        help="show where every weight would live (GPU vs CPU) and what fits",
        description=__doc__.splitlines()[0],
    )
    return _configure(p)


def _fail(message: str) -> int:
    print(f"kimitui plan: {message}", file=sys.stderr)
    return 2


def _emit(placement: Placement, as_json: bool, error: str | None = None) -> None:
    if as_json:
        out = placement.to_dict()
        if error:
            out["error"] = error
        print(json.dumps(out))
    else:
        print("\n".join(render(placement)))


def run(args: argparse.Namespace) -> int:
    """Print the placement; 0 fits, 1 does not fit, 2 bad input (one line on stderr)."""
    try:
        source = args.model or args.config
        if source is None or args.model in ("demo", "demo-k3"):
            from kimitui.engine.demo import demo_checkpoint

            source = demo_checkpoint(args.model)
        config = ModelConfig.from_pretrained(source)
        if args.config and not config.raw.get("_name_or_path"):
            # a bare config.json names the model by its file, not by the folder it sits in
            config = dataclasses.replace(config, name=Path(args.config).stem)
    except ConfigError as e:
        return _fail(str(e))
    if args.gpus < 1:
        return _fail(f"--gpus must be at least 1, got {args.gpus}")
    if (
        args.gpu_memory_gb <= 0
        or (args.reserve_gb is not None and args.reserve_gb < 0)
        or (args.host_memory_gb is not None and args.host_memory_gb < 0)
    ):
        return _fail("--gpu-memory-gb must be positive; --reserve-gb and --host-memory-gb non-negative")
    if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        return _fail("--max-num-batched-tokens and --max-num-seqs must be at least 1")
    try:
        stats = load_routing_stats(args.routing_stats) if args.routing_stats else None
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    host = None if args.host_memory_gb is None else int(args.host_memory_gb * GiB)
    try:
        placement = plan_placement(
            config,
            args.gpus,
            int(args.gpu_memory_gb * GiB),
            args.max_model_len or config.max_position_embeddings,
            args.max_num_seqs,
            cpu_offload=args.cpu_offload,
            routing_stats=stats,
            host_memory_bytes=host,
            reserve_bytes_per_device=None if args.reserve_gb is None else int(args.reserve_gb * GiB),
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speculative=SpeculativeConfig.parse(args.speculative_config),
        )
    except PlacementError as e:
        _emit(e.placement, args.json, str(e))
        print(f"kimitui plan: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    _emit(placement, args.json)
    return 0 if placement.fits else 1


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m kimitui.commands.plan --config FILE --gpus N``."""
    parser = _configure(argparse.ArgumentParser(prog="kimitui plan", description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
