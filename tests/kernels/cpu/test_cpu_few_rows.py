"""The C++ few-row CPU kernels against PyTorch references, their batch independence, their
thread count, their input checks, and when the CPU backend uses them."""

import logging

import pytest
import torch

from kimitui.kernels import reference as ref
from kimitui.kernels.backend import REFERENCE
from kimitui.kernels.cpu import build as _build
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings

needs_ext = pytest.mark.skipif(not cpu_few_rows.available(), reason="the C++ extension does not build here")


@needs_ext
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 5), (64, 67), (130, 256)])
def test_linear_matches_float64(m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = cpu_few_rows.linear(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


@needs_ext
def test_linear_keeps_leading_dims_and_reads_strided_rows():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 40)[:, :, :32], torch.randn(24, 32)  # x not contiguous
    torch.testing.assert_close(cpu_few_rows.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_ext
@pytest.mark.parametrize("m,n,k", [(7, 72, 200), (16, 70, 1024), (13, 49, 67)])
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(m, n, k):
    # n not a multiple of the 3- and 4-row weight tiles: the single-row tails run too, which once
    # rounded differently (the compiler fused a * b + c in some tile shapes only).
    torch.manual_seed(1)
    x, w = torch.randn(m, k), torch.randn(n, k)
    batch = cpu_few_rows.linear(x, w)
    for i in range(m):
        assert torch.equal(cpu_few_rows.linear(x[i : i + 1], w), batch[i : i + 1])
    assert torch.equal(cpu_few_rows.linear(x[m - 5 :], w), batch[m - 5 :])  # 5 rows: a 4-row tile and a 1-row tail


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 1200, 512), (5, 2100, 256), (2, 70, 64)])
def test_linear_gives_the_same_bits_on_one_thread_and_two(dtype, m, n, k):
    # The first two weights (1.2 and 1.1 MB in bf16, twice that in float32) are past kInlineBytes
    # (256 KiB), so with two threads their row blocks go out in runs to either thread; the last stays
    # on the calling thread.
    torch.manual_seed(n)
    x, w = torch.randn(m, k), torch.randn(n, k).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_few_rows.linear(x, w)
        torch.set_num_threads(2)
        two = cpu_few_rows.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    torch.testing.assert_close(two.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


def _experts(e, d, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * inter, d, generator=g) * 0.1, torch.randn(e, d, inter, generator=g) * 0.1


@needs_ext
@pytest.mark.parametrize("t", [1, 3, 17, 150])  # 150 tokens: some experts get 32+ pairs (BLAS)
def test_moe_matches_reference(t):
    torch.manual_seed(t)
    e, d, inter, top_k = 9, 44, 20, 3  # feature counts that are not multiples of the 8-wide vectors
    w13, w2 = _experts(e, d, inter)
    x = torch.randn(t, d)
    weights, ids = torch.rand(t, e).topk(top_k)
    ids = ids[:, torch.randperm(top_k)]  # slots in no particular expert order
    ids[0, 1] = e  # a pair computed elsewhere (another rank, host RAM) adds nothing
    scratch = torch.empty(0)
    got = cpu_few_rows.moe(x, ids, weights, w13, w2, scratch)
    torch.testing.assert_close(got, ref.moe_experts_reference(x, ids, weights, w13, w2), rtol=1e-5, atol=1e-5)
    assert scratch.numel() >= (t * top_k - 1) * d  # the caller's buffer holds the pairs' outputs now
    # The kept output buffer must not carry anything into the next, smaller call.
    torch.testing.assert_close(
        cpu_few_rows.moe(x[:1], ids[:1], weights[:1], w13, w2, scratch), got[:1], rtol=1e-5, atol=1e-5
    )


@needs_ext
def test_moe_swiglu_holds_over_the_whole_exp_range():
    # gate values from about -300 to 300: the vectorised exp's clamps and its polynomial both run
    torch.manual_seed(5)
    w13, w2 = _experts(4, 40, 24)
    x = torch.randn(12, 40) * 60
    weights, ids = torch.rand(12, 4).topk(2)
    want = ref.moe_experts_reference(x, ids, weights, w13, w2)
    torch.testing.assert_close(cpu_few_rows.moe(x, ids, weights, w13, w2), want, rtol=1e-5, atol=1e-4)


@needs_ext
def test_moe_token_gives_the_same_bits_alone_and_in_a_batch():
    torch.manual_seed(2)
    w13, w2 = _experts(16, 64, 32)
    x = torch.randn(6, 64)
    weights, ids = torch.rand(6, 16).topk(4)
    batch = cpu_few_rows.moe(x, ids, weights, w13, w2)
    for i in range(6):
        alone = cpu_few_rows.moe(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], w13, w2)
        assert torch.equal(alone, batch[i : i + 1])


