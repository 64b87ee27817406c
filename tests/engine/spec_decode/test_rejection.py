"""The verification rule: greedy exactness, seeded rows, agreement with the sampler when nothing was
drafted, and (statistically, fixed seeds) that every output token follows the target distribution,
a check the same test shows fails for plausible wrong rules."""

import math

import pytest
import torch

from kimitui.engine.sampling.sampler import SamplingBatch, sample
from kimitui.engine.spec_decode import rejection
from kimitui.engine.spec_decode.rejection import rejection_sample, to_lists
from kimitui.kernels.launch_count import count_launches


def make_batch(temps, top_ks=None, top_ps=None, generators=None) -> SamplingBatch:
    n = len(temps)
    top_ks = top_ks or [0] * n
    top_ps = top_ps or [1.0] * n
    return SamplingBatch(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_p=torch.tensor(top_ps, dtype=torch.float32),
        top_k=torch.tensor(top_ks, dtype=torch.int64),
        generators=generators or [None] * n,
        all_greedy=all(t == 0 for t in temps),
        use_top_k=any(k > 0 for k in top_ks),
        use_top_p=any(p < 1 for p in top_ps),
        max_logprobs=-1,
    )


def test_greedy_accepts_while_draft_is_argmax_then_the_argmax():
    torch.manual_seed(0)
    num_drafts = [3, 0, 2, 3]
    logits = torch.randn(sum(num_drafts) + len(num_drafts), 11)
    argmax = logits.argmax(-1).tolist()
    # seq 0: all three accepted -> bonus; seq 1: no drafts; seq 2: first rejected; seq 3: second rejected
    drafts = [argmax[0:3], [], [(argmax[5] + 1) % 11, argmax[6]], [argmax[8], (argmax[9] + 3) % 11, argmax[10]]]
    out = rejection_sample(logits, num_drafts, drafts, make_batch([0.0] * 4))
    assert out.dtype == torch.int64 and out.shape == (4, 4)
    assert to_lists(out) == [argmax[0:4], [argmax[4]], [argmax[5]], [argmax[8], argmax[9]]]
    assert out[1].tolist() == [argmax[4], -1, -1, -1]
    # the same greedy sequences batched with sampled ones (top-k, top-p, draft probs) answer the same
    mixed = torch.cat([logits, torch.randn(3, 11)])
    batch = make_batch([0.0] * 4 + [1.0], [0] * 4 + [3], [1.0] * 4 + [0.9])
    q = torch.rand(10, 11).softmax(-1)
    got = rejection_sample(mixed, num_drafts + [2], drafts + [[1, 2]], batch, draft_probs=q)
    assert to_lists(got)[:4] == to_lists(out)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_no_host_sync(with_draft_probs):
    torch.manual_seed(4)
    ks = [2, 0, 3]
    logits = torch.randn(sum(ks) + 3, 20)
    draft_probs = torch.rand(5, 20).softmax(-1) if with_draft_probs else None
    batch = make_batch([0.0, 0.8, 1.2], [0, 5, 0], [1.0, 1.0, 0.9], [None, None, torch.Generator().manual_seed(1)])
    with count_launches() as counts:
        out = rejection_sample(logits, ks, [[1, 2], [], [3, 4, 5]], batch, draft_probs)
    assert counts.kernels > 0 and dict(counts.host_syncs) == {}
    assert out.shape == (3, 4) and all(1 <= len(r) <= k + 1 for r, k in zip(to_lists(out), ks))


