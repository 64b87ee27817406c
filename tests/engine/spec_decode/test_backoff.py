"""Back-off (engine/spec_decode/backoff.py): draft lengths follow acceptance, down to none with
probes that grow further apart; disable_by_batch_size and max_model_len; and in the engine, an
always-wrong proposer ends up drafting almost nothing while greedy output stays the same."""

from __future__ import annotations

from types import SimpleNamespace

from kimitui.engine.spec_decode.backoff import MAX_WAIT, PRIOR_MIN, PRIOR_WAIT, DraftBackoff


def _seq(sid="a", n=10):
    return SimpleNamespace(seq_id=sid, num_tokens=n)


def test_length_follows_acceptance_down_to_zero_and_probes_back():
    b = DraftBackoff(4)
    s = _seq()
    assert b.budgets([s], [4]) == [4]
    b.observe("a", 4, 1)
    assert b.budgets([s], [4]) == [2]  # accepted + 1
    b.observe("a", 2, 2)
    assert b.budgets([s], [4]) == [3]  # all held: one more
    b.observe("a", 3, 0)
    assert b.budgets([s], [4]) == [1]
    b.observe("a", 1, 0)  # stop, probe after 1, 2, 4, ... steps
    gaps = []
    for _ in range(8):
        gap = 0
        while b.budgets([s], [4]) == [0]:
            gap += 1
        gaps.append(gap)
        b.observe("a", 1, 0)
    assert gaps == [1, 2, 4, 8, 16, 32, 32, 32] and MAX_WAIT == 32
    for _ in range(12):
        b.observe("x", 2, 0)  # another request's drafts fail too
    assert b.recent < PRIOR_MIN  # nearly every recent draft failed: a new request starts without
    gap = 0
    while b.budgets([_seq("b")], [4]) == [0]:
        gap += 1
    assert gap == PRIOR_WAIT
    assert b.budgets([s], [4]) == [0]
    for _ in range(MAX_WAIT):
        b.budgets([s], [4])
    b.observe("a", 1, 1)  # a probe that holds: back to drafting at once
    assert b.budgets([s], [4]) == [2]
    assert b.budgets([s], [1]) == [1]  # never more than the cap
    b.finish("a")
    assert "a" not in b._state


def test_new_requests_start_from_recent_acceptance():
    b = DraftBackoff(4)
    assert b.budgets([_seq("a")], [4]) == [4]  # nothing seen yet: the full length
    for _ in range(30):
        b.observe("a", 4, 4)
    assert b.budgets([_seq("b")], [4]) == [4]
    for _ in range(14):
        b.observe("a", 4, 1)  # a quarter held lately
    assert 0.25 < b.recent < 0.5 and b.budgets([_seq("c")], [4]) == [round(2 * b.recent * 4)]


def test_disable_by_batch_size_max_model_len_and_off():
    b = DraftBackoff(3, disable_by_batch_size=2, max_model_len=20)
    assert b.budgets([_seq("a"), _seq("b")], [3, 3]) == [3, 3]
    assert b.budgets([_seq("a"), _seq("b"), _seq("c")], [3, 3, 3]) == [0, 0, 0]  # more than 2: off (vLLM)
    assert b.budgets([_seq("a", 21), _seq("b", 20)], [3, 3]) == [0, 3]
    off = DraftBackoff(3, enabled=False)
    off.observe("a", 3, 0)
    assert off.budgets([_seq("a")], [3]) == [3]


def test_engine_always_wrong_proposer_backs_off_and_output_is_unchanged(tmp_path):
    from kimitui.engine import LLM, SamplingParams
    from tests.helpers.checkpoints import write_hf_checkpoint

    write_hf_checkpoint(tmp_path, seed=3)
    prompts = [[5 + i, 17, 33, 40] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    class Wrong:  # drafts a token the greedy target never picks next (the one just sampled + 1)
        needs_hidden = False

        def propose(self, seqs, max_drafts, hidden=None):
            return [[(s.token_ids[-1] + 1) % 320] * k for s, k in zip(seqs, max_drafts)]

        def finish(self, seq_id):
            pass

    def run(spec):
        llm = LLM(str(tmp_path), max_model_len=128, max_num_seqs=2, speculative_config=spec)
        if spec is not None:
            llm.engine.proposer = Wrong()
        out = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return out, llm

    ref, _ = run(None)
    for backoff, most in ((True, 25), (False, None)):
        got, llm = run({"method": "ngram", "num_speculative_tokens": 4, "backoff": backoff})
        assert got == ref
        drafted = llm.engine.stats().spec_decode.num_draft_tokens
        accepted = llm.engine.stats().spec_decode.num_accepted_tokens
        if backoff:  # 2 x 60 decodes: 4 + 1 drafts, then probes 1, 2, 4, 8, 16, 32 steps apart
            assert drafted <= most, drafted
        else:
            assert drafted >= 2 * 50 * 4 * 0.9, drafted
        assert accepted <= drafted // 10


def test_while_acceptance_is_low_probes_are_rationed_over_the_batch():
    b = DraftBackoff(4)
    for _ in range(40):
        b.observe("old", 2, 0)
    assert b.recent < PRIOR_MIN
    seqs = [_seq(f"s{i}") for i in range(4)]
    steps = []
    for _ in range(40):
        budget = b.budgets(seqs, [4] * 4)
        steps.append(budget)
        for sq, k in zip(seqs, budget):
            if k:
                b.observe(sq.seq_id, k, 0)
    assert all(sum(s) <= 1 for s in steps)  # never more than one probe row in a step
    probe_steps = [i for i, s in enumerate(steps) if sum(s)]
    gaps = [b2 - a for a, b2 in zip(probe_steps, probe_steps[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 8, gaps  # further apart while they fail
    assert len({steps[i].index(1) for i in probe_steps}) > 1  # not always the same request
    b.observe("s0", 1, 1)  # a probe that holds: that request drafts again
    assert b.budgets([seqs[0]], [4]) == [2]
