"""`kimitui eval recall`: long-context recall with planted codes, in-process or against --base-url.

A haystack of filler text with codes planted at known depths, one question per code, greedy
replies scored by exact match; the result per context length and per depth. Exit status: 0 done
(whatever the score), 1 the server could not be reached, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from

_EPILOG = """\
Context length counts the prompt's tokens in the model's chat format (thinking off); each length
plus --max-tokens must fit the model's maximum (max_model_len). --model is a checkpoint directory
in-process, the served model name with --base-url; the haystack is then sized with --tokenizer DIR
(default: --model when it names a local checkpoint, else the demo's) and the server's own count of
prompt tokens is reported. Random-weight demo models score about 0: the harness is what runs.
"""


def add_parser(eval_subparsers) -> argparse.ArgumentParser:
    """Register ``recall`` on the ``eval`` command's subparsers object."""
    p = eval_subparsers.add_parser(
        "recall",
        help="long-context recall with planted codes (per depth and length)",
        description=__doc__.splitlines()[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(p, subcommand=True)
    g = p.add_argument_group("recall")
    g.add_argument(
        "--context-lengths",
        required=True,
        metavar="L1,L2",
        help="prompt lengths in tokens, comma-separated (32k = 32768)",
    )
    g.add_argument(
        "--depths",
        default="0,0.25,0.5,0.75,1",
        metavar="D1,D2",
        help="where codes are planted, as fractions of the document (default %(default)s)",
    )
    g.add_argument(
        "--codes-per-depth",
        type=int,
        default=2,
        metavar="N",
        help="codes planted at each depth, one question each (default %(default)s)",
    )
    g.add_argument("--max-tokens", type=int, default=24, metavar="N", help="reply tokens (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="haystack and codes seed (default %(default)s)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the full result (every reply) as JSON")
    r = p.add_argument_group("remote server")
    r.add_argument(
        "--base-url",
        default=argparse.SUPPRESS,
        metavar="URL",
        help="an OpenAI-compatible server (kimitui serve, vLLM, SGLang) instead of loading a model",
    )
    r.add_argument(
        "--api-key",
        default=argparse.SUPPRESS,
        metavar="KEY",
        help="bearer token for --base-url (default: $OPENAI_API_KEY)",
    )
    r.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="with --base-url: checkpoint directory whose tokenizer sizes the haystack",
    )
    r.add_argument(
        "--max-concurrency",
        type=int,
        default=8,
        metavar="N",
        help="with --base-url: questions in flight at once (default %(default)s)",
    )
    p.set_defaults(func=run)
    return p


def _fail(message: str, status: int = 2) -> int:
    print(f"kimitui eval recall: {message}", file=sys.stderr)
    return status


def _fill_engine_defaults(args: argparse.Namespace) -> None:
    # Engine flags given before `eval` are kept; the rest get their defaults here.
    p = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(p)
    for key, value in vars(p.parse_args([])).items():
        if not hasattr(args, key):
            setattr(args, key, value)


def run(args: argparse.Namespace) -> int:
    from kimitui.eval.recall import format_table, parse_context_lengths, parse_depths, run_recall

    _fill_engine_defaults(args)
    base_url = getattr(args, "base_url", None)
    target = None
    try:
        lengths = parse_context_lengths(args.context_lengths)
        depths = parse_depths(args.depths)
        if args.codes_per_depth < 1:
            raise ValueError(f"--codes-per-depth must be >= 1, got {args.codes_per_depth}")
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if args.json and not Path(args.json).expanduser().resolve().parent.is_dir():
            raise ValueError(f"--json: directory {Path(args.json).expanduser().parent} does not exist")
        target = _http_target(args, base_url) if base_url else _in_process_target(args)
        print(
            f"kimitui eval recall: {len(depths) * args.codes_per_depth} codes at depths {args.depths}, "
            f"lengths {', '.join(map(str, lengths))}, against {target.describe}",
            file=sys.stderr,
            flush=True,
        )
        result = run_recall(
            target,
            lengths,
            depths,
            args.codes_per_depth,
            args.seed,
            args.max_tokens,
            progress=lambda m: print(f"kimitui eval recall: {m}", file=sys.stderr, flush=True),
        )
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        return _fail(str(e))
    except ConnectionError as e:
        return _fail(str(e), 1)
    finally:
        if target is not None:
            target.close()
    print(format_table(result))
    if args.json:
        path = Path(args.json).expanduser()
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"kimitui eval recall: saved {path}", file=sys.stderr)
    return 0


def _in_process_target(args: argparse.Namespace):
    from kimitui.engine import LLM
    from kimitui.engine.demo import DEMO_MODELS
    from kimitui.eval.recall import in_process_target

    if args.tokenizer:
        raise ValueError("--tokenizer is for --base-url; in-process runs use the checkpoint's")
    if args.model and args.model not in DEMO_MODELS and not Path(args.model).expanduser().is_dir():
        raise ValueError(f"model directory {args.model} does not exist")
    print(f"kimitui eval recall: loading {args.model or 'the demo checkpoint'} ...", file=sys.stderr, flush=True)
    llm = LLM(**asdict(engine_args_from(args)))  # LLM takes every EngineArgs field by name
    return in_process_target(llm, args.model or "demo")


def _http_target(args: argparse.Namespace, base_url: str):
    from kimitui.bench.targets import HttpTarget, load_tokenizer
    from kimitui.eval.recall import http_target

    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    # Fail on a bad --tokenizer before touching the network; otherwise pick one for the served name
    # (its checkpoint directory when the server serves a path, else a demo's), as `bench` does.
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    api_key = getattr(args, "api_key", None) or os.environ.get("OPENAI_API_KEY")
    return http_target(
        base_url,
        args.model,
        lambda name: tokenizer or HttpTarget._default_tokenizer(name),
        api_key=api_key,
        max_concurrency=args.max_concurrency,
    )