@needs_ext
def test_threads_follow_torch():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_few_rows.threads() == 1
        torch.set_num_threads(before)
        assert cpu_few_rows.threads() == before
    finally:
        torch.set_num_threads(before)


@needs_ext
def test_bad_inputs_are_named():
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-d float32"):
        cpu_few_rows._module().linear(torch.randn(2, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="x has 6 input features, w has 8"):
        cpu_few_rows.linear(torch.randn(2, 6), w)
    w13, w2 = _experts(4, 8, 4)
    with pytest.raises(RuntimeError, match="w2 .* does not fit w13"):
        ids = torch.zeros(2, 2, dtype=torch.long)
        cpu_few_rows.moe(torch.randn(2, 8), ids, torch.ones(2, 2), w13, w2[:, :, :2].contiguous())


@needs_ext
def test_cpu_backend_routes_few_float32_or_bf16_rows_only(monkeypatch):
    calls = []
    real = cpu_few_rows.linear
    monkeypatch.setattr(cpu_few_rows, "linear", lambda x, w: calls.append(x.shape) or real(x, w))
    ops = CpuBackend(KernelSettings())
    w = torch.randn(16, 32)
    ops.linear(torch.randn(2, 3, 32), w)  # 6 rows
    ops.linear(torch.randn(cpu_few_rows.MAX_ROWS + 1, 32), w)  # too many rows: BLAS
    ops.linear(torch.randn(2, 32, dtype=torch.bfloat16), w.bfloat16())  # bf16: the C++ loops read it too
    ops.linear(torch.randn(2, 32, dtype=torch.float16), w.half())  # fp16: not
    assert calls == [(2, 3, 32), (2, 32)]
    REFERENCE.linear(torch.randn(2, 32), w)  # KIMITUI_KERNELS=reference
    CpuBackend(KernelSettings(cpu_kernels=False)).linear(torch.randn(2, 32), w)  # KIMITUI_CPU_KERNELS=0
    assert calls == [(2, 3, 32), (2, 32)]


def test_build_failure_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    import torch.utils.cpp_extension as cpp

    def fail(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", fail)
    monkeypatch.setattr(_build, "_prebuilt", lambda *a: None)  # as if no build came with the install
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu_few_rows._module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kimitui.kernels.cpu.few_rows"):
            assert not cpu_few_rows.available()
        assert "Ninja is required" in caplog.text
        x, w = torch.randn(2, 32), torch.randn(16, 32)
        ops = CpuBackend(KernelSettings())
        assert not ops.cxx
        torch.testing.assert_close(ops.linear(x, w), x @ w.T)  # the PyTorch path still answers
        monkeypatch.undo()
        cpu_few_rows._module.cache_clear()
        assert not CpuBackend(KernelSettings.from_env({"KIMITUI_CPU_KERNELS": "0"})).cxx
    finally:
        monkeypatch.undo()
        cpu_few_rows._module.cache_clear()


@needs_ext
@pytest.mark.parametrize("heads", [5, 16])
def test_mla_decode_matches_reference(heads):
    torch.manual_seed(heads)
    r, rope, block_size, num_blocks = 32, 8, 4, 12
    cache = torch.randn(num_blocks * block_size, r + rope)
    lens = torch.tensor([1, 9, 16], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:4] for _ in range(3)]).int()  # blocks in any order
    q = torch.randn(3, heads, r + rope)
    want = ref.mla_decode_reference(q, cache, tables, lens, 16, block_size, r, 0.3)
    torch.testing.assert_close(
        cpu_few_rows.mla_decode(q, cache, tables, lens, block_size, r, 0.3), want, rtol=1e-5, atol=1e-5
    )


