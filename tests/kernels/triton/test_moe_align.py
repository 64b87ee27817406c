"""kernels/triton/moe_align.py: the expert alignment spread over many small programs.

Two halves. On the plain CPU (no interpreter), the launch the wrapper makes at Kimi sizes is
recorded and checked: many programs, each with a bounded share of the pairs and slots, one short
serial loop. Under TRITON_INTERPRET=1 (a child process, as the other interpreter files), the kernel
matches the PyTorch version and the plain-loop reference bit for bit, is one launch without host
syncs, and each program's vector work, measured inside the interpreter
(``tests.helpers.program_work``), stays small at K2/K3 decode sizes: the previous single-program
kernel made 46 million elements in its one program at K2 batch 16.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.interpret import case_registry, child_main, needs_triton, run_interpreted

CASES, case = case_registry()

# (tokens, top-k, experts): Kimi K2 (384 experts, top-8) and K3 (896 experts, top-16) decode steps,
# and the largest batch fused_moe aligns with this kernel (4096 pairs).
KIMI_DECODE = {
    "k2_batch16": (16, 8, 384),
    "k2_batch64": (64, 8, 384),
    "k3_batch64": (64, 16, 896),
    "k3_4096_pairs": (256, 16, 896),
}


def _block_m(pairs: int) -> int:
    return 16 if pairs <= 64 else 64  # fused_moe's BLOCK_M rule


def _routed(tokens, top_k, experts):
    return torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])


def _check(topk_ids, block, experts):
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_align import moe_align_block_size
    from kimitui.kernels.triton.moe_align import moe_align_block_size_torch as aten_align

    got = moe_align_block_size(topk_ids, block, experts)
    for want in (ref.moe_align_block_size(topk_ids, block, experts), aten_align(topk_ids, block, experts)):
        for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
            assert g.dtype == torch.int32 and torch.equal(g, w), (name, g, w)


# --- interpreter cases ------------------------------------------------------------------------


@case
def edge_shapes_match_references():
    _check(torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32) - 1, 4, 4)  # vLLM's example
    ids = torch.randint(0, 9, (5, 3))
    ids[0, 0] = 8  # == E: computed elsewhere, no slot
    ids[3, :] = 8
    _check(ids, 4, 8)
    _check(torch.zeros(6, 2, dtype=torch.int32), 16, 1)  # one expert
    _check(torch.randint(0, 512, (30, 8)), 16, 512)  # E a power of two: the search's first step is E itself
    _check(torch.randint(0, 40, (9, 6)), 5, 40)  # BLOCK_M not a power of two
    _check(torch.randint(0, 40, (9, 6)), 1, 40)
    _check(torch.randint(0, 6, (1, 1)), 16, 5)  # one pair
    _check(torch.randint(0, 9, (275, 4)), 4, 8)  # 1100 pairs: two id chunks, many same-expert pairs per program


@case
def kimi_decode_shapes_match_references():
    for name in ("k2_batch16", "k3_batch64"):
        tokens, top_k, experts = KIMI_DECODE[name]
        if name == "k3_batch64":
            tokens = 8  # 128 pairs: 16 programs (batch 64 takes about a minute interpreted)
        _check(_routed(tokens, top_k, experts), _block_m(tokens * top_k), experts)
    _check(_routed(4, 16, 896), 16, 896)  # K3 at batch 4: 64 pairs, BLOCK_M 16
    ids = torch.randint(0, 7, (40, 8))  # many pairs on few of 384 experts: full tiles, long runs
    ids[::3, 0] = 384  # some computed elsewhere
    _check(ids, 64, 384)


@case
def per_program_work_is_small_at_kimi_sizes():
    from kimitui.kernels.triton.moe_align import align_launch, moe_align_block_size
    from tests.helpers.program_work import program_work

    notes = []
    for tokens, top_k, experts in ((16, 8, 384), (8, 16, 896)):
        pairs, block = tokens * top_k, _block_m(tokens * top_k)
        with program_work() as work:
            moe_align_block_size(_routed(tokens, top_k, experts), block, experts)
        launch = align_launch(pairs, block, experts)
        assert work.programs == launch.programs > 1, (work.programs, launch)
        # measured 46,295,754 elements in the one program of the previous kernel at K2 batch 16
        assert work.max_elements <= 150_000, work.max_elements
        notes.append(
            f"E={experts} pairs={pairs}: {work.programs} programs, at most {work.max_elements} "
            f"elements each, {work.total_elements} in all"
        )
    return "; ".join(notes)


@case
def one_launch_no_host_sync():
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.moe_align import moe_align_block_size

    ids = _routed(8, 16, 896)
    with count_launches() as counts:
        moe_align_block_size(ids, 64, 896)
    assert dict(counts.triton) == {"_moe_align_kernel": 1} and counts.kernels == 1, counts
    assert not counts.host_syncs, counts
    return counts.summary()


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_moe_align")


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result


class _Recorder:
    """Stands in for the Triton kernel: records the grid and arguments of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch


@pytest.mark.parametrize("shape", sorted(KIMI_DECODE))
def test_launch_spreads_the_work_over_programs(shape, monkeypatch):
    import triton

    import kimitui.kernels.triton.moe_align as moe_align

    tokens, top_k, experts = KIMI_DECODE[shape]
    pairs, block = tokens * top_k, _block_m(tokens * top_k)
    recorder = _Recorder()
    monkeypatch.setattr(moe_align, "_moe_align_kernel", recorder)
    monkeypatch.setattr(moe_align, "check_device", lambda *tensors: None)  # CPU tensors, nothing runs
    sorted_ids, expert_ids, _ = moe_align.moe_align_block_size(_routed(tokens, top_k, experts), block, experts)
    ((grid, _, meta),) = recorder.launches
    programs = grid[0]
    num_blocks = expert_ids.numel()
    assert sorted_ids.numel() == num_blocks * block
    # the previous kernel: grid (1,), and [16, 512] or [8, 1024] compares over every slot in its one program
    assert programs >= triton.cdiv(num_blocks * block, 1024) and programs > 1, grid
    assert programs * meta["PAIRS"] >= pairs and programs * meta["TILES"] >= num_blocks, (grid, meta)
    assert meta["PAIRS"] <= 64 and meta["TILES"] * meta["BLOCK_SIZE_P2"] <= 1024, meta  # small tiles per program
    assert triton.cdiv(pairs, meta["ID_CHUNK"]) <= 4, meta  # the one serial loop: the id histogram
    launch = moe_align.align_launch(pairs, block, experts)
    assert (launch.programs,) == grid and launch.kernel_args() == {k: meta[k] for k in launch.kernel_args()}
    assert launch.work_per_program <= 80_000, launch.work_per_program
