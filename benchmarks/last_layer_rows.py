"""Prefill with and without last-layer row pruning, in the same process.

The last layer only needs outputs for the rows a step samples (see ``engine.runner.output_rows``);
the baseline computes every row there, as before. Both run one 2048-token prefill step (8 prompts
of 256 tokens, one new token each) on the 816M checkpoint of ``cpu_vs_transformers.py``, taking
turns for ``--rounds``; each keeps its fastest round.

    python benchmarks/last_layer_rows.py [--ckpt-dir DIR] [--rounds 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_vs_transformers import prompts, write_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", default=None, help="where to write/reuse the 816M checkpoint (3.3 GB)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    tmp = None if args.ckpt_dir else tempfile.TemporaryDirectory(prefix="kimitui-bench-")
    path = Path(args.ckpt_dir or tmp.name)
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path)

    import kimitui.engine.runner.model_runner as runner
    from kimitui.engine import LLM, SamplingParams

    pruned_rows = runner.output_rows
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False)
    batch = [{"prompt_token_ids": p} for p in prompts(8)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(batch[:1], params)  # warm-up
    best = {"all rows": float("inf"), "pruned": float("inf")}
    tokens = {}
    for _ in range(args.rounds):
        for name in best:
            runner.output_rows = pruned_rows if name == "pruned" else (lambda inp: (None, []))
            t = time.perf_counter()
            outs = llm.generate(batch, params)
            best[name] = min(best[name], time.perf_counter() - t)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    runner.output_rows = pruned_rows
    print(f"threads {torch.get_num_threads()}, 8 x 256-token prompts in one step, best of {args.rounds}")
    for name, t in best.items():
        print(f"  {name:<9} {t:6.2f} s")
    print(f"  speed-up {best['all rows'] / best['pruned']:.2f}x, same tokens: {tokens['all rows'] == tokens['pruned']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
