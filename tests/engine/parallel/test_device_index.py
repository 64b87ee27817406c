"""Tensor-parallel ranks run on GPU base + rank, and ``--device`` / ``--gpus`` are checked against the
GPUs torch sees (a monkeypatched count: no GPU here)."""

from __future__ import annotations

import pytest
import torch

from kimitui.engine.args import EngineArgs
from kimitui.engine.parallel.workers import rank_device


@pytest.fixture
def two_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_ranks_run_on_base_plus_rank():
    assert [rank_device("cuda", r, 1) for r in range(3)] == [torch.device("cuda", i) for i in (1, 2, 3)]
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("cpu", 1, 1) == torch.device("cpu")


@pytest.mark.parametrize("device,gpus", [("cuda:1", 2), ("cuda", 3), ("cuda:2", 1)])
def test_more_gpus_than_visible_is_a_one_line_error_naming_the_limit(two_visible_gpus, device, gpus):
    with pytest.raises(ValueError) as e:
        EngineArgs(device=device, tensor_parallel_size=gpus).resolve_device()
    msg = str(e.value)
    assert "\n" not in msg and "torch sees 2" in msg and device in msg, msg


@pytest.mark.parametrize("device,gpus", [("cuda:1", 1), ("cuda", 2), ("cuda:0", 2)])
def test_gpus_within_the_visible_ones_resolve(two_visible_gpus, device, gpus):
    assert EngineArgs(device=device, tensor_parallel_size=gpus).resolve_device() == torch.device(device)
