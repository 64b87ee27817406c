"""``kimitui`` and its subcommands. Each subcommand lives in kimitui/commands/<name>.py with
``add_parser(subparsers)`` and ``run(args) -> int``; this file only wires them up."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

SUBCOMMANDS = ("serve", "bench", "plan", "info", "agent", "eval")


def build_parser() -> argparse.ArgumentParser:
    from kimitui.commands.engine_flags import add_engine_arguments

    p = argparse.ArgumentParser(prog="kimitui", description="Run Kimi models locally and watch the hardware.")
    p.add_argument("--version", action="version", version=f"kimitui {_version()}")
    p.add_argument("--log-level", default=os.environ.get("KIMITUI_LOG", "WARNING"), help="logging level")
    add_engine_arguments(p)
    tui = p.add_argument_group("tui")
    tui.add_argument("--theme", default=None, help="theme name (built-in or from the XDG config dir)")
    tui.add_argument("--telemetry-interval", type=float, default=1.0, metavar="S", help="sampling period")
    remote = p.add_argument_group("remote server (the TUI without a local engine)")
    remote.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="chat with an OpenAI-compatible server (kimitui serve, vLLM, SGLang) instead of loading "
        "a model; with or without /v1. --model NAME then picks a served model",
    )
    remote.add_argument(
        "--api-key", default=None, metavar="KEY", help="bearer token for --base-url (default: $OPENAI_API_KEY)"
    )
    remote.add_argument(
        "--telemetry-url",
        action="append",
        default=None,
        metavar="URL",
        help="hardware telemetry from a Prometheus endpoint (kimitui agent, NVIDIA's DCGM exporter or "
        "AMD's device-metrics-exporter) "
        "instead of this machine; repeat for several nodes",
    )
    remote.add_argument("--telemetry-token", default=None, metavar="T", help="bearer token for --telemetry-url")
    remote.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs behind --base-url, for per-GPU benchmark numbers (default: GPUs seen by --telemetry-url, else n/a)",
    )
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS:
        try:
            _module(name).add_parser(sub)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("kimitui.commands"):
                raise
    return p


def _module(name: str):
    return importlib.import_module(f"kimitui.commands.{name}")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kimitui")
    except Exception:
        return "dev"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command is None:
            from kimitui.tui.run import run_tui

            return run_tui(args)
        return _module(args.command).run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, MemoryError, OSError) as e:
        print(f"kimitui: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
