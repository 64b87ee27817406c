"""`kimitui eval`: fidelity measurements of a serving path (kl; recall when installed)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from
from kimitui.eval.kl_setup import checkpoint_tokenizer, describe_engine, model_dir, plain_path

_RECALL_MODULE = "kimitui.commands.eval_recall"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` and its subcommands on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "eval",
        help="fidelity of a serving path: KL against a reference, long-context recall",
        description=__doc__.splitlines()[0],
    )
    sub = p.add_subparsers(dest="eval_command", metavar="{kl,recall}")
    sub.required = True
    _add_kl(sub)
    try:
        recall = importlib.import_module(_RECALL_MODULE)
    except ModuleNotFoundError as e:
        if e.name != _RECALL_MODULE:
            raise
    else:
        recall.add_parser(sub)
        sub.choices["recall"].set_defaults(eval_run=recall.run)
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    return p


def run(args: argparse.Namespace) -> int:
    return args.eval_run(args)


def _add_kl(sub) -> None:
    p = sub.add_parser(
        "kl",
        help="KL divergence of the path the engine flags choose against float32 (or a saved reference)",
        description="KL divergence, top-1 agreement (llama.cpp's 'same top p') and Δp of a serving path "
        "(dtype, quantised experts, --cpu-offload, tensor parallel, KIMITUI_EMULATE_DEVICE, "
        "--speculative-config, or a remote --base-url) against a reference: float32 on the same "
        "checkpoint in this process, or a file saved with --save-base (llama.cpp's "
        "--kl-divergence-base). Prefill-path and decode-path positions are reported apart.",
    )
    add_engine_arguments(p, subcommand=True)
    g = p.add_argument_group("kl")
    g.add_argument(
        "--prompts",
        metavar="FILE",
        default=None,
        help='prompt file: .jsonl ({"prompt_token_ids": [...]} or {"text": ...} per line) or text, '
        "cut into --prompt-len token prompts; default: generated (random ordinary tokens)",
    )
    g.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts to score (default %(default)s)")
    g.add_argument("--prompt-len", type=int, default=128, metavar="L", help="tokens per prompt (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    g.add_argument(
        "--decode-tokens",
        type=int,
        default=16,
        metavar="K",
        help="the last K positions of each prompt go through the decode path, teacher-forced "
        "(default %(default)s; 0: prefill only)",
    )
    g.add_argument(
        "--base", metavar="FILE", default=None, help="reference log-probs saved by --save-base (its prompts are used)"
    )
    g.add_argument(
        "--save-base",
        metavar="FILE",
        default=None,
        help="score the prompts with the path the engine flags choose and save them as a reference; "
        "nothing is compared",
    )
    g.add_argument(
        "--base-top-k",
        type=int,
        default=128,
        metavar="K",
        help="--save-base keeps each position's top K log-probs (default %(default)s; 0: all V, exact "
        "but V * 4 bytes a position)",
    )
    g.add_argument("--chunk", type=int, default=256, metavar="N", help="rows per piece compared (memory bound)")
    g.add_argument(
        "--base-url",
        default=argparse.SUPPRESS,
        metavar="URL",
        help="measure a remote OpenAI-compatible server (top-k log-probs of the prompt: an "
        "approximation, prefill only) against the reference",
    )
    g.add_argument("--api-key", default=argparse.SUPPRESS, metavar="KEY", help="bearer token for --base-url")
    g.add_argument("--remote-model", default=None, metavar="NAME", help="model name at --base-url (default: its first)")
    g.add_argument("--remote-top-k", type=int, default=20, metavar="K", help="top-k log-probs asked of the server")
    g.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.set_defaults(eval_run=run_kl)


def run_kl(args: argparse.Namespace) -> int:
    from kimitui.engine import LLM
    from kimitui.eval.kl import format_report
    from kimitui.eval.kl_base import BaseWriter, load_base
    from kimitui.eval.kl_run import FileReference, measure, record_base
    from kimitui.eval.kl_sources import LocalSource, RemoteSource, apply_break

    base_url = getattr(args, "base_url", None)
    if args.base and args.save_base:
        raise ValueError("--base and --save-base exclude each other (load a reference, or save one)")
    if args.save_base and base_url:
        raise ValueError("--save-base scores with an in-process engine; drop --base-url")
    if args.chunk < 1:
        raise ValueError(f"--chunk must be >= 1, got {args.chunk}")
    if args.decode_tokens < 0:
        raise ValueError(f"--decode-tokens must be >= 0, got {args.decode_tokens}")
    engine_args = engine_args_from(args)  # validate the flags before any load
    reference = None
    if args.base:
        records, info = load_base(args.base)
        reference = FileReference(records)
        prompts = reference.prompts
        ref_desc = f"file {args.base} ({info.get('path', '?')}, top-k {info.get('top_k') or 'all'})"
    else:
        prompts = _prompts(args, engine_args.model)
    longest = max(len(t) for t in prompts)
    if engine_args.max_model_len is None:
        engine_args = replace(engine_args, max_model_len=longest + 8)
    elif longest > engine_args.max_model_len:
        raise ValueError(f"a prompt has {longest} tokens, more than --max-model-len {engine_args.max_model_len}")
    progress = _progress_printer()
    llms = []
    try:
        if args.save_base:
            llm = _load(LLM, engine_args, "reference to save")
            llms.append(llm)
            writer = BaseWriter(
                args.base_top_k, {"path": describe_engine(engine_args), "model": str(engine_args.model)}
            )
            record_base(prompts, LocalSource(llm, args.chunk), writer, progress("scoring"))
            writer.save(args.save_base)
            print(
                f"saved the log-probs of {len(prompts)} prompts ({sum(len(t) - 1 for t in prompts)} positions, "
                f"top-k {args.base_top_k or 'all'}) of {describe_engine(engine_args)} to {args.save_base}"
            )
            return 0
        if reference is None:
            ref_args = replace(
                engine_args,
                dtype="float32",
                tensor_parallel_size=1,
                speculative_config=None,
                max_num_seqs=1,
                enable_prefix_caching=False,
            )
            with plain_path():
                ref_llm = _load(LLM, ref_args, "float32 reference")
            llms.append(ref_llm)
            reference = LocalSource(ref_llm, args.chunk)
            ref_desc = f"float32 in this process ({engine_args.model or 'demo'})"
        broken = None
        if base_url:
            test = RemoteSource(
                base_url,
                args.remote_model,
                getattr(args, "api_key", None) or os.environ.get("OPENAI_API_KEY"),
                args.remote_top_k,
            )
            test_desc = f"remote {base_url} (model {test.model}, top-{args.remote_top_k} log-probs, prefill only)"
        else:
            test_llm = _load(LLM, replace(engine_args, enable_prefix_caching=False), "path under test")
            llms.append(test_llm)
            broken = apply_break(test_llm)
            test = LocalSource(test_llm, args.chunk)
            test_desc = describe_engine(engine_args) + (f", {broken}" if broken else "")
        report = measure(prompts, reference, test, args.decode_tokens, progress("comparing"))
    finally:
        for llm in llms:
            llm.shutdown()
    summary = report.summary()
    summary.update(
        {
            "reference": ref_desc,
            "tested": test_desc,
            "num_prompts": len(prompts),
            "decode_tokens": args.decode_tokens if not base_url else 0,
        }
    )
    if broken:
        summary["broken"] = broken
    print(format_report(summary, f"kimitui eval kl: {test_desc}\n  against {ref_desc}; {len(prompts)} prompts"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _prompts(args, model) -> list[list[int]]:
    from kimitui.engine.config import ModelConfig
    from kimitui.eval.kl_run import file_prompts, generated_prompts

    folder = model_dir(model)
    tok = checkpoint_tokenizer(folder)
    if args.prompts:
        return file_prompts(args.prompts, tok, args.num_prompts, args.prompt_len)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    if tok is not None:
        vocab = min(vocab, tok.vocab_size)
    return generated_prompts(
        vocab, args.num_prompts, args.prompt_len, args.seed, tok.special_ids if tok is not None else frozenset()
    )


def _load(llm_cls, engine_args, what: str):
    print(f"kimitui eval kl: loading the {what}: {describe_engine(engine_args)} ...", file=sys.stderr, flush=True)
    return llm_cls(**{f: getattr(engine_args, f) for f in engine_args.__dataclass_fields__})


def _progress_printer():
    def make(what: str):
        def report(done: int, total: int) -> None:
            print(f"\r{what}: {done}/{total} prompts", end="\n" if done == total else "", file=sys.stderr, flush=True)

        return report

    return make
