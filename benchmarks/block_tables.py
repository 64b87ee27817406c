"""Host cost of a decode step's block tables: persistent tables (engine/runner/block_tables.py) against the
full-width rebuild they replace, at two ``--max-model-len`` values.

64 sequences of ``--context`` tokens decode ``--steps`` steps (one token each; a sequence gets a block
every 16 tokens). Per step it times what rank 0 and a tensor-parallel worker do with the tables on
the host: ``ModelRunner.prepare`` (the runner's part), pickling ``StepInputs`` (the broadcast),
unpickling it (each worker) and ``_decode_inputs`` (the tables into their buffers). "rebuild" is the
path before persistent tables, run through the same runner: every decode's full table as a list,
zero-padded to ``max_blocks_per_seq`` into the step buffer (``StepBuffers.put_table``).

    python -m benchmarks.block_tables [--context 4096] [--steps 32]

Prints, per ``max_model_len``: milliseconds per step (median) of each part and the pickled bytes.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch

from kimitui.engine.layers.attn_metadata import AttentionMetadata
from kimitui.engine.runner.model_runner import ModelRunner
from kimitui.engine.scheduler.output import ScheduledSeq
from kimitui.engine.sequence import Sequence

BLOCK = 16
SEQS = 64


def _seqs(tokens: int) -> list[Sequence]:
    out = []
    for i in range(SEQS):
        s = Sequence(f"s{i}", [1] * tokens)
        s.num_computed_tokens = tokens - 1
        s.block_table = [i * 100_000 + j for j in range(-(-tokens // BLOCK))]
        out.append(s)
    return out


def _step(seqs) -> None:
    for s in seqs:
        s.output_token_ids.append(7)
        s.num_computed_tokens = s.num_tokens - 1
        if len(s.block_table) * BLOCK < s.num_tokens:
            s.block_table.append(s.block_table[-1] + 1)


def measure(max_model_len: int, context: int, steps: int, persistent: bool) -> dict:
    runner = ModelRunner(
        None, [], BLOCK, torch.device("cpu"), max_num_seqs=SEQS, max_model_len=max_model_len, decode_graphs=False
    )
    if not persistent:
        runner.table_rows = None  # prepare() then sends every table whole, as before
    seqs = _seqs(context)
    times: dict[str, list[float]] = {"prepare": [], "pickle": [], "unpickle": [], "fill": []}
    size = 0
    for i in range(steps + 1):
        order = [ScheduledSeq(s, 1, False, start=s.num_tokens - 1) for s in seqs]
        t0 = time.perf_counter()
        inp = runner.prepare(order)
        t1 = time.perf_counter()
        data = pickle.dumps(inp)
        t2 = time.perf_counter()
        inp = pickle.loads(data)
        t3 = time.perf_counter()
        meta = AttentionMetadata(positions=None, slot_mapping=None, block_size=BLOCK, num_decode_tokens=SEQS)
        runner._decode_inputs(inp, meta)
        t4 = time.perf_counter()
        if i:  # the first step writes every sequence's whole table once
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k].append(dt * 1e3)
            size = max(size, len(data))
        _step(seqs)
    return {k: statistics.median(v) for k, v in times.items()} | {"bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence at the start")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{SEQS} sequences of {args.context} tokens, {args.steps} decode steps, block size {BLOCK}")
    print(
        f"{'tables':<10} {'max_model_len':>13} {'prepare':>8} {'pickle':>8} {'unpickle':>9} {'fill':>8} "
        f"{'total ms':>9} {'bytes':>10}"
    )
    for persistent in (False, True):
        for max_len in (8192, 131072):
            if args.context + args.steps > max_len:
                print(f"{'persistent' if persistent else 'rebuild':<10} {max_len:>13}   (context above max_model_len)")
                continue
            r = measure(max_len, args.context, args.steps, persistent)
            total = r["prepare"] + r["pickle"] + r["unpickle"] + r["fill"]
            print(
                f"{'persistent' if persistent else 'rebuild':<10} {max_len:>13} {r['prepare']:>8.3f} "
                f"{r['pickle']:>8.3f} {r['unpickle']:>9.3f} {r['fill']:>8.3f} {total:>9.3f} {r['bytes']:>10}"
            )


if __name__ == "__main__":
    main()
