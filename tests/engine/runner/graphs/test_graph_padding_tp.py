"""K2 under tensor parallel: a decode graph's padding rows leave the latent cache as eager leaves it,
even when the all-reduce gives rows with equal inputs different results.

On a GPU the all-reduce's summation order can differ per row (NCCL/RCCL split a tensor into chunks
reduced by different channels), so a padding row that repeats row 0's inputs need not reproduce row
0's output in the last bits. Before issue 38's fix a padding row wrote row 0's newest cache slot,
so such a difference ended up in row 0's cache. Here two gloo ranks run K2 (MLA + MoE, heads and
experts split) with an all-reduce that scales row i by ``1 + 1e-3 * i`` after the real reduction
(the same on both ranks), decode five sequences in bucket 8 eagerly and through the decode graph
runner's static buffers, and compare the logits and every layer's latent cache.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tests.helpers.checkpoints import write_hf_checkpoint

MAX_SEQS = 8
BLOCK = 16
LENS = [20, 5, 40, 17, 33]  # five decodes in bucket 8: three padding rows
PERTURB = 1e-3


def _perturbing_all_reduce(real):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        real(self, x)
        if self.is_parallel and x.dim() == 2:  # [rows, D]: row i as a reduction in another order might give
            x.mul_(1 + PERTURB * torch.arange(x.shape[0], dtype=x.dtype, device=x.device)[:, None])
        return x

    return all_reduce


def _rank_main(rank, world, path, init_file, out_file):
    import torch.distributed as dist

    from kimitui.engine.config import ModelConfig
    from kimitui.engine.kv_cache.pool import KVCachePool
    from kimitui.engine.loader import load_model
    from kimitui.engine.parallel.state import ParallelState
    from kimitui.engine.runner.model_runner import ModelRunner, StepInputs

    torch.set_num_threads(1)  # the C++ decode kernels then write rows in order: the last writer wins
    ParallelState.all_reduce = _perturbing_all_reduce(ParallelState.all_reduce)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        par = ParallelState(rank=rank, world_size=world, group=dist.group.WORLD)
        config = ModelConfig.from_pretrained(path)
        model, _ = load_model(config, path, torch.device("cpu"), torch.float32, 64, par=par)
        pool = KVCachePool(model.cache_specs(torch.float32), 4 * MAX_SEQS, BLOCK, MAX_SEQS, "cpu")
        gen = torch.Generator().manual_seed(0)  # the same latents on both ranks (MLA's cache is replicated)
        for c in pool.caches:
            c.copy_(torch.randn(c.shape, generator=gen) * 0.3)
        before = [c.clone() for c in pool.caches]
        tables = [[i * 4 + j for j in range(-(-n // BLOCK))] for i, n in enumerate(LENS)]
        inp = StepInputs(
            ids=[11, 12, 13, 14, 15],
            num_decodes=5,
            decode_tables=tables,
            decode_lens=list(LENS),
            prefills=[],
            sample_rows=list(range(5)),
        )
        results = {}
        for name, graphs in (("eager", False), ("graphed", True)):
            for c, b in zip(pool.caches, before):
                c.copy_(b)
            runner = ModelRunner(
                model,
                pool.caches,
                BLOCK,
                torch.device("cpu"),
                max_num_seqs=MAX_SEQS,
                max_model_len=64,
                decode_graphs=graphs,
            )
            logits, _ = runner.forward_step(inp)
            results[name] = (logits, [c.clone() for c in pool.caches])
        if rank == 0:
            torch.save(results, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as in test_graph_parallel: skip a teardown that occasionally aborted a finished rank


def test_k2_tp_padding_rows_leave_row0_cache_slot(tmp_path):
    path = tmp_path / "k2"
    write_hf_checkpoint(path, seed=5, num_hidden_layers=3)  # dense layer, then MoE layers; MLA everywhere
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, str(path), str(tmp_path / "init"), str(out)), nprocs=2)
    r = torch.load(out)
    (want, want_caches), (got, got_caches) = r["eager"], r["graphed"]
    blk, off = divmod(LENS[0] - 1, BLOCK)  # row 0's newest token (row 0's table is blocks 0, 1, ...)
    for i, (a, b) in enumerate(zip(got_caches, want_caches)):
        assert torch.equal(a[blk, off], b[blk, off]), f"layer {i}: row 0's newest latent was overwritten"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"layer {i}'s latent cache")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
