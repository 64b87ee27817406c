"""Routing statistics that skip rows (``count_rows``): the router kernel's in-launch count under
TRITON_INTERPRET=1, and ``kernels.backend.count_routing`` (the reference and CPU backends' count),
against a count over the kept rows only. A decode graph sets the mask to 0 on its padding rows and
during capture warm-ups (engine/runner/graph_padding.py)."""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.interpret import case_registry, child_main, needs_triton, run_interpreted

CASES, case = case_registry()


def _want(ids: torch.Tensor, keep: torch.Tensor, e: int) -> torch.Tensor:
    kept = ids[keep.bool()].reshape(-1)
    return torch.zeros(e, dtype=torch.int64).index_add_(0, kept, torch.ones_like(kept))


@case
def router_kernel_skips_masked_rows():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_router import moe_route_logits

    logits, bias = torch.randn(7, 32), torch.randn(32) * 0.1
    args = (4, 4, 2, "sigmoid", True, 2.5)
    want_ids, _ = ref.moe_route_logits(logits, bias, *args)
    rows = torch.tensor([1, 1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.int32)  # longer than T: the first 7 count
    counts = torch.zeros(32, dtype=torch.int64)
    ids, _ = moe_route_logits(logits, bias, *args, counts=counts, count_rows=rows)
    assert torch.equal(ids, want_ids)
    assert torch.equal(counts, _want(want_ids, rows[:7], 32)) and int(counts.sum()) == 4 * 4
    none = torch.zeros(32, dtype=torch.int32)
    moe_route_logits(logits, bias, *args, counts=none, count_rows=torch.zeros(7, dtype=torch.int64))
    assert int(none.sum()) == 0  # warm-ups: nothing counts
    every = torch.zeros(32, dtype=torch.int64)
    moe_route_logits(logits, bias, *args, counts=every, count_rows=torch.ones(7, dtype=torch.bool))
    assert torch.equal(every, _want(want_ids, torch.ones(7), 32))


@case
def triton_backend_router_matches_reference_backend_with_row_mask():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend

    x, gate, bias = torch.randn(6, 40).half(), torch.randn(16, 40), torch.randn(16) * 0.1
    args = (4, 2, 1, "sigmoid", True, 1.5)
    rows = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.int32)  # a bucket of 6 holding 4 real rows
    ca, cb = torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    ids, _ = TritonBackend().moe_route(x, gate, bias, *args, counts=ca, weights_dtype=torch.float16, count_rows=rows)
    want_ids, _ = REFERENCE.moe_route(x, gate, bias, *args, counts=cb, weights_dtype=torch.float16, count_rows=rows)
    assert torch.equal(ids, want_ids) and torch.equal(ca, cb) and int(ca.sum()) == 4 * 4


def test_count_routing_skips_masked_rows():
    from kimitui.kernels.backend import count_routing

    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1]])
    counts = torch.zeros(5, dtype=torch.int64)
    count_routing(counts, ids, torch.tensor([1, 0, 1, 0, 1], dtype=torch.int32))
    assert counts.tolist() == [2, 0, 1, 1, 0]
    count_routing(counts, ids)  # no mask: every row
    assert counts.tolist() == [4, 2, 2, 4, 0]
    count_routing(None, ids, torch.ones(4))  # no statistics kept: nothing to do


@needs_triton
def test_bad_count_rows_is_one_clear_line():
    pytest.importorskip("triton")
    from kimitui.kernels.triton.moe_router import moe_route_logits

    for rows in (torch.ones(1, dtype=torch.int32), torch.ones(3)):
        with pytest.raises(ValueError, match=r"count_rows must be a contiguous integer \[>= T=2\]") as info:
            moe_route_logits(torch.randn(2, 12), None, 2, counts=torch.zeros(12).long(), count_rows=rows)
        assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def results():
    return run_interpreted("tests.kernels.triton.test_router_count_rows")


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted(results, name):
    assert results[name].startswith("ok"), results[name]


if __name__ == "__main__":
    child_main(CASES)
