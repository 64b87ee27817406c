"""kimitui.kernels.launch_count on plain CPU tensors: what counts as a kernel, a collective, a host sync.
(Triton launches are counted in test_fused_small_ops, under the interpreter.)"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kimitui.kernels.launch_count import count_launches


def test_views_and_allocations_are_not_kernels_ops_are():
    x = torch.randn(4, 6)
    with count_launches() as counts:
        y = x.view(6, 4).t()[1:]  # views: no kernel
        z = torch.empty(3)  # allocation: no kernel
        w = (y * 2).sum(0) + 1  # three kernels
    assert dict(counts.aten) == {"mul": 1, "sum": 1, "add": 1}, counts
    assert counts.kernels == 3 and not counts.host_syncs and not counts.triton
    assert z.shape == (3,) and w.shape == (6,)
    assert counts.summary() == "3 kernels (3 ATen, 0 Triton), 0 collectives, 0 host syncs"


def test_host_syncs_are_counted():
    x = torch.randn(8)
    with count_launches() as counts:
        x.sum().item()  # a scalar read back
        x.nonzero()  # output size depends on the data
        if x[0] > 0:  # bool() of a tensor
            pass
    assert counts.host_syncs == {"_local_scalar_dense": 2, "nonzero": 1}, counts


def test_nothing_is_counted_outside_the_block():
    with count_launches() as counts:
        pass
    torch.randn(3).sum().item()
    assert counts.kernels == 0 and not counts.host_syncs


@pytest.fixture
def gloo_single_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_are_counted_apart_from_kernels(gloo_single_rank):
    x = torch.ones(4)
    with count_launches() as counts:
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
    assert counts.collectives == {"allreduce_": 1, "broadcast_": 1}, counts
    assert counts.kernels == 0
