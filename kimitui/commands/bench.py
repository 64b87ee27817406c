"""`kimitui bench`: vLLM's serving benchmark, in-process or against --base-url, plus energy and cost.

Workload, timing, metrics, printed block and saved JSON are those of `vllm bench serve`.
Exit status: 0 done, 1 no request succeeded (or the server could not be reached), 2 bad input,
130 cancelled with Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kimitui.bench.args import add_bench_arguments, config_from_args
from kimitui.bench.cost import format_efficiency_block, usd_per_mtok
from kimitui.bench.metrics import format_result_block
from kimitui.bench.runner import (
    BenchmarkConfig,
    run_benchmark,
    run_sweep,
    save_result,
    sweep_result_filename,
)
from kimitui.bench.sweep import format_frontier, format_ladder
from kimitui.bench.targets import HttpTarget, InProcessTarget
from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from

DEFAULT_TELEMETRY_INTERVAL_S = 0.5

_MODEL_HELP = (
    "in-process: checkpoint directory (default: the built-in demo). With --base-url: the "
    "served model name sent in requests, as in `vllm bench serve` (default: the first id "
    "of GET /v1/models)"
)
_EPILOG = """\
--model means what it means for the target: a checkpoint directory when the engine runs
in-process, the served model name with --base-url (engine flags are then ignored). Prompts are
built with the target's tokenizer: in-process the checkpoint's; with --base-url the one from
--tokenizer DIR, else --model when it names a local checkpoint directory, else the demo's.
An API key for --base-url is read from OPENAI_API_KEY, as vLLM does.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "bench",
        help="headless benchmark (vllm bench serve flags and metrics)",
        description=__doc__.splitlines()[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(p, subcommand=True)
    for action in p._actions:  # argparse has no public way to reword a flag
        if action.dest == "model":
            action.help, action.metavar = _MODEL_HELP, "DIR|NAME"
    g = p.add_argument_group("benchmark target")
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="with --base-url: checkpoint directory whose tokenizer builds the prompts",
    )
    g.add_argument(
        "--http-client",
        choices=("auto", "aiohttp"),
        default="auto",
        help="with --base-url: auto = kimitui's kept-alive connection pool for a plain http:// server "
        "(about 1 ms less of its own time in each TTFT than aiohttp here), aiohttp for https and proxies; "
        "aiohttp = always aiohttp, as vllm bench serve (default %(default)s)",
    )
    g.add_argument(
        "--telemetry-interval",
        type=float,
        default=DEFAULT_TELEMETRY_INTERVAL_S,
        metavar="S",
        help="power/utilisation sampling period during the run (default %(default)s)",
    )
    add_bench_arguments(p.add_argument_group("benchmark (vllm bench serve flags)"))
    p.set_defaults(func=run)
    return p


def _fail(message: str, status: int = 2) -> int:
    print(f"kimitui bench: {message}", file=sys.stderr)
    return status


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or sweep) the flags describe; print vLLM's block and ours."""
    _fill_engine_defaults(args)
    try:
        config = config_from_args(args)
        if not args.telemetry_interval > 0:
            raise ValueError(f"--telemetry-interval must be > 0, got {args.telemetry_interval}")
    except ValueError as e:
        return _fail(str(e))
    target: InProcessTarget | HttpTarget | None = None
    sampler = None
    try:
        if config.base_url:
            target = HttpTarget(config.base_url, args.model, args.tokenizer, http_client=args.http_client)
        else:
            if args.tokenizer:
                raise ValueError("--tokenizer is for --base-url; in-process runs use the checkpoint's")
            if args.model and args.model not in ("demo", "demo-k3") and not Path(args.model).expanduser().is_dir():
                raise ValueError(f"model directory {args.model} does not exist")
            # Loading a checkpoint is the slow part; say so before a silent pause.
            print(f"kimitui bench: loading {args.model or 'the demo checkpoint'} ...", file=sys.stderr)
            target = InProcessTarget.load(engine_args_from(args))
        # The engine clamps --max-model-len to the checkpoint; prompts must fit what it accepts.
        config = replace(config, max_model_len=target.max_model_len or config.max_model_len)
        if isinstance(target, InProcessTarget):  # the truth, not a flag: 0 when the engine is on the CPU
            config = replace(config, num_gpus=target.num_gpus)
        from kimitui.telemetry import TelemetrySampler

        sampler = TelemetrySampler(interval_s=args.telemetry_interval).start()
        return asyncio.run(_bench(config, target, sampler))
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        return _fail(str(e))
    except ConnectionError as e:
        return _fail(str(e), 1)
    except KeyboardInterrupt:
        print("kimitui bench: cancelled", file=sys.stderr)
        return 130
    finally:
        if sampler is not None:
            sampler.stop()
        if target is not None:
            target.close()


