"""The DSpark block pass reading its context in place against the gathered copy it used before
(engine/spec_decode/dspark/attention.py), one process, alternating, medians.

The drafter is the trained tiny pair's (tests/fixtures/dspark_tiny: 2 layers, kv_lora 16 + rope 8),
loaded through the engine so the target's embedding and LM head are shared and the backend is the one
a run picks. Its paged cache is filled with random latents (timing only) and ``S`` sequences get
block tables over ``C`` context positions plus the block's K. Timed: building the pass's context
(``DSparkProposer._paged``: one small host-to-device copy; ``_gathered``: the index and the copy of
S x C x layers latents) and the block pass itself (absorbed paged ``mla_decode`` against ``kv_b_proj``
over the copy and one padded attention).

The drafter is tiny: per-op overhead dominates short contexts on a CPU; the ratio at long contexts
is what the copy costs. On a GPU the paged read is the Triton MLA decode kernel.

    python benchmarks/spec/dspark_context.py [--contexts 64,512,2048] [--batches 1,4,16] [--repeats 15]
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

from kimitui.engine import LLM  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dspark_tiny"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="64,512,2048")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    k = 7
    spec = {"method": "dspark", "model": str(FIXTURE / "drafter"), "num_speculative_tokens": k}
    max_len = max(contexts) + 2 * k
    llm = LLM(str(FIXTURE / "target"), dtype="float32", max_model_len=max_len, max_num_seqs=4, speculative_config=spec)
    prop = llm.engine.spec.proposer
    drafter = prop.drafter
    bs = 16
    per_seq = -(-max_len // bs)
    prop.bind_cache(per_seq * max(batches) + 1, bs)
    torch.manual_seed(0)
    prop.cache.normal_()
    results = []
    try:
        for c in contexts:
            for s_n in batches:
                tables = [[1 + i * per_seq + j for j in range(per_seq)] for i in range(s_n)]
                firsts = [c] * s_n
                anchors = torch.randint(3, 250, (s_n,))
                firsts_t = torch.tensor(firsts)

                def paged():
                    return drafter.block_hidden(anchors, firsts_t, prop._paged(tables, firsts), None, k)

                def copied():
                    ctx, valid = prop._gathered(tables, firsts)
                    return drafter.block_hidden(anchors, firsts_t, ctx, valid, k)

                with torch.inference_mode():
                    a, b = paged(), copied()  # warm-up, and the two agree
                    diff = float((a - b).abs().max())
                    times = {"paged": [], "copy": []}
                    for _ in range(args.repeats):
                        for name, fn in (("paged", paged), ("copy", copied)):  # alternating
                            t = time.perf_counter()
                            fn()
                            times[name].append(time.perf_counter() - t)
                med = {n: statistics.median(v) for n, v in times.items()}
                row = {
                    "context": c,
                    "batch": s_n,
                    "paged_ms": 1e3 * med["paged"],
                    "copy_ms": 1e3 * med["copy"],
                    "copy_over_paged": med["copy"] / med["paged"],
                    "max_abs_diff": diff,
                }
                results.append(row)
                print(
                    f"context {c:5d}  batch {s_n:2d}  paged {row['paged_ms']:.3f} ms  copy {row['copy_ms']:.3f} ms"
                    f"  copy/paged x{row['copy_over_paged']:.2f}  max|diff| {diff:.1e}",
                    flush=True,
                )
    finally:
        llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
