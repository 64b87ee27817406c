"""The few-row MoE's AMX-BF16 expert product (cpu_moe_amx.cpp: the bf16 weight as the A operand as it
lies, the token rows re-laid out into the B operand): against a float32 PyTorch reference that rounds
the activations to bf16 where the kernel does, against the earlier path (widening loops, oneDNN), at
sizes that are no multiple of the tiles, with experts left without rows, float32 and bf16 x. Skipped
where the CPU (or the OS) gives no AMX-BF16 tiles."""

import pytest
import torch
import torch.nn.functional as F

from kimitui.kernels import reference as ref
from kimitui.kernels.activation import GatedActivation
from kimitui.kernels.cpu import few_rows as cpu_few_rows

BF16 = torch.bfloat16
ON = (1, 1 << 40)  # moe_amx_rows: every expert on the tiles
OFF = (1 << 40, 0)  # none


def _amx() -> bool:
    return cpu_few_rows.available() and cpu_few_rows._module().moe_amx_usable()


pytestmark = pytest.mark.skipif(not _amx(), reason="no AMX-BF16 tiles on this CPU / OS / build")


@pytest.fixture
def rows():
    """Sets moe_amx_rows for the test and puts the default back after it."""
    mod = cpu_few_rows._module()
    saved = mod.moe_amx_rows(*ON)
    yield mod.moe_amx_rows
    mod.moe_amx_rows(*saved)


def _bf16_rounded_reference(x, ids, weights, w13, w2, act=None):
    """float32 sums, activations rounded to bf16 before each product (x, then act(gate, up)), as the
    tile kernel feeds them; ids outside [0, E) add nothing."""
    xf = x.float().to(BF16).float()
    out = torch.zeros(x.shape[0], w2.shape[1])
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xf[tok] @ w13[e].float().T
        g, u = gu[:, :inter], gu[:, inter:]
        h = (act(g, u) if act is not None else F.silu(g) * u).to(BF16).float()
        out.index_add_(0, tok, (h @ w2[e].float().T) * weights[tok, slot, None])
    return out


def _case(t, e, d, inter, top_k, seed, empty=()):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) / d**0.5).to(BF16)
    w2 = (torch.randn(e, d, inter, generator=g) / inter**0.5).to(BF16)
    x = torch.randn(t, d, generator=g)
    keep = torch.tensor([i not in empty for i in range(e)])
    scores = torch.rand(t, e, generator=g).masked_fill(~keep, -1.0)  # experts in `empty` get no rows
    weights, ids = scores.topk(top_k)
    return x, ids, weights.abs(), w13, w2


# (tokens, experts, hidden, width, top_k): hidden 70 and width 33 are no multiple of 32 (K) or 16 (N),
# 33 is odd (a K pair split by the end); 150 tokens give experts 40+ rows (three 16-token blocks)
SHAPES = [(1, 4, 64, 32, 2), (5, 6, 70, 33, 2), (37, 6, 70, 33, 3), (150, 9, 96, 48, 3), (24, 8, 1024, 256, 4)]


@pytest.mark.parametrize("t,e,d,inter,top_k", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, BF16])
def test_amx_experts_match_a_bf16_rounded_float32_reference(rows, t, e, d, inter, top_k, xdtype):
    x, ids, weights, w13, w2 = _case(t, e, d, inter, top_k, seed=t + d, empty=(1,))
    x = x.to(xdtype)
    rows(*ON)
    got = cpu_few_rows.moe(x, ids, weights, w13, w2)
    assert got.dtype == xdtype and got.shape == (t, d)
    want = _bf16_rounded_reference(x, ids, weights, w13, w2)
    scale = want.abs().max().item()
    # float32 sums in another order; a product's h may round to the neighbouring bf16 (2^-8 relative)
    tol = 1e-2 if xdtype == BF16 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * scale)
    if xdtype == torch.float32:  # against the exact float64 product of the unrounded x: within bf16's rounding
        exact = ref.moe_experts_reference(x.double(), ids, weights.double(), w13.double(), w2.double())
        torch.testing.assert_close(got.double(), exact, rtol=3e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("t,e,d,inter,top_k", SHAPES[1:4])
def test_amx_experts_agree_with_the_earlier_path(rows, t, e, d, inter, top_k):
    x, ids, weights, w13, w2 = _case(t, e, d, inter, top_k, seed=7, empty=(0, 2))
    rows(*OFF)
    old = cpu_few_rows.moe(x, ids, weights, w13, w2)
    rows(*ON)
    new = cpu_few_rows.moe(x, ids, weights, w13, w2)
    scale = old.abs().max().item()
    torch.testing.assert_close(new, old, rtol=1e-2, atol=1e-2 * scale)
    assert not torch.equal(new, old)  # the tiles ran: the earlier path does not round these activations


def test_amx_experts_skip_pairs_computed_elsewhere_and_experts_without_rows(rows):
    x, ids, weights, w13, w2 = _case(9, 5, 70, 33, 2, seed=3, empty=(0, 3, 4))
    ids[0, 1] = 5  # an id outside [0, E): computed elsewhere, adds nothing
    ids[2, 0] = -1
    got = cpu_few_rows.moe(x, ids, weights, w13, w2)
    want = _bf16_rounded_reference(x, ids, weights, w13, w2)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_an_amx_token_gives_the_same_bits_alone_and_in_a_batch(rows):
    x, ids, weights, w13, w2 = _case(40, 4, 70, 33, 2, seed=11)  # 20 rows an expert: two token blocks
    batch = cpu_few_rows.moe(x, ids, weights, w13, w2)
    for i in (0, 17, 39):
        alone = cpu_few_rows.moe(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], w13, w2)
        assert torch.equal(alone, batch[i : i + 1])


