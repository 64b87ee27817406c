"""`kimitui bench`'s benchmark flags (`vllm bench serve`'s, plus ours) and the BenchmarkConfig they make."""

from __future__ import annotations

import argparse
import math

from kimitui.bench.cost import (
    load_cost_settings,
    parse_pricing_tier,
    with_overrides,
)
from kimitui.bench.runner import BenchmarkConfig
from kimitui.bench.sweep import parse_concurrency_list


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kimitui bench`'s flags, named as `vllm bench serve` names them. Engine
    flags (--model, --gpus, --max-model-len) are registered by the CLI and read if present."""
    a = parser.add_argument
    a(
        "--dataset-name",
        choices=["random", "multi-turn"],
        default="random",
        help="random: vLLM's random prompts; multi-turn: --num-prompts agentic sessions (the user message "
        "is --random-input-len tokens, the reply --random-output-len)",
    )
    a("--multi-turn-turns", type=int, default=4, help="multi-turn: turns per session")
    a(
        "--multi-turn-think-time",
        type=float,
        default=0.0,
        metavar="S",
        help="multi-turn: seconds between a reply and the session's next user message",
    )
    a(
        "--multi-turn-system-len",
        type=int,
        default=512,
        metavar="N",
        help="multi-turn: tokens of the shared tool definitions + system prompt",
    )
    a("--random-input-len", type=int, default=1024, help="mean prompt tokens (vLLM random dataset)")
    a("--random-output-len", type=int, default=128, help="mean output tokens")
    a(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L(1-r), L(1+r)], r in [0, 1) (vLLM semantics, not InferenceX's [rL, L])",
    )
    a("--random-prefix-len", type=int, default=0, help="random prefix shared by all prompts")
    a("--num-prompts", type=int, default=1000, help="number of requests")
    a("--max-concurrency", type=int, default=None, help="cap on requests in flight (closed loop)")
    a("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once); else Poisson")
    a("--burstiness", type=float, default=1.0, help="Gamma shape of arrival gaps: 1 Poisson, <1 burstier")
    a(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the sampled output length (vLLM forces this for the random dataset)",
    )
    a("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    a("--seed", type=int, default=0, help="seed for lengths, prompts and arrivals")
    a("--num-warmups", type=int, default=0, help="warm-up requests before the timed run")
    a("--percentile-metrics", type=str, default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    a("--metric-percentiles", type=str, default="99", help="e.g. 50,90,99")
    a("--save-result", action="store_true", help="write the result JSON")
    a(
        "--result-filename",
        type=str,
        default=None,
        help="result file name (default like vLLM's); with --sweep-concurrency it holds the sweep summary",
    )
    a("--result-dir", type=str, default=None, help="directory for the result file")
    a("--label", type=str, default=None, help="result label (default: the backend name)")
    a("--base-url", type=str, default=None, help="benchmark an OpenAI-compatible server instead of in-process")
    a("--sweep-concurrency", type=str, default=None, help="e.g. 1,2,4,8: one run per level, then the frontier")
    a(
        "--num-gpus",
        type=int,
        default=None,
        help="GPUs behind the --base-url server, for per-GPU numbers "
        "(default: --gpus, else 1; 0 for a CPU-only server). In-process runs count the engine's own",
    )
    a("--usd-per-kwh", type=float, default=None, help="electricity price (default from settings.toml, else 0.10)")
    a(
        "--pricing-tier",
        action="append",
        default=[],
        metavar="NAME=USD",
        help="$/GPU/hour tier, repeatable; replaces a tier of the same name",
    )


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """Build a BenchmarkConfig from parsed flags; cost defaults come from settings.toml."""

    def floats(text: str, flag: str) -> tuple[float, ...]:
        try:
            return tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError as e:
            raise ValueError(f"{flag} expects comma-separated numbers, got {text!r}") from e

    cost = with_overrides(load_cost_settings(), [parse_pricing_tier(t) for t in args.pricing_tier], args.usd_per_kwh)
    num_gpus = args.num_gpus if args.num_gpus is not None else getattr(args, "gpus", None) or 1
    return BenchmarkConfig(
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        num_warmups=args.num_warmups,
        percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=floats(args.metric_percentiles, "--metric-percentiles"),
        save_result=args.save_result,
        result_filename=args.result_filename,
        result_dir=args.result_dir,
        sweep_concurrency=parse_concurrency_list(args.sweep_concurrency) if args.sweep_concurrency else (),
        base_url=args.base_url,
        model=getattr(args, "model", None),
        num_gpus=int(num_gpus),
        pricing_tiers=cost.tiers,
        usd_per_kwh=cost.usd_per_kwh,
        label=args.label,
        max_model_len=getattr(args, "max_model_len", None),
        dataset_name=getattr(args, "dataset_name", "random"),
        multi_turn_turns=getattr(args, "multi_turn_turns", 4),
        multi_turn_think_time=getattr(args, "multi_turn_think_time", 0.0),
        multi_turn_system_len=getattr(args, "multi_turn_system_len", 512),
    )
