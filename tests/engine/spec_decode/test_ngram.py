"""Prompt-lookup drafting: vLLM's rule (longest suffix in [min, max], earliest earlier occurrence),
checked by hand and against a brute-force search, incremental per sequence, and fast on 32k tokens."""

import random
import time

import numpy as np
import pytest

from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.engine.spec_decode.ngram import NgramProposer, find_ngram_draft
from kimitui.engine.spec_decode.select import make_proposer


def seq(seq_id: str, tokens: list[int], num_prompt: int | None = None) -> Sequence:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    s = Sequence(seq_id, tokens[:num_prompt])
    s.output_token_ids = list(tokens[num_prompt:])
    return s


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    t = len(tokens)
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        suffix = tokens[t - n :]
        for start in range(0, t - n):  # occurrences ending at start + n - 1 <= t - 2
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    "tokens, lo, hi, k, want",
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
        ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
        ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),  # the suffix (5, 6) never occurred before
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 3, [6, 2, 3]),  # n = 1: the EARLIEST 3
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),  # n = 2: (2, 3)
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 2, 3, [4, 1, 2]),  # the longer match wins over the earlier one
        ([7, 7, 7, 7], 1, 3, 5, [7]),  # the occurrence may overlap the suffix; the draft stops at the end
        ([5, 6, 5, 6, 5], 3, 3, 4, [6, 5]),
        ([1, 2], 2, 2, 3, []),  # too short for a 2-gram plus an earlier occurrence
        ([1, 2, 1, 2], 1, 5, 0, []),  # nothing asked
    ],
)
def test_lookup_rule(tokens, lo, hi, k, want):
    assert find_ngram_draft(np.array(tokens, dtype=np.int32), lo, hi, k).tolist() == want
    assert brute_force(tokens, lo, hi, k) == want


def test_agrees_with_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(0, 6)
        got = find_ngram_draft(np.array(tokens, dtype=np.int32), lo, hi, k).tolist()
        assert got == brute_force(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_proposer_tracks_each_sequence_incrementally_and_respects_max_drafts():
    p = make_proposer(
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    )
    assert isinstance(p, NgramProposer) and p.needs_hidden is False
    a = seq("a", [10, 11, 12, 13, 14, 10, 11], num_prompt=5)
    b = seq("b", [1, 2, 3, 4])
    assert p.propose([a, b], [3, 3]) == [[12, 13, 14], []]
    a.append_token(12)
    b.append_token(1)
    b.append_token(2)
    assert p.propose([a, b], [2, 5]) == [[13, 14], [3, 4, 1, 2]]
    assert p.propose([a, b], [0, 1]) == [[], [3]]
    p.finish("a")
    p.finish("never-seen")  # finishing an unknown id is harmless
    # a new request reusing the id starts from its own tokens, not the old ones
    assert p.propose([seq("a", [9, 8, 9, 8])], [4]) == [[9, 8]]
    # an id whose tokens no longer agree (not finished, reused) is rebuilt, shorter or longer
    assert p.propose([seq("b", [5, 6, 7, 5, 6])], [2]) == [[7, 5]]
    assert p.propose([seq("b", [1, 2, 3, 4, 1, 2, 9, 9, 3, 4])], [2]) == [[1, 2]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="max_drafts"):
        NgramProposer(1, 2).propose([seq("a", [1, 2])], [])


def test_a_32k_token_sequence_costs_microseconds_per_step():
    rng = np.random.default_rng(0)
    s = seq("long", rng.integers(0, 50_000, 32_768).tolist())
    p = NgramProposer(1, 5)
    p.propose([s], [5])  # the first call copies the prompt once
    steps = 50
    start = time.process_time()
    for _ in range(steps):
        s.append_token(int(rng.integers(0, 50_000)))
        p.propose([s], [5])
    per_step = (time.process_time() - start) / steps
    assert per_step < 1e-3, f"{per_step * 1e6:.0f} us per step"  # about 30 us when the machine is idle
