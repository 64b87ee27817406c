"""NaN-safe routing: a NaN router row routes to valid experts, on every router.

Before, the Triton router (kernels/triton/moe_router.py) gave a row of NaN logits expert id BLOCK_E (512
for Kimi K2's 384 experts): every ``v == max`` compare is False with a NaN max, so the lowest
matching index was the sentinel. Its routing statistics then added one past the end of the
``counts [E]`` buffer, and the id went on to the expert kernels. The defined behaviour now, the same
in the PyTorch reference, the Triton kernel and the C++ CPU router: a NaN logit counts as -inf (its
sigmoid score 0), a NaN score as 0, a NaN biased score as -inf; ties go to the lower id, chosen ids
are distinct. A NaN row therefore picks k valid experts with weight 0 (the NaN still reaches the
output through the shared experts and the residual: nothing is hidden).

Interpreter half: a child process under TRITON_INTERPRET=1, as the other interpreter files.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.interpret import (
    case_registry,
    child_main,
    needs_triton,
    run_interpreted,
)

CASES, case = case_registry()

E_K2, TOP_K_K2 = 384, 8  # Kimi K2: 384 experts (BLOCK_E 512), top-8


def _nan_logits(t=4, e=E_K2):
    logits = torch.randn(t, e)
    logits[1] = float("nan")  # a whole NaN row (a NaN hidden state)
    logits[2, ::3] = float("nan")  # some NaN experts in an otherwise finite row
    logits[3] = float("-inf")  # a row of -inf
    return logits


def _check_ids(ids, e, top_k):
    assert ids.shape[1] == top_k
    assert bool(((ids >= 0) & (ids < e)).all()), ids
    for row in ids.tolist():
        assert len(set(row)) == top_k, row  # distinct experts


def _check_against_reference(ids, weights, logits, bias, *args, **kwargs):
    from kimitui.kernels import reference as ref

    want_ids, want_w = ref.moe_route_logits(logits, bias, *args, **kwargs)
    assert torch.equal(ids.long(), want_ids), (ids, want_ids)
    torch.testing.assert_close(weights.float(), want_w, rtol=1e-5, atol=1e-6)


# --- interpreter cases ------------------------------------------------------------------------


@case
def triton_router_nan_row_gives_valid_ids_and_in_bounds_counts():
    from kimitui.kernels.triton.moe_router import moe_route_logits

    logits, bias = _nan_logits(), torch.randn(E_K2) * 0.01
    # counts sits inside a larger buffer: a write past [E] would land in the guard cells
    buffer = torch.zeros(E_K2 + 256, dtype=torch.int32)
    counts = buffer[:E_K2]
    ids, weights = moe_route_logits(logits, bias, TOP_K_K2, counts=counts)
    _check_ids(ids, E_K2, TOP_K_K2)
    assert int(buffer[E_K2:].abs().sum()) == 0, "routing statistics written past counts[E]"
    assert int(counts.sum()) == logits.shape[0] * TOP_K_K2
    assert float(weights[1].abs().sum()) == 0.0 and bool(weights.isfinite().all()), weights
    _check_against_reference(ids, weights, logits, bias, TOP_K_K2)


@case
def triton_router_nan_grouped_and_softmax():
    from kimitui.kernels.triton.moe_router import moe_route_logits

    logits = _nan_logits(e=64)
    bias = torch.randn(64) * 0.01
    for args, kwargs in (
        ((6, 8, 3), {}),
        ((4, 1, 1), dict(scoring_func="softmax")),
        ((5, 4, 2), dict(scoring_func="softmax", norm_topk_prob=False)),
    ):
        ids, weights = moe_route_logits(logits, bias, *args, **kwargs)
        _check_ids(ids, 64, args[0])
        assert bool(weights.isfinite().all()), (args, weights)
        _check_against_reference(ids, weights, logits, bias, *args, **kwargs)
    # the bias itself NaN for some experts (a corrupt checkpoint): still valid, distinct ids
    bad_bias = bias.clone()
    bad_bias[::5] = float("nan")
    ids, weights = moe_route_logits(logits, bad_bias, 6, 8, 3)
    _check_ids(ids, 64, 6)
    _check_against_reference(ids, weights, logits, bad_bias, 6, 8, 3)


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.test_router_nan")


@needs_triton
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    assert result.startswith("ok"), result


def test_reference_router_nan_row():
    from kimitui.kernels import reference as ref

    logits, bias = _nan_logits(), torch.randn(E_K2) * 0.01
    ids, weights = ref.moe_route_logits(logits, bias, TOP_K_K2)
    _check_ids(ids, E_K2, TOP_K_K2)
    assert float(weights[1].abs().sum()) == 0.0 and bool(weights.isfinite().all())
    # the finite rows route as before (sigmoid scores of finite logits are untouched)
    scores = logits[0].sigmoid() + bias
    assert torch.equal(ids[0], torch.sort(scores, descending=True, stable=True).indices[:TOP_K_K2])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_engine_router_nan_hidden_state(backend):
    """``Backend.moe_route`` from the hidden state (the CPU backend: the C++ router for few rows)."""
    from kimitui.kernels import reference as ref
    from kimitui.kernels.backend import REFERENCE

    if backend == "cpu":
        from kimitui.kernels.cpu.backend import CpuBackend

        ops = CpuBackend()
        if not ops.cxx:
            pytest.skip("the C++ CPU kernels are not built")
    else:
        ops = REFERENCE
    x, gate, bias = torch.randn(4, 64), torch.randn(E_K2, 64) * 0.1, torch.randn(E_K2) * 0.01
    x[1] = float("nan")
    x[2, 5] = float("inf")  # inf * w: +-inf or NaN logits in one row
    counts = torch.zeros(E_K2, dtype=torch.int64)
    ids, weights = ops.moe_route(x, gate, bias, TOP_K_K2, counts=counts)
    _check_ids(ids, E_K2, TOP_K_K2)
    assert int(counts.sum()) == 4 * TOP_K_K2
    assert float(weights[1].abs().sum()) == 0.0 and bool(weights[1].isfinite().all()), weights
    want_ids, want_w = ref.moe_route(x, gate, bias, TOP_K_K2)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    torch.testing.assert_close(weights.float(), want_w, rtol=1e-5, atol=1e-6)
    logits = F.linear(x.float(), gate.float())
    assert logits[1].isnan().all()
