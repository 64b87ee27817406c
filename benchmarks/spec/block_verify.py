"""Block verification against the per-token rule: drafts kept, end to end and in isolation, and what
verification costs (CPU, one process).

1. End to end: the trained tiny pair (tests/fixtures/dspark_tiny) with vLLM's DSpark recipe
   (probabilistic drafts), sampled at each ``--temperatures`` value, the same seeded requests under
   ``rejection_sample_method`` ``standard`` and ``block``: acceptance rate and mean acceptance length
   (1 + accepted / drafts) from the engine's counters. Back-off is off so both rules see full blocks.
2. The verification call alone (``rejection_sample``) on K3-sized rows (vocabulary 163840, 7 drafts,
   ``--batch`` sequences, draft probabilities): the two rules alternate ``--repeats`` times in one
   process; medians and the block / standard ratio.

    python benchmarks/spec/block_verify.py [--requests 256] [--temperatures 0.7,1.0] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.spec.train_dspark import EVAL_PROMPTS, prompts  # noqa: E402
from kimitui.engine import LLM, SamplingParams  # noqa: E402
from kimitui.engine.sampling.sampler import SamplingBatch  # noqa: E402
from kimitui.engine.spec_decode.rejection import rejection_sample  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dspark_tiny"
METHODS = ("standard", "block")


def end_to_end(requests: int, temperature: float, max_tokens: int) -> dict[str, tuple[float, float]]:
    base = prompts(*EVAL_PROMPTS)
    batch = [base[i % len(base)] for i in range(requests)]
    out = {}
    for method in METHODS:
        spec = {
            "method": "dspark",
            "model": str(FIXTURE / "drafter"),
            "num_speculative_tokens": 7,
            "draft_sample_method": "probabilistic",
            "rejection_sample_method": method,
            "backoff": False,
        }
        params = [
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
            for i in range(requests)
        ]
        with LLM(
            str(FIXTURE / "target"), dtype="float32", max_model_len=128, max_num_seqs=32, speculative_config=spec
        ) as llm:
            llm.generate([{"prompt_token_ids": p} for p in batch], params)
            s = llm.engine.stats().spec_decode
        out[method] = (s.acceptance_rate, 1 + s.num_accepted_tokens / max(s.num_drafts, 1))
    return out


def verify_cost(batch: int, repeats: int, vocab: int = 163840, k: int = 7) -> dict[str, float]:
    torch.manual_seed(0)
    logits = torch.randn(batch * (k + 1), vocab)
    q = torch.randn(batch * k, vocab).softmax(-1)
    drafts = torch.multinomial(q, 1)[:, 0].view(batch, k).tolist()
    sb = SamplingBatch(
        temperature=torch.full((batch,), 0.8),
        top_p=torch.ones(batch),
        top_k=torch.zeros(batch, dtype=torch.int64),
        generators=[None] * batch,
        all_greedy=False,
        use_top_k=False,
        use_top_p=False,
        max_logprobs=-1,
    )
    times = {m: [] for m in METHODS}
    for m in METHODS:  # warm-up
        rejection_sample(logits, [k] * batch, drafts, sb, q, m)
    for _ in range(repeats):
        for m in METHODS:
            t = time.perf_counter()
            rejection_sample(logits, [k] * batch, drafts, sb, q, m)
            times[m].append(time.perf_counter() - t)
    return {m: statistics.median(v) for m, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for t in (float(x) for x in args.temperatures.split(",")):
        r = end_to_end(args.requests, t, args.max_tokens)
        line = ", ".join(f"{m}: acceptance {a:.3f}, mean length {n:.3f}" for m, (a, n) in r.items())
        print(f"T={t}: {line}")
    c = verify_cost(args.batch, args.repeats)
    print(
        f"rejection_sample, {args.batch} seqs x 7 drafts, V=163840 (median of {args.repeats}): "
        f"standard {c['standard'] * 1e3:.1f} ms, block {c['block'] * 1e3:.1f} ms, "
        f"block / standard {c['block'] / c['standard']:.2f}"
    )


if __name__ == "__main__":
    main()