def test_bad_input_is_a_one_line_error():
    logits = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="expected sum"):
        rejection_sample(logits, [1], [[0]], make_batch([0.0]))
    with pytest.raises(ValueError, match="do not match num_drafts"):
        rejection_sample(logits, [2], [[0]], make_batch([0.0]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rejection_sample(logits, [2], [[0, 5]], make_batch([0.0]))
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(logits, [2], [[0, 1]], make_batch([1.0]), draft_probs=torch.zeros(3, 5))


def test_without_drafts_seeded_and_greedy_rows_match_the_sampler_exactly():
    torch.manual_seed(1)
    logits = torch.randn(5, 50) * 3
    temps, top_ks, top_ps = [0.0, 0.7, 1.0, 1.3, 0.9], [0, 5, 0, 10, 0], [1.0, 1.0, 0.8, 0.9, 1.0]
    seeds = [None, 11, 12, None, 13]
    for step in range(3):  # the same streams consumed step after step
        gens_a = [None if s is None else torch.Generator().manual_seed(s * 100 + step) for s in seeds]
        gens_b = [None if s is None else torch.Generator().manual_seed(s * 100 + step) for s in seeds]
        want = sample(logits, make_batch(temps, top_ks, top_ps, gens_a)).token_ids
        got = rejection_sample(logits, [0] * 5, [[]] * 5, make_batch(temps, top_ks, top_ps, gens_b))
        assert got.shape == (5, 1)
        for i, s in enumerate(seeds):
            if s is not None or temps[i] == 0:
                assert got[i, 0].item() == want[i].item()


def test_a_seeded_sequence_does_not_depend_on_its_batch_mates():
    torch.manual_seed(2)
    v = 40
    own = torch.randn(4, v)
    own_drafts = [own[0].argmax().item(), 7, 3]

    def run(mates_before: int, mates_after: int) -> list[int]:
        ks = [2] * mates_before + [3] + [1] * mates_after
        logits = torch.cat([torch.randn(3 * mates_before, v), own, torch.randn(2 * mates_after, v)])
        drafts = [[1, 2]] * mates_before + [own_drafts] + [[5]] * mates_after
        gens = (
            [None] * mates_before
            + [torch.Generator().manual_seed(99)]
            + [torch.Generator().manual_seed(i) for i in range(mates_after)]
        )
        temps = [1.0] * mates_before + [0.8] + [0.5] * mates_after
        out = rejection_sample(logits, ks, drafts, make_batch(temps, generators=gens))
        return to_lists(out)[mates_before]

    alone = run(0, 0)
    assert run(3, 0) == alone and run(0, 4) == alone and run(2, 5) == alone


def test_draft_probs_equal_to_one_hot_behave_as_deterministic_drafts():
    torch.manual_seed(3)
    logits = torch.randn(8, 9)
    ks, drafts = [3, 3], [[1, 2, 3], [4, 5, 6]]
    one_hot = torch.zeros(6, 9).scatter_(1, torch.tensor([1, 2, 3, 4, 5, 6])[:, None], 1.0)
    gens = lambda: [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]  # noqa: E731
    a = rejection_sample(logits, ks, drafts, make_batch([1.0, 0.6], generators=gens()))
    b = rejection_sample(logits, ks, drafts, make_batch([1.0, 0.6], generators=gens()), draft_probs=one_hot)
    assert torch.equal(a, b)


# ---- the statistical check ----------------------------------------------------------------

V = 6
# (logits of positions 0, 1 and the bonus position 2, temperature, top_k, top_p); no ties and no
# top-p boundary lands exactly on a cumulative sum.
CASES = [
    ([[2.0, 1.0, 0.3, -0.5, 0.1, -1.0], [0.5, -0.2, 1.5, 0.0, -1.0, 0.7], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]], 1.0, 0, 1.0),
    (
        [[1.2, 0.4, 1.0, -0.5, 0.1, -1.0], [0.5, -0.2, 1.5, 0.0, -1.0, 0.7], [1.0, -1.0, 0.0, 2.0, 0.5, -0.5]],
        0.6,
        3,
        1.0,
    ),
    (
        [[1.2, 0.4, 1.0, -0.5, 0.1, -1.0], [-0.3, 0.9, 0.2, 0.0, 1.1, 0.7], [0.0, 0.1, 1.0, 2.0, -0.5, 0.3]],
        1.5,
        0,
        0.75,
    ),
    (
        [[0.3, 1.7, 1.0, -0.5, 0.9, -1.0], [0.5, -0.2, 1.5, 0.0, -1.0, 0.7], [1.0, 0.1, 0.0, 0.4, 0.5, -0.6]],
        0.9,
        4,
        0.8,
    ),
]
DRAFT_DIST = [[0.05, 0.05, 0.6, 0.1, 0.1, 0.1], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]]  # q for positions 0, 1
N = 3000


