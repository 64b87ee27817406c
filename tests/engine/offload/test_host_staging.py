"""The staging block between a device and its host experts: one packed copy in, one copy out, buffers
reused across layers and steps. Run here on CPU tensors (plain memory, no events): the executor only
uses it for device tensors, which a CPU-only machine does not have."""

from __future__ import annotations

import pytest
import torch

from kimitui.engine.layers.moe import ExpertStack
from kimitui.engine.offload.cpu_experts import CpuExpertExecutor
from kimitui.engine.offload.host_staging import HostStaging


def _inputs(t: int, d: int = 64, k: int = 4, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    ids = torch.randint(0, 16, (t, k), generator=g)  # int64, as the router returns them
    w = torch.rand(t, k, generator=g)  # float32, converted to x.dtype like the layer does
    return x, ids, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_block_carries_hidden_states_ids_and_weights(dtype):
    s = HostStaging()
    x, ids, w = _inputs(5, dtype=dtype)
    hx, hids, hw = s.stage_inputs(x, ids, w)
    s.wait_inputs()
    assert torch.equal(hx, x) and hx.shape == (5, 64) and hx.dtype == dtype
    assert hids.dtype == torch.int32 and torch.equal(hids.long(), ids)
    assert torch.equal(hw, w.to(dtype))
    # the three are views of one buffer: one copy moved them
    base = s._in.data_ptr()
    assert hx.data_ptr() == base and hids.data_ptr() > base and hw.data_ptr() > hids.data_ptr()
    assert s.capacity == 8 and s._in.numel() == 8 * HostStaging.in_row_bytes(64, 4, dtype)


def test_buffers_are_reused_and_grow_to_the_largest_step():
    s = HostStaging()
    s.stage_inputs(*_inputs(6))
    ptrs = (s._in.data_ptr(), s._out.data_ptr())
    for t in (1, 3, 8, 2):  # decode steps and a smaller prefill: no new allocation
        hx, _, _ = s.stage_inputs(*_inputs(t, seed=t))
        assert torch.equal(hx, _inputs(t, seed=t)[0])
        assert s.output(t).shape == (t, 64)
    assert s.allocations == 1 and (s._in.data_ptr(), s._out.data_ptr()) == ptrs
    s.stage_inputs(*_inputs(9))  # a larger step: the next power of two, kept from then on
    assert s.allocations == 2 and s.capacity == 16
    s.stage_inputs(*_inputs(16))
    assert s.allocations == 2
    s.stage_inputs(*_inputs(3, d=32))  # another layout (a second model on the same thread)
    assert s.allocations == 3 and s._out.numel() == s.capacity * 32


def test_reserve_sizes_both_buffers_up_front():
    s = HostStaging()
    s.reserve(100, torch.device("cpu"), torch.bfloat16, 64, 8)
    assert s.capacity == 128 and s._out.numel() == 128 * 64
    s.stage_inputs(*_inputs(100, k=8))
    assert s.allocations == 1


def test_output_block_goes_back_in_one_copy():
    s = HostStaging()
    x, ids, w = _inputs(3)
    s.stage_inputs(x, ids, w)
    out = s.output(3)
    out.copy_(x * 2)
    dev = s.to_device(out, x.device)
    assert torch.equal(dev, x * 2) and dev.data_ptr() != out.data_ptr()


def test_odd_byte_widths_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of 4 bytes"):
        HostStaging().stage_inputs(*_inputs(2, d=63))


class _DoublingStack:
    num = 2
    run_subset = ExpertStack.run_subset  # the executor's call into a stack

    def __call__(self, x, ids, weights):
        return x * 2


def test_cpu_tensors_never_touch_the_staging_block():
    # a CPU-only run hands its tensors to the worker as they are; pinned memory is for device runs
    executor = CpuExpertExecutor(_DoublingStack(), torch.tensor([0, 1, -1]))
    x = torch.ones(2, 4)
    y = executor.submit(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)).add_to(torch.ones(2, 4))
    assert torch.equal(y, torch.full((2, 4), 3.0))
    assert executor.staging.allocations == 0
    executor.shutdown()


class _MixingStack:
    """Output depends on the hidden state, the mapped ids and the weights, so a wrong slice shows."""

    num = 3
    run_subset = ExpertStack.run_subset

    def __call__(self, x, ids, weights):
        return x * (ids.to(x.dtype).sum(1, keepdim=True) + weights.sum(1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_staged_path_computes_what_the_direct_path_does(dtype):
    # The worker function and both copies as a device run takes them, on CPU tensors.
    executor = CpuExpertExecutor(_MixingStack(), torch.tensor([2, -1, 0, 1, -1]))
    x, _, w = _inputs(7, d=16, k=2, dtype=dtype, seed=5)
    ids = torch.randint(0, 5, (7, 2), generator=torch.Generator().manual_seed(6))
    w = w.to(dtype)
    direct = executor.submit(x, ids, w).result()
    staging = executor.staging
    inputs = staging.stage_inputs(x, ids, w)
    out = executor._compute(inputs, staging, None)
    assert out.data_ptr() == staging._out.data_ptr()  # the worker wrote the pinned output block
    assert torch.equal(staging.to_device(out, x.device), direct)
    executor.shutdown()
