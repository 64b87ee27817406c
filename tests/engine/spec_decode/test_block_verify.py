"""Block verification (``rejection_sample(method="block")``): exact, at least as many drafts kept as
the per-token rule, greedy unchanged, no host sync.

Exactness is checked the way the paper defines it (Sun et al. 2024, arXiv 2403.10444, section 2): a
verification step is exact when its output, continued by sampling from the target, is distributed
as the target. Target P and draft Q depend on the whole prefix (random tables over a 3-token
vocabulary), the drafts are sampled from Q, and the joint distribution of the first 4 tokens is
compared with the target's exact joint by a chi-square test (fixed seeds), which a plausible wrong
rule fails."""

from __future__ import annotations

import itertools

import pytest
import torch

from kimitui.engine.sampling.sampler import SamplingBatch
from kimitui.engine.spec_decode import rejection
from kimitui.engine.spec_decode.rejection import rejection_sample, to_lists
from kimitui.kernels.launch_count import count_launches

V, K = 3, 3  # vocabulary, drafts per sequence
N = 40000
# chi-square with V ** (K + 1) - 1 = 80 degrees of freedom: mean 80, sd 12.6; 140 is p ~ 1e-4
CHI2_LIMIT = 140.0


def make_batch(temps, generators=None) -> SamplingBatch:
    n = len(temps)
    return SamplingBatch(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        generators=generators or [None] * n,
        all_greedy=all(t == 0 for t in temps),
        use_top_k=False,
        use_top_p=False,
        max_logprobs=-1,
    )


class Tables:
    """A distribution over the next token for every prefix of length 0..K, as a [num prefixes, V]
    table; prefix (x_1..x_l) has row offset(l) + (x_1..x_l in base V)."""

    def __init__(self, seed: int, sharpness: float):
        g = torch.Generator().manual_seed(seed)
        self.offsets = [sum(V**j for j in range(length)) for length in range(K + 2)]
        self.probs = (torch.randn(self.offsets[-1], V, generator=g, dtype=torch.float64) * sharpness).softmax(-1)

    def row(self, seqs: torch.Tensor, length: int) -> torch.Tensor:
        """Row index of each sequence's prefix of ``length`` tokens. seqs: [N, >= length] -> [N]"""
        idx = torch.full((seqs.shape[0],), self.offsets[length], dtype=torch.int64)
        for j in range(length):
            idx += seqs[:, j] * V ** (length - 1 - j)
        return idx

    def joint(self, seq: tuple[int, ...]) -> float:
        out = 1.0
        for j, t in enumerate(seq):
            row = self.offsets[j] + sum(x * V ** (j - 1 - i) for i, x in enumerate(seq[:j]))
            out *= self.probs[row, t].item()
        return out


TARGET, DRAFTER = Tables(1, 1.5), Tables(2, 1.5)


def run_step(method: str, one_hot: bool, seed: int = 0, n: int = N):
    """One verification step for ``n`` sequences: drafts from Q (or Q's argmax: one-hot drafts),
    the target's K + 1 rows, ``rejection_sample``. Returns (its output [n, K + 1], drafts [n, K])."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(n, K, dtype=torch.int64)
    q_rows = []
    for j in range(K):
        q = DRAFTER.probs[DRAFTER.row(drafts, j)]
        drafts[:, j] = q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=gen)[:, 0]
        q_rows.append(q)
    p_rows = [TARGET.probs[TARGET.row(drafts, j)] for j in range(K + 1)]
    logits = torch.stack(p_rows, dim=1).log().reshape(n * (K + 1), V).float()
    draft_probs = None if one_hot else torch.stack(q_rows, dim=1).reshape(n * K, V).float()
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        out = rejection_sample(logits, [K] * n, drafts.tolist(), make_batch([1.0] * n), draft_probs, method=method)
    return out, drafts


def continued_joint_counts(out: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Continue every output by sampling from the target up to K + 1 tokens; counts of each
    (K + 1)-token sequence, [V ** (K + 1)]."""
    gen = torch.Generator().manual_seed(seed + 2)
    length = (out >= 0).sum(dim=1)
    seqs = out.clamp(min=0).clone()
    for pos in range(K + 1):
        fill = length <= pos
        if fill.any():
            p = TARGET.probs[TARGET.row(seqs[fill], pos)]
            seqs[fill, pos] = torch.multinomial(p, 1, generator=gen)[:, 0]
    code = torch.zeros(out.shape[0], dtype=torch.int64)
    for pos in range(K + 1):
        code = code * V + seqs[:, pos]
    return torch.bincount(code, minlength=V ** (K + 1))


def target_joint() -> torch.Tensor:
    return torch.tensor([TARGET.joint(s) for s in itertools.product(range(V), repeat=K + 1)], dtype=torch.float64)


def chi2_and_tv(counts: torch.Tensor) -> tuple[float, float]:
    n = counts.sum().item()
    expected = target_joint() * n
    chi2 = ((counts.double() - expected) ** 2 / expected).sum().item()
    tv = 0.5 * (counts.double() / n - target_joint()).abs().sum().item()
    return chi2, tv


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
@pytest.mark.parametrize("method", ["block", pytest.param("standard", marks=pytest.mark.slow)])
def test_emitted_sequences_follow_the_target(method, one_hot):
    out, _ = run_step(method, one_hot)
    chi2, tv = chi2_and_tv(continued_joint_counts(out))
    assert chi2 < CHI2_LIMIT, (chi2, tv)
    assert tv < 0.03


