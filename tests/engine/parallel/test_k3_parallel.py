"""Kimi K3 over 2, 4 and 6 gloo ranks (uneven head, expert, latent and vocabulary splits) gives the
one-process answer."""

from __future__ import annotations

import random

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine.models.test_k3_checkpoint import needs_kda
from tests.helpers.k3_checkpoint import write_k3_checkpoint

# 7 MLA heads, 7 KDA heads, 10 experts: none divides by 4 or 6
SHAPES = {
    "mla_only": dict(kda_layers=(), full_attn_layers=(1, 2, 3, 4, 5)),
    "hybrid": dict(),
}


def _run(path, prompts, par=None):
    from tests.helpers.hybrid_driver import HybridDriver

    drv = HybridDriver(path, max_seqs=4, max_len=128, par=par)
    return drv.prompt_logprobs(prompts, budget=40), drv.greedy(prompts, 6)


def _rank_main(rank, world, path, init_file, prompts, out_file):
    import torch.distributed as dist

    from kimitui.engine.parallel.state import ParallelState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = _run(path, prompts, ParallelState(rank=rank, world_size=world))
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[pytest.param("mla_only"), pytest.param("hybrid", marks=needs_kda)])
def single(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_k3_checkpoint(path, seed=4, kda_heads=7, mla_heads=7, num_experts=10, **SHAPES[request.param])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 70)]
    return path, prompts, _run(path, prompts)


@pytest.mark.parametrize("world", [2, 4, 6])
def test_tensor_parallel_matches_one_process(single, world, tmp_path):
    path, prompts, (want_lp, want_tokens) = single
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(world, str(path), str(tmp_path / "init"), prompts, str(out)), nprocs=world)
    got_lp, got_tokens = torch.load(out)
    assert got_tokens == want_tokens
    for a, b in zip(want_lp, got_lp):
        assert (a - b).abs().max().item() < 1e-4