def reference_probs(row: list[float], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target written out independently: softmax(logits / T), keep the top_k largest, then of
    those the most likely tokens until the mass BEFORE a token reaches top_p; renormalise."""
    probs = torch.tensor(row, dtype=torch.float64).div(temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = probs[kept].sum()
    keep, before = [], 0.0
    for t in kept:
        if before >= top_p:
            break
        keep.append(t)
        before += (probs[t] / mass).item()
    out = torch.zeros(V, dtype=torch.float64)
    out[keep] = probs[keep]
    return out / out.sum()


def tv(counts: torch.Tensor, target: torch.Tensor) -> tuple[float, int]:
    n = int(counts.sum())
    return 0.5 * (counts.double() / max(n, 1) - target).abs().sum().item(), n


def distribution_error(with_draft_probs: bool) -> float:
    """Worst total-variation distance between what rejection_sample outputs and the target, over
    CASES and the first, second (given the first draft accepted) and third (given both accepted)
    output tokens, plus the pair (first, second) against (its first-token marginal) x target;
    each divided by the bound sqrt(V / n) for its sample count n (about 4 standard deviations).
    Below 1 means "indistinguishable from the target". All cases go through ONE call, so rows
    with different temperature / top-k / top-p settings share a batch."""
    worst = 0.0
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        q = torch.tensor(DRAFT_DIST)
        drafts = torch.multinomial(q, N * len(CASES), replacement=True).T  # [N * cases, 2]: d0 ~ q0, d1 ~ q1
        logits = torch.cat([torch.tensor(rows).repeat(N, 1) for rows, *_ in CASES])  # [3 N cases, V]
        batch = make_batch(*[[c[i] for c in CASES for _ in range(N)] for i in (1, 2, 3)])
        out = rejection_sample(
            logits,
            [2] * (N * len(CASES)),
            drafts.tolist(),
            batch,
            draft_probs=q.repeat(N * len(CASES), 1) if with_draft_probs else None,
        )
    for c, (rows, temp, top_k, top_p) in enumerate(CASES):
        target = [reference_probs(r, temp, top_k, top_p) for r in rows]
        case = out[c * N : (c + 1) * N]
        length = (case >= 0).sum(1)
        for pos in range(3):
            err, n = tv(torch.bincount(case[length > pos, pos], minlength=V), target[pos])
            worst = max(worst, err / math.sqrt(V / n))
        two = case[length >= 2]
        pair = torch.bincount(two[:, 0] * V + two[:, 1], minlength=V * V).view(V, V)
        first = pair.sum(1).double() / pair.sum()
        err, n = tv(pair.flatten(), (first[:, None] * target[1][None, :]).flatten())
        worst = max(worst, err / math.sqrt(V * V / n))
    return worst


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one-hot", "draft-probs"])
def test_outputs_follow_the_target_distribution(with_draft_probs):
    assert distribution_error(with_draft_probs) < 1.0


def _always_accept(p_draft, q_draft):
    return torch.ones_like(p_draft)


def _residual_is_p(p_rows, q_rows, drafts):
    return p_rows


def _accept_with_p_ignoring_q(p_draft, q_draft):
    return p_draft


@pytest.mark.parametrize(
    "wrong, with_draft_probs",
    [
        ("always-accept", False),
        ("always-accept", True),
        ("resample-from-p", False),
        ("resample-from-p", True),
        ("ignore-q", True),  # one-hot drafts have no q to ignore
    ],
)
def test_the_check_catches_wrong_rules(monkeypatch, wrong, with_draft_probs):
    if wrong == "always-accept":
        monkeypatch.setattr(rejection, "_accept_prob", _always_accept)
    elif wrong == "resample-from-p":
        monkeypatch.setattr(rejection, "_residual", _residual_is_p)
    else:
        monkeypatch.setattr(rejection, "_accept_prob", _accept_with_p_ignoring_q)
    assert distribution_error(with_draft_probs) > 2.0