def _tau_with_unit_weight(*args):
    tau, w = _real_block_accept(*args)
    return tau, torch.ones_like(w)  # the residual as the per-token rule's max(0, p - q): wrong after a block


_real_block_accept = rejection.block_accept


def _cumulative_weight_rule(probs, draft_probs, p_draft, q_draft, k_t, q_of_t, uniform):
    ratio = p_draft if q_draft is None else p_draft / q_draft
    w = torch.cumprod(ratio.clamp(max=1.0), dim=1)
    tau = (uniform < w).to(torch.int64).sum(dim=1)
    return tau, torch.ones(tau.shape[0])


@pytest.mark.parametrize("wrong", ["unit-weight-residual", pytest.param("cumulative-weight", marks=pytest.mark.slow)])
def test_the_check_catches_wrong_block_rules(monkeypatch, wrong):
    monkeypatch.setattr(
        rejection, "block_accept", _tau_with_unit_weight if wrong == "unit-weight-residual" else _cumulative_weight_rule
    )
    out, _ = run_step("block", one_hot=False)
    chi2, _ = chi2_and_tv(continued_joint_counts(out))
    assert chi2 > CHI2_LIMIT


def mean_kept(out: torch.Tensor) -> float:
    return ((out >= 0).sum(dim=1) - 1).double().mean().item()


def test_block_keeps_more_drafts_than_per_token_on_the_papers_example():
    """Section 3's example: target (1/3, 2/3), drafter (2/3, 1/3), two drafts, no context. The
    per-token rule keeps 10/9 drafts in expectation, block verification 11/9."""
    n = 30000
    p, q = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    gen = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(q.expand(n, 2), 2, replacement=True, generator=gen)
    logits = p.log().repeat(n * 3, 1)
    kept = {}
    for method in ("standard", "block"):
        with torch.random.fork_rng():
            torch.manual_seed(8)
            out = rejection_sample(logits, [2] * n, drafts.tolist(), make_batch([1.0] * n), q.repeat(n * 2, 1), method)
        kept[method] = mean_kept(out)
        # exact too: the first output token is distributed as p
        first = torch.bincount(out[:, 0], minlength=2).double() / n
        assert (first - p.double()).abs().max() < 0.01
    assert abs(kept["standard"] - 10 / 9) < 0.015, kept  # about 3 standard errors
    assert abs(kept["block"] - 11 / 9) < 0.015, kept


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
def test_block_keeps_at_least_as_many_drafts_as_per_token(one_hot):
    kept = {m: mean_kept(run_step(m, one_hot, seed=3, n=20000)[0]) for m in ("standard", "block")}
    assert kept["block"] >= kept["standard"] - 0.01, kept
    if not one_hot:
        assert kept["block"] > kept["standard"] + 0.02, kept  # these tables leave room to gain


def test_greedy_and_mixed_batches():
    """Temperature 0 under block: keep while the draft is the argmax, then the argmax (as the per-token
    rule); greedy sequences in a batch with sampled ones answer the same; seeded sampled sequences
    give the same tokens whatever they are batched with."""
    torch.manual_seed(0)
    ks = [3, 0, 2, 3]
    logits = torch.randn(sum(ks) + len(ks), 11)
    am = logits.argmax(-1).tolist()
    drafts = [am[0:3], [], [(am[5] + 1) % 11, am[6]], [am[8], (am[9] + 3) % 11, am[10]]]
    greedy = rejection_sample(logits, ks, drafts, make_batch([0.0] * 4), method="block")
    assert to_lists(greedy) == [am[0:4], [am[4]], [am[5]], [am[8], am[9]]]
    extra = torch.randn(4, 11)
    q = torch.rand(sum(ks) + 3, 11).softmax(-1)
    gens = lambda: [None] * 4 + [torch.Generator().manual_seed(5)]  # noqa: E731
    mixed = rejection_sample(
        torch.cat([logits, extra]),
        ks + [3],
        drafts + [[1, 2, 3]],
        make_batch([0.0] * 4 + [0.8], gens()),
        draft_probs=q,
        method="block",
    )
    assert to_lists(mixed)[:4] == to_lists(greedy)
    alone = rejection_sample(
        extra, [3], [[1, 2, 3]], make_batch([0.8], gens()[4:]), draft_probs=q[sum(ks) :], method="block"
    )
    assert to_lists(alone)[0] == to_lists(mixed)[4]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_no_host_sync(with_draft_probs):
    torch.manual_seed(4)
    ks = [2, 0, 3]
    logits = torch.randn(sum(ks) + 3, 20)
    draft_probs = torch.rand(5, 20).softmax(-1) if with_draft_probs else None
    batch = make_batch([0.0, 0.8, 1.2], [None, None, torch.Generator().manual_seed(1)])
    with count_launches() as counts:
        rejection_sample(logits, ks, [[1, 2], [], [3, 4, 5]], batch, draft_probs, method="block")
    assert counts.kernels > 0 and dict(counts.host_syncs) == {}


def test_unknown_method_is_one_line():
    with pytest.raises(ValueError, match="method 'tree'.*supported standard, block"):
        rejection_sample(torch.zeros(1, 4), [0], [[]], make_batch([1.0]), method="tree")
