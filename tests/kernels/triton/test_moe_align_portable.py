"""kernels/triton/moe_align.py on Triton 3.0-3.3: the portable forms of ``tl.gather`` and masked ``tl.histogram``.

pyproject.toml's floor is Triton 3.0 (torch 2.4), but the alignment kernel used ``tl.gather`` (Triton
3.2) and ``tl.histogram(mask=)`` (3.4): on an older Triton it failed to compile on the first MoE
layer. Below 3.4 the kernel now takes portable forms (a one-hot sum per gather; an unmasked histogram
with the masked-out lanes' count taken back out of bin 0). Here that path is forced on under
TRITON_INTERPRET=1 and must match the native path and the plain-loop reference bit for bit; the
wrapper must pick it from the installed version. (``test_compile_targets`` compiles it for sm_90
and gfx950.)
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.interpret import (
    case_registry,
    child_main,
    needs_triton,
    run_interpreted,
)

CASES, case = case_registry()


def _routed(tokens, top_k, experts):
    return torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])


def _check(topk_ids, block, experts):
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_align import moe_align_block_size

    portable = moe_align_block_size(topk_ids, block, experts, portable=True)
    native = moe_align_block_size(topk_ids, block, experts, portable=False)
    want = ref.moe_align_block_size(topk_ids, block, experts)
    for name, p, n, w in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), portable, native, want):
        assert p.dtype == torch.int32 and torch.equal(p, w), (name, p, w)
        assert torch.equal(p, n), (name, p, n)


@case
def portable_matches_native_and_reference():
    _check(torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32) - 1, 4, 4)  # vLLM's example
    ids = torch.randint(0, 9, (5, 3))
    ids[0, 0] = 8  # == E: computed elsewhere, no slot (a masked-out lane of the histogram)
    ids[3, :] = 8
    _check(ids, 4, 8)
    _check(torch.zeros(6, 2, dtype=torch.int32), 16, 1)  # one expert: every lane in bin 0
    _check(torch.randint(0, 40, (9, 6)), 5, 40)  # BLOCK_M not a power of two
    _check(torch.randint(0, 9, (275, 4)), 4, 8)  # 1100 pairs: two id chunks


@case
def portable_at_kimi_decode_shapes():
    _check(_routed(16, 8, 384), 16, 384)  # K2 batch 16
    _check(_routed(4, 16, 896), 16, 896)  # K3 batch 4
    ids = torch.randint(0, 7, (40, 8))  # many pairs on few of 384 experts, some computed elsewhere
    ids[::3, 0] = 384
    _check(ids, 64, 384)


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_moe_align_portable")


@needs_triton
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    assert result.startswith("ok"), result


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch


@needs_triton
@pytest.mark.parametrize("version, portable", [("3.0.0", True), ("3.3.1", True), ("3.4.0", False), ("3.9.0", False)])
def test_the_installed_triton_picks_the_path(version, portable, monkeypatch):
    import triton

    from kimitui.kernels.triton import moe_align

    monkeypatch.setattr(triton, "__version__", version)
    recorder = _Recorder()
    monkeypatch.setattr(moe_align, "_moe_align_kernel", recorder)
    monkeypatch.setattr(moe_align, "check_device", lambda *tensors: None)  # CPU tensors, nothing runs
    moe_align.moe_align_block_size(_routed(4, 8, 384), 16, 384)
    ((_, _, meta),) = recorder.launches
    assert meta["PORTABLE"] is portable, (version, meta)


def test_floor_is_the_same_everywhere():
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    from kimitui.kernels.triton.check import MIN_VERSION

    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    pins = [d for d in project["project"]["optional-dependencies"]["test"] if d.startswith("triton")]
    assert pins == ["triton>=3.0; platform_system == 'Linux'"] and MIN_VERSION == (3, 0), pins
