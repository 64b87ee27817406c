"""Our engine in a process of its own for the side-by-side benchmarks: ``Ours`` starts this file,
which loads one checkpoint and answers JSON lines on stdin (generate n prompts, timed with and
without the prompt's time; or save float32 log-probs for KL), its replies on a pipe of their own.

    python benchmarks/peers/engine_worker.py --result-fd FD --model DIR --dtype D --threads N
        --max-model-len L --max-num-seqs S
"""
# ruff: noqa: I001 (import order matters here: the engine sets OpenMP's wait policy before torch loads)

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.peers.worker_process import WorkerProcess  # noqa: E402


def worker(args) -> int:
    sys.path.insert(0, str(ROOT))
    from kimitui.engine import LLM, SamplingParams  # before torch: it sets OpenMP's wait policy
    import torch

    torch.set_num_threads(args.threads)
    out = os.fdopen(args.result_fd, "w", buffering=1)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
    )
    vocab = llm.engine.config.vocab_size

    def generate(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    out.write(json.dumps({"ready": f"kimitui {args.dtype}, torch {torch.__version__}", "vocab": vocab}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            batch = cmd["prompts"]
            res = {}
            if cmd.get("warmup"):
                generate(batch, 2)
                out.write(json.dumps({"warm": len(batch)}) + "\n")
                continue
            for key, max_tokens in (("ttft", 1), ("full", cmd["output_len"])):
                t0 = time.perf_counter()
                tokens = generate(batch, max_tokens)
                res[key] = time.perf_counter() - t0
            if any(len(t) != cmd["output_len"] for t in tokens):
                raise RuntimeError(f"asked for {cmd['output_len']} tokens, got {sorted({len(t) for t in tokens})}")
            out.write(json.dumps(res) + "\n")
        elif cmd["op"] == "logprobs":  # rows predicting positions first+1 .. n-1 of each sequence
            import numpy as np

            rows = []
            for seq in cmd["sequences"]:
                first = len(seq) // 2
                got = {}
                for piece in llm.score_logits(seq):
                    for i in range(piece.values.shape[0]):
                        got[piece.first_pos + i] = piece.values[i].float().numpy()
                rows.append(np.stack([got[p] for p in range(first + 1, len(seq))]))
            np.save(cmd["out"], np.stack(rows).astype(np.float32))
            out.write(json.dumps({"saved": cmd["out"]}) + "\n")
    return 0


class Ours(WorkerProcess):
    """This file's ``worker`` on one checkpoint, in a process of its own."""

    def __init__(
        self, model: Path, dtype: str, args, log: Path, max_num_seqs: int, max_model_len: int, env: dict | None = None
    ):
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--model",
            str(model),
            "--dtype",
            dtype,
            "--threads",
            str(args.threads),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
        ]
        super().__init__("kimitui", cmd, log, env)
        self.label, self.vocab = self.ready["ready"], self.ready["vocab"]


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    return worker(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
