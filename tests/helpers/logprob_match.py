"""Two runs' top log-probs compared step by step while their greedy histories agree."""

from __future__ import annotations


def matching_logprobs(tokens, ref_tokens, logprobs, ref_logprobs, tol: float) -> int:
    """Assert that, for each sequence and each step whose history (the tokens before it) both runs
    share, the tokens in both runs' top log-probs have log-probs within ``tol``; -> how many steps
    after the first were compared."""
    compared = 0
    for ta, tb, la, lb in zip(tokens, ref_tokens, logprobs, ref_logprobs):
        for step in range(len(ta)):
            if ta[:step] != tb[:step]:  # compared while both have the same history
                break
            common = set(la[step]) & set(lb[step])
            assert common, (step, la[step], lb[step])
            for tok in common:
                assert abs(la[step][tok] - lb[step][tok]) < tol, (step, tok, la[step][tok], lb[step][tok])
            compared += step > 0
    return compared
