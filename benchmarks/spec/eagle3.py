"""Speculative decoding with the trained tiny MLA EAGLE-3 / EAGLE-3.1 drafters, next to ngram and
suffix, on their tiny K2 target (tests/fixtures/eagle3_mla_pair, made by
``python -m benchmarks.spec.train_eagle3``): decode tok/s and its speedup over no speculation,
acceptance, and tokens per verifying step (1 + accepted / drafts), at batch 1, 4 and 16.

One engine per proposer (each with its own back-off, on as by default), all alive; every repeat
runs each once, alternating; medians over ``--repeats``. ``--workload train`` (default): the first
training prompts, whose continuations the drafters learnt (tiny drafters memorise; ``fresh``: new
random prompts, where they reach ~20-30%). The target is tiny (hidden 64,
6 layers), so a step costs little beyond fixed per-step overhead: read the acceptance and tokens
per step, and the speedups only as what that overhead allows.

    python -m benchmarks.spec.eagle3 [--batches 1,4,16] [--tokens 32] [--repeats 3] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

from kimitui.engine import LLM, SamplingParams

PAIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "eagle3_mla_pair"


def decode_rate(outs) -> float:
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    t0 = min(o.metrics.first_token_time for o in outs)
    t1 = max(o.metrics.finished_time for o in outs)
    return tokens / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default=str(PAIR))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--proposers", default="ngram,suffix,eagle3-mla,eagle3.1-mla")
    ap.add_argument(
        "--workload",
        choices=("train", "fresh"),
        default="train",
        help="train: the first training prompts (the continuations the drafters learnt); fresh: new random ones",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    pair = Path(a.pair)
    target = str(pair / "target")
    vocab = json.loads((pair / "target" / "config.json").read_text())["vocab_size"]
    specs = {"none": None}
    for name in a.proposers.split(","):
        if name in ("ngram", "suffix"):
            specs[name] = {"method": name, "num_speculative_tokens": a.k}
        else:
            specs[name] = {
                "method": "eagle3",
                "model": str(pair / name),
                "num_speculative_tokens": a.k,
                "eagle_aux_hidden_state_layer_convention": "input",
            }
    llms = {
        n: LLM(target, dtype="float32", max_model_len=128, max_num_seqs=16, speculative_config=s)
        for n, s in specs.items()
    }
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    rows = []
    print(f"| batch | proposer | decode tok/s | speedup | acceptance | tokens per step |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in a.batches.split(",")):
        if a.workload == "train":
            from benchmarks.spec.train_eagle3 import prompts as train_prompts

            prompts = train_prompts(128, 1, vocab)[:batch]
        else:
            rng = random.Random(100 + batch)
            prompts = [[rng.randrange(3, vocab - 2) for _ in range(rng.choice((6, 10, 14)))] for _ in range(batch)]
        for llm in llms.values():  # warm-up
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, ignore_eos=True))
        rates = {n: [] for n in llms}
        stats, tokens = {}, {}
        for _ in range(a.repeats):
            for name, llm in llms.items():
                before = llm.engine.spec_stats.copy() if specs[name] else None
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                rates[name].append(decode_rate(outs))
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
                if before is not None:
                    st = llm.engine.spec_stats.since(before)
                    stats.setdefault(name, []).append(st)
        base = statistics.median(rates["none"])
        for name in llms:
            med = statistics.median(rates[name])
            acc = drafts = accepted = None
            if name in stats:
                drafts = sum(s.num_drafts for s in stats[name])
                dt = sum(s.num_draft_tokens for s in stats[name])
                accepted = sum(s.num_accepted_tokens for s in stats[name])
                acc = accepted / dt if dt else None
            per_step = 1 + accepted / drafts if drafts else None
            same = tokens[name] == tokens["none"]
            rows.append(
                {
                    "batch": batch,
                    "proposer": name,
                    "decode_tok_s": med,
                    "speedup": med / base,
                    "acceptance": acc,
                    "tokens_per_step": per_step,
                    "same_tokens": same,
                }
            )
            print(
                f"| {batch} | {name} | {med:.1f} | {med / base:.2f}x | "
                f"{'-' if acc is None else f'{100 * acc:.1f}%'} | {'-' if per_step is None else f'{per_step:.2f}'} |"
                f"{'' if same else ' TOKENS DIFFER'}"
            )
    for llm in llms.values():
        llm.engine.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
