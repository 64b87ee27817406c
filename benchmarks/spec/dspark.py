"""K3 + DSpark against ngram / suffix and no speculation, on the trained tiny pair (CPU, one process).

The pair is tests/fixtures/dspark_tiny (benchmarks/spec/train_dspark.py): a tiny random-weight Kimi K3
target and a DSpark drafter trained on its greedy continuations of the prompts used here, so the
drafter's acceptance is high and the measurement prices the mechanism (the target's taps, the
drafter's context cache and block pass, the KDA rollback, verification of 1 + k rows) rather than a
drafter's quality. Each engine is built once; the configurations run alternately ``--repeats``
times and the median wall time of a whole ``generate`` (prefill included) is kept. Printed per batch
size: tok/s, speedup over no speculation, acceptance rate and mean acceptance length.

The target is tiny (hidden 64): a decode step costs about as much in Python overhead as the
drafter's pass, so these ratios say nothing about a real K3 (where a step reads ~50 GB of weights
and the drafter ~5 GB); they show what the machinery costs where the model costs nothing.

    python benchmarks/spec/dspark.py [--batches 1,4,16] [--repeats 3] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.spec.train_dspark import EVAL_PROMPTS, MAX_TOKENS, prompts  # noqa: E402
from kimitui.engine import LLM, SamplingParams  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dspark_tiny"


def configs(k: int) -> dict[str, dict | None]:
    drafter = str(FIXTURE / "drafter")
    return {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": k},
        "dspark": {"method": "dspark", "model": drafter, "num_speculative_tokens": k},
        "dspark-no-backoff": {"method": "dspark", "model": drafter, "num_speculative_tokens": k, "backoff": False},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    base = prompts(*EVAL_PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engines = {
        name: LLM(
            str(FIXTURE / "target"),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=max(batches),
            enable_prefix_caching=False,
            **({"speculative_config": spec} if spec else {}),
        )
        for name, spec in configs(args.k).items()
    }
    results = []
    try:
        for batch in batches:
            reqs = [{"prompt_token_ids": base[i % len(base)]} for i in range(batch)]
            times: dict[str, list[float]] = {name: [] for name in engines}
            for llm in engines.values():  # warm-up
                llm.generate(reqs, params)
            before = {name: llm.engine.stats().spec_decode for name, llm in engines.items()}
            for _ in range(args.repeats):
                for name, llm in engines.items():  # alternating
                    t = time.perf_counter()
                    llm.generate(reqs, params)
                    times[name].append(time.perf_counter() - t)
            tokens = batch * MAX_TOKENS
            base_t = statistics.median(times["none"])
            for name, llm in engines.items():
                med = statistics.median(times[name])
                s, b = llm.engine.stats().spec_decode, before[name]
                row = {"batch": batch, "config": name, "tok_s": tokens / med, "speedup": base_t / med}
                if s is not None and b is not None:
                    drafts, drafted = s.num_drafts - b.num_drafts, s.num_draft_tokens - b.num_draft_tokens
                    acc = s.num_accepted_tokens - b.num_accepted_tokens
                    row |= {
                        "acceptance": acc / drafted if drafted else 0.0,
                        "acceptance_length": 1 + acc / drafts if drafts else 1.0,
                        "draft_tokens_per_step": drafted / drafts if drafts else 0.0,
                    }
                results.append(row)
                extra = (
                    f"  acceptance {row['acceptance']:.3f}  length {row['acceptance_length']:.2f}"
                    if "acceptance" in row
                    else ""
                )
                print(
                    f"batch {batch:2d}  {name:18s} {row['tok_s']:8.1f} tok/s  x{row['speedup']:.2f}{extra}", flush=True
                )
    finally:
        for llm in engines.values():
            llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