def test_amx_row_bounds_choose_the_path(rows):
    x, ids, weights, w13, w2 = _case(12, 3, 64, 32, 1, seed=5)
    counts = ids.flatten().bincount(minlength=3)
    rows(*OFF)
    old = cpu_few_rows.moe(x, ids, weights, w13, w2)
    rows(int(counts.max()) + 1, 1 << 40)  # every expert below the bound: the earlier path
    assert torch.equal(cpu_few_rows.moe(x, ids, weights, w13, w2), old)
    rows(1, 1 << 40)
    assert not torch.equal(cpu_few_rows.moe(x, ids, weights, w13, w2), old)
    with pytest.raises(RuntimeError, match="moe_amx_rows"):
        rows(0, 5)


def test_amx_experts_run_situ(rows):
    act = GatedActivation("situ", 2.0, 3.0)
    x, ids, weights, w13, w2 = _case(20, 4, 70, 33, 2, seed=13)
    w13 = (w13.float() * 8).to(BF16)  # gate and up past a few betas: the tanh bounds matter
    got = cpu_few_rows.moe(x, ids, weights, w13, w2, act="situ", beta=2.0, linear_beta=3.0)
    want = _bf16_rounded_reference(x, ids, weights, w13, w2, act)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    silu = _bf16_rounded_reference(x, ids, weights, w13, w2)
    assert (silu - want).abs().max() > 1e-1 * want.abs().max()  # SiTU is told apart from SiLU here


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (17, 70, 33), (37, 130, 100), (64, 1000, 1024)])
@pytest.mark.parametrize("xdtype", [torch.float32, BF16])
def test_amx_linear_matches_a_bf16_rounded_float32_product(m, n, k, xdtype):
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).to(xdtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(BF16)
    got = cpu_few_rows.linear_amx(x, w)
    assert got.dtype == xdtype and got.shape == (m, n)
    want = x.to(BF16).float() @ w.float().T
    tol = 1e-2 if xdtype == BF16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # each row alone gives the same bits: a C column depends only on its own B column
    assert torch.equal(cpu_few_rows.linear_amx(x[m // 2 : m // 2 + 1], w), got[m // 2 : m // 2 + 1])


def test_the_cpu_backend_runs_a_wide_bf16_linear_on_the_tiles(monkeypatch):
    from kimitui.kernels.cpu.backend import CpuBackend

    ops = CpuBackend(dtype=BF16)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 96, generator=g) / 10).to(BF16)
    x = torch.randn(cpu_few_rows.MAX_ROWS + 1, 96, generator=g).to(BF16)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w))  # a small weight: oneDNN
    monkeypatch.setattr(cpu_few_rows, "MIN_AMX_LINEAR_ELEMENTS", w.numel())  # as if it were an LM head
    for m in (cpu_few_rows.MAX_ROWS + 1, 64, cpu_few_rows.MAX_AMX_LINEAR_ROWS):
        x = torch.randn(m, 96, generator=g).to(BF16)
        assert torch.equal(ops.linear(x, w), cpu_few_rows.linear_amx(x, w))
    x = torch.randn(cpu_few_rows.MAX_AMX_LINEAR_ROWS + 1, 96, generator=g).to(BF16)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w))  # past the bound: oneDNN
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_few_rows.linear_amx(x, w.float())


def test_a_wide_bf16_mla_step_runs_w_uk_and_w_uv_on_the_tiles():
    from tests.kernels.triton.test_mla_decode_batch import _case as mla_case

    lens = [9, 1, 17, 4, 12, 5, 30, 2, 8, 3, 21, 6, 11, 7, 16, 10, 13, 3, 25, 4, 6, 19, 2, 14]  # 24 > 16 sequences
    a16 = mla_case(BF16, lens=lens)
    a32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == BF16 else v) for k, v in a16.items()}
    got = cpu_few_rows.mla_decode_absorbed(**a16)  # on the tiles: q_nope and the latent outputs rounded to bf16
    want = cpu_few_rows.mla_decode_absorbed(**a32)  # float32 weights: the widening loops
    # (the bf16 q_nope moves the scores before the softmax: up to ~0.5% of the largest output here)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
    # one sequence alone runs the loops on the unrounded latent output: close, not the same bits
    one = {
        k: (v[:1] if k in ("q", "kv", "positions", "slots", "block_tables", "context_lens") else v)
        for k, v in a16.items()
    }
    alone = cpu_few_rows.mla_decode_absorbed(**one)
    torch.testing.assert_close(alone, got[:1], rtol=2e-2, atol=1e-2 * want.abs().max().item())
    assert not torch.equal(alone, got[:1])