def _engine_defaults() -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(p)
    return p.parse_args([])


def _fill_engine_defaults(args: argparse.Namespace) -> None:
    # The CLI's top-level parser supplies engine defaults; fill them when `bench` is parsed alone.
    for key, value in vars(_engine_defaults()).items():
        if not hasattr(args, key):
            setattr(args, key, value)


async def _bench(config: BenchmarkConfig, target: InProcessTarget | HttpTarget, sampler: Any) -> int:
    cancel = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = _install_sigint(loop, cancel)
    try:
        client = await target.open(config)
        try:
            print(
                f"kimitui bench: {config.num_prompts} prompts against {target.describe}, "
                f"telemetry: {_telemetry_names(sampler)}",
                file=sys.stderr,
                flush=True,
            )
            if config.sweep_concurrency:
                sweep = await run_sweep(config, client, target.tokenizer, sampler, _progress(), cancel)
                for point in sweep["points"]:
                    _print_result(point)
                _print_sweep(sweep, config)
                completed = sum(p["completed"] for p in sweep["points"])
                errors = [e for p in sweep["points"] for e in p["errors_sample"]]
            else:
                result = await run_benchmark(config, client, target.tokenizer, sampler, _progress(), cancel)
                _print_result(result)
                completed = result["completed"]
                errors = result["errors_sample"]
        finally:
            await client.aclose()
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
    if cancel.is_set():
        print("kimitui bench: cancelled; the numbers above cover the requests that finished", file=sys.stderr)
        return 130
    if completed == 0:
        return _fail(f"no request succeeded ({errors[0] if errors else 'no error reported'})", 1)
    return 0


def _install_sigint(loop: asyncio.AbstractEventLoop, cancel: asyncio.Event) -> bool:
    # First Ctrl-C: stop issuing requests and abort those in flight, then report what finished.
    # The handler is removed at once, so a second Ctrl-C raises KeyboardInterrupt right away.
    def on_sigint() -> None:
        print("\nkimitui bench: cancelling (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        cancel.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # Windows, or not the main thread
        return False
    return True


def _telemetry_names(sampler: Any) -> str:
    names = [s.name for s in sampler.backend_status() if s.available]
    return ", ".join(names) or "none"


def _progress():
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, elapsed: float) -> None:
        end = "\n" if done == total else ""
        print(f"\r{done}/{total} requests, {elapsed:.1f} s", end=end, file=sys.stderr, flush=True)

    return show


def _print_result(result: dict[str, Any]) -> None:
    if result.get("notes"):
        print(f"kimitui bench: note: {result['notes']}", file=sys.stderr)
    print(format_result_block(result))
    if result.get("dataset_name") == "multi-turn":
        from kimitui.bench.multi_turn import format_multi_turn_block

        print(format_multi_turn_block(result))
    print(format_efficiency_block(result))
    if result.get("result_file"):
        print(f"kimitui bench: saved {result['result_file']}", file=sys.stderr)


def _print_sweep(sweep: dict[str, Any], config: BenchmarkConfig) -> None:
    per = "GPU" if config.num_gpus else "host"  # CPU only: throughput of the whole machine, no GPU-hour cost
    print(format_frontier(sweep["frontier"], per))
    tiers = config.pricing_tiers
    print(
        format_ladder(
            sweep["ladder"],
            per=per,
            cost_per_mtok=(lambda tput: {t.name: usd_per_mtok(t.usd_per_gpu_hour, tput) for t in tiers})
            if config.num_gpus
            else None,
        )
    )
    if config.save_result and sweep["points"]:
        path = save_result(sweep, config.result_dir, sweep_result_filename(sweep, config.result_filename))
        print(f"kimitui bench: saved {path}", file=sys.stderr)
