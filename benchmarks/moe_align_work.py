"""The work of ``kernels/triton/moe_align.py``, old single-program kernel against the new grid, on the CPU.

No GPU and no Triton interpreter: each kernel's algorithm is replayed with numpy, one vector
operation per Triton operation, on the tiles the kernel uses (the old one: [CHUNK, BLOCK_E] one-hot
compares over the pairs, the tiles and every slot, in one program; the new one: per program a
histogram of the ids, a prefix sum over BLOCK_E, a [PAIRS, PAIRS] compare, a binary search per tile
and the pad tile, from ``align_launch``). Both replays are checked against
``moe_align.moe_align_block_size_torch`` bit for bit, then timed. On a GPU the programs of a launch run
side by side, so the figure that matters is the slowest program (the old kernel has one); the sum
over programs is printed as well. Also printed: the serial loop trips of the slowest program and the
element count of its vector operations.

    python benchmarks/moe_align_work.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimitui.kernels.triton.moe_align import align_launch  # noqa: E402
from kimitui.kernels.triton.moe_align import moe_align_block_size_torch as torch_align  # noqa: E402

# (name, tokens, top-k, experts): Kimi K2 (384 experts, top-8) and K3 (896 experts, top-16) decode
SHAPES = [
    ("K2 batch 1", 1, 8, 384),
    ("K2 batch 16", 16, 8, 384),
    ("K2 batch 64", 64, 8, 384),
    ("K3 batch 1", 1, 16, 896),
    ("K3 batch 16", 16, 16, 896),
    ("K3 batch 64", 64, 16, 896),
]


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Work:
    """Counts serial loop trips and vector elements of one program."""

    def __init__(self):
        self.trips = 0
        self.elements = 0

    def op(self, *arrays):
        self.elements += sum(np.size(a) for a in arrays)


def old_kernel(flat: np.ndarray, block_size: int, num_experts: int):
    """The previous ``_moe_align_kernel``: one program, [CHUNK, BLOCK_E] one-hot tiles."""
    numel = flat.size
    num_blocks = min(-(-(numel + num_experts * (block_size - 1)) // block_size), numel)
    size = num_blocks * block_size
    block_e = _next_pow2(num_experts)
    chunk = max(1, min(64, 8192 // block_e))
    e = np.arange(block_e)
    real = e < num_experts
    p = np.arange(chunk)
    w = _Work()
    sorted_ids = np.zeros(size, np.int32)
    expert_ids = np.zeros(num_blocks, np.int32)

    def onehot_of(start):
        offs = start + p
        ids = np.where(offs < numel, flat[np.minimum(offs, numel - 1)], -1)
        onehot = ((ids[:, None] == e[None, :]) & real[None, :]).astype(np.int32)
        w.op(onehot, onehot)
        return offs, ids, onehot

    counts = np.zeros(block_e, np.int64)
    for start in range(0, numel, chunk):
        w.trips += 1
        _, _, onehot = onehot_of(start)
        counts += onehot.sum(0)
        w.op(onehot)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = np.cumsum(padded)
    padded_start = padded_end - padded
    filled_end = padded_start + counts
    w.op(padded, padded_end, padded_start, filled_end)
    for b0 in range(0, num_blocks, chunk):
        w.trips += 1
        blocks = b0 + p
        before = ((padded_end[None, :] <= (blocks * block_size)[:, None]) & real[None, :]).astype(np.int32)
        owner = np.minimum(before.sum(1), num_experts - 1)
        w.op(before, before, before)
        ok = blocks < num_blocks
        expert_ids[blocks[ok]] = owner[ok]
    for s0 in range(0, size, chunk):
        w.trips += 1
        slots = s0 + p
        holds = (padded_start[None, :] <= slots[:, None]) & (slots[:, None] < filled_end[None, :]) & real[None, :]
        is_pad = holds.sum(1) == 0
        w.op(holds, holds, holds, holds, holds)
        ok = (slots < size) & is_pad
        sorted_ids[slots[ok]] = numel
    cursor = padded_start.copy()
    for start in range(0, numel, chunk):
        w.trips += 1
        offs, ids, onehot = onehot_of(start)
        earlier = np.cumsum(onehot, 0) - onehot
        dest = (onehot * (cursor[None, :] + earlier)).sum(1)
        w.op(earlier, earlier, onehot, onehot)
        ok = (ids >= 0) & (ids < num_experts) & (offs < numel)
        sorted_ids[dest[ok]] = offs[ok]
        cursor += onehot.sum(0)
    return (sorted_ids, expert_ids, int(padded.sum())), [w]


def new_kernel(flat: np.ndarray, block_size: int, num_experts: int):
    """The new ``_moe_align_kernel``: ``align_launch``'s grid, each program replayed in turn."""
    numel = flat.size
    launch = align_launch(numel, block_size, num_experts)
    sorted_ids = np.zeros(launch.num_blocks * block_size, np.int32)
    expert_ids = np.zeros(launch.num_blocks, np.int32)
    works = []
    total = 0
    for pid in range(launch.programs):
        w = _Work()
        pair_start = pid * launch.pairs
        counts = np.zeros(launch.block_e, np.int64)
        before = np.zeros(launch.block_e, np.int64)
        for start in range(0, numel, launch.id_chunk):
            w.trips += 1
            offs = start + np.arange(launch.id_chunk)
            ids = np.where(offs < numel, flat[np.minimum(offs, numel - 1)], -1)
            routed = (ids >= 0) & (ids < num_experts)
            ids = np.where(routed, ids, 0)
            counts += np.bincount(ids[routed], minlength=launch.block_e)
            before += np.bincount(ids[routed & (offs < pair_start)], minlength=launch.block_e)
            w.op(offs, ids, routed, ids, counts, before)
        padded = (counts + block_size - 1) // block_size * block_size
        padded_end = np.cumsum(padded)
        padded_start = padded_end - padded
        filled_end = padded_start + counts
        w.op(padded, padded_end, padded_start, filled_end)
        total = int(padded.sum())
        i = np.arange(launch.pairs)
        p = pair_start + i
        ids = np.where(p < numel, flat[np.minimum(p, numel - 1)], -1)
        routed = (ids >= 0) & (ids < num_experts)
        ids = np.where(routed, ids, 0)
        same = (ids[:, None] == ids[None, :]) & routed[None, :] & (i[None, :] < i[:, None])
        dest = (padded_start + before)[ids] + same.sum(1)
        w.op(same, same, same, dest)
        sorted_ids[dest[routed]] = p[routed]
        t = pid * launch.tiles + np.arange(launch.tiles)
        first = t * block_size
        owner = np.zeros(launch.tiles, np.int64)
        for s in range(launch.search_steps):
            cand = owner + (launch.block_e >> s)
            ends = padded_end[np.minimum(cand, num_experts) - 1]
            owner = np.where((cand <= num_experts) & (ends <= first), cand, owner)
            w.op(cand, ends, owner)
        expert = np.minimum(owner, num_experts - 1)
        ok = t < launch.num_blocks
        expert_ids[t[ok]] = expert[ok]
        fill_end = np.where(owner < num_experts, filled_end[expert], 0)
        j = np.arange(launch.block_size_p2)
        slots = first[:, None] + j[None, :]
        pad = ok[:, None] & (j[None, :] < block_size) & (slots >= fill_end[:, None])
        w.op(slots, pad, pad)
        sorted_ids[slots[pad]] = numel
        works.append(w)
    return (sorted_ids, expert_ids, total), works