@needs_ext
def test_mla_decode_rejects_a_slot_outside_the_cache():
    cache = torch.randn(8, 40)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_few_rows.mla_decode(
            torch.randn(1, 8, 40),
            cache,
            torch.tensor([[0, 5]], dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
            4,
            32,
            0.3,
        )
    with pytest.raises(RuntimeError, match="does not fit its 2 blocks"):
        cpu_few_rows.mla_decode(
            torch.randn(1, 8, 40),
            cache,
            torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([9], dtype=torch.int32),
            4,
            32,
            0.3,
        )


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1024), (3, 44), (2, 70, 256)])
def test_rms_norm_matches_reference(shape):
    torch.manual_seed(len(shape))
    x, w = torch.randn(shape) * 3, torch.rand(shape[-1]) + 0.5
    torch.testing.assert_close(cpu_few_rows.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="x has 44 features, the norm weight 45"):
        cpu_few_rows.rms_norm(torch.randn(2, 44), torch.ones(45), 1e-6)


@needs_ext
@pytest.mark.parametrize(
    "t,groups,scoring", [(1, 1, "sigmoid"), (16, 1, "sigmoid"), (7, 4, "sigmoid"), (40, 4, "softmax")]
)
def test_moe_route_matches_reference(t, groups, scoring):
    torch.manual_seed(t + groups)
    x, w, bias = torch.randn(t, 96), torch.randn(32, 96) * 0.1, torch.randn(32) * 0.3
    args = (6, groups, 2 if groups > 1 else 1, scoring, True, 2.5)
    ids, weights = cpu_few_rows.moe_route(x, w, bias, *args)
    want_ids, want_weights = ref.moe_route(x, w, bias, *args)
    assert torch.equal(ids, want_ids)  # same experts, same order (descending score + bias)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    if groups > 1:  # every pick lies in one of the two kept groups of 8
        assert all(len(set(row)) <= 2 for row in (ids // 8).tolist())


@needs_ext
def test_moe_route_names_bad_groups():
    with pytest.raises(RuntimeError, match="top_k 9 exceeds the 8 experts of the kept groups"):
        cpu_few_rows.moe_route(torch.randn(2, 16), torch.randn(32, 16), torch.zeros(32), 9, 4, 1, "sigmoid", True, 1.0)
    with pytest.raises(RuntimeError, match="n_group 5 / topk_group 1 do not fit 32 experts"):
        cpu_few_rows.moe_route(torch.randn(2, 16), torch.randn(32, 16), torch.zeros(32), 2, 5, 1, "sigmoid", True, 1.0)


def test_the_extension_builds_where_a_compiler_is():
    """Every test above skips when the build fails, so a compile error in the C++ would pass quietly
    (the product falls back to the slower PyTorch path) unless this one fails where a compiler exists."""
    import os
    import shutil

    if os.environ.get("KIMITUI_CPU_KERNELS", "1").lower() in ("0", "false", "off"):
        pytest.skip("KIMITUI_CPU_KERNELS turns the extension off")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    assert cpu_few_rows.available(), "the C++ CPU kernels failed to build; see the warning logged above"


@needs_ext
def test_the_backend_moe_scratch_works_in_and_out_of_inference_mode():
    # A backend made inside torch.inference_mode (a model loaded there) may be used outside it.
    w13, w2 = _experts(4, 16, 8)
    x = torch.randn(3, 16)
    weights, ids = torch.rand(3, 4).topk(2)
    with torch.inference_mode():
        ops = CpuBackend(KernelSettings())
        inside = ops.moe_experts(x[:1], ids[:1], weights[:1], w13, w2)
    outside = ops.moe_experts(x, ids, weights, w13, w2)  # more pairs: the scratch grows out here
    assert ops.moe_scratch.numel() >= 6 * 16
    assert torch.equal(inside, outside[:1])