def _timed(fn, flat, block, experts, repeats):
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        fn(flat, block, experts)
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"{'shape':<12} {'pairs':>5} {'BLOCK_M':>7} | {'old: trips':>10} {'elements':>11} {'ms':>8} | "
        f"{'new: programs':>13} {'trips':>5} {'elements/prog':>13} {'ms/program':>11} {'all ms':>7} | "
        f"{'elements x':>10} {'time x':>7}"
    )
    for name, tokens, top_k, experts in SHAPES:
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
        pairs = tokens * top_k
        block = 16 if pairs <= 64 else 64  # fused_moe's BLOCK_M rule
        flat = ids.reshape(-1).numpy()
        want = [t.numpy() for t in torch_align(ids, block, experts)]
        (old_out, old_work), (new_out, new_work) = old_kernel(flat, block, experts), new_kernel(flat, block, experts)
        for out in (old_out, new_out):
            assert np.array_equal(out[0], want[0]) and np.array_equal(out[1], want[1]) and out[2] == want[2][0], name
        old_ms = _timed(old_kernel, flat, block, experts, args.repeats) * 1e3
        # the slowest program: replay each alone (the per-program time on a GPU), and the whole grid
        launch = align_launch(pairs, block, experts)
        all_ms = _timed(new_kernel, flat, block, experts, args.repeats) * 1e3
        per_prog_ms = all_ms / launch.programs
        worst = max(new_work, key=lambda w: w.elements)
        old_el = old_work[0].elements
        print(
            f"{name:<12} {pairs:>5} {block:>7} | {old_work[0].trips:>10} {old_el:>11,} {old_ms:>8.2f} | "
            f"{launch.programs:>13} {worst.trips:>5} {worst.elements:>13,} {per_prog_ms:>11.3f} {all_ms:>7.2f} | "
            f"{old_el / worst.elements:>10.0f} {old_ms / per_prog_ms:>7.0f}"
        )


if __name__ == "__main__":
    main()
