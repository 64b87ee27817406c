"""Suffix decoding: drafts from the request's own tokens and from finished requests' outputs, the
probability cut-off, the bounded global cache, and exact agreement with a literal suffix trie."""

import random
import time

import numpy as np
import pytest

from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.engine.spec_decode.select import make_proposer
from kimitui.engine.spec_decode.suffix import SuffixProposer
from kimitui.engine.spec_decode.suffix_global import GlobalSuffixCache
from tests.engine.spec_decode.suffix_trie import SuffixTrie


def seq(seq_id: str, prompt: list[int], output: list[int] = ()) -> Sequence:
    s = Sequence(seq_id, prompt)
    s.output_token_ids = list(output)
    return s


def finish_with_output(p: SuffixProposer, seq_id: str, output: list[int], prompt=(0,)) -> None:
    p.propose([seq(seq_id, list(prompt), output)], [1])
    p.finish(seq_id)


def test_repetition_within_a_request():
    p = make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=8))
    assert isinstance(p, SuffixProposer) and p.needs_hidden is False
    phrase = [5, 6, 7, 8, 9, 10]
    s = seq("a", [1, 2] + phrase + [3, 4], phrase[:3])
    # match (5, 6, 7): both occurrences are followed by what follows once (the other is the context
    # itself), so prob 1/2 per step; max_spec_factor 1.0 allows 3 tokens for a 3-token match
    assert p.propose([s], [8]) == [[8, 9, 10]]
    assert p.propose([s], [2]) == [[8, 9]]  # max_drafts respected
    s.append_token(8)
    assert p.propose([s], [8]) == [[9, 10, 3, 4]]  # a 4-token match allows 4
    assert p.propose([seq("b", [1, 2, 3])], [8]) == [[]]  # nothing repeats: no draft


def test_across_requests_through_the_global_cache_only_after_finish():
    p = SuffixProposer()
    a = seq("a", [100], [1, 2, 3, 4, 5, 6, 7])
    b = seq("b", [200, 1, 2, 3])
    assert p.propose([a, b], [4, 4]) == [[], []]  # a is still running: b does not see it
    p.finish("a")
    assert p.global_cache.num_requests == 1
    assert "a" not in p._history
    assert p.propose([b], [4]) == [[4, 5, 6]]  # 3-token match, factor 1.0: three tokens
    p.finish("unknown")  # harmless


def test_the_global_cache_keeps_the_most_recent_requests():
    p = SuffixProposer(max_cached_requests=2)
    finish_with_output(p, "r0", [1, 2, 3, 40, 41, 42])
    finish_with_output(p, "r1", [4, 5, 6, 50, 51, 52])
    finish_with_output(p, "r2", [7, 8, 9, 60, 61, 62])
    assert p.global_cache.num_requests == 2
    assert p.propose([seq("q", [0, 1, 2, 3])], [3]) == [[]]  # r0 was evicted first
    assert p.propose([seq("q", [0, 4, 5, 6])], [3]) == [[50, 51, 52]]
    assert p.propose([seq("q", [0, 7, 8, 9])], [3]) == [[60, 61, 62]]
    assert p.propose([seq("q", [7, 8, 9])], [3]) == [[60, 61]]  # match lengths stop below the context's
    off = SuffixProposer(max_cached_requests=0)
    finish_with_output(off, "r", [1, 2, 3, 4])
    assert off.global_cache.num_requests == 0 and off.propose([seq("q", [1, 2, 3])], [3]) == [[]]


def test_the_global_cache_is_bounded_in_tokens_and_never_reads_evicted_positions():
    g = GlobalSuffixCache(max_cached_requests=1000, max_cached_tokens=64)
    rng = np.random.default_rng(0)
    for _ in range(200):
        g.add(rng.integers(0, 5, int(rng.integers(1, 30))))
        assert g.num_tokens <= 64 and g.buf.size <= 128
        for tok in range(5):
            c = g.candidates(tok)
            assert (c >= g.lo).all() and (c < g.head).all() and (g.buf[c & g.mask] == tok).all()
    g.add(np.arange(100))  # longer than the cache: its most recent 63 tokens are kept
    assert g.num_requests == 1 and g.candidates(99).tolist() == [g.head - 2] and g.candidates(36).size == 0


def test_min_token_prob_cuts_the_walk():
    def proposer(min_prob: float, factor: float = 1.0) -> SuffixProposer:
        p = SuffixProposer(min_token_prob=min_prob, max_spec_factor=factor)
        for i, out in enumerate([[1, 2, 5, 6], [1, 2, 5, 7], [1, 2, 5, 8], [1, 2, 9, 9]]):
            finish_with_output(p, f"r{i}", out)
        return p

    q = seq("q", [20, 1, 2])
    # count(1 2) = 4, count(1 2 5) = 3: p = 0.75; then 6, 7, 8 once each: p = 0.25 (8 is the most recent)
    assert proposer(0.3).propose([q], [8]) == [[5]]
    assert proposer(0.2).propose([q], [8]) == [[5, 8]]
    assert proposer(0.8).propose([q], [8]) == [[]]
    assert proposer(0.2, factor=0.5).propose([q], [8]) == [[5]]  # a 2-token match allows 1 token


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tree_depth"):
        SuffixProposer(max_tree_depth=0)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixProposer(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_drafts"):
        SuffixProposer().propose([seq("a", [1])], [1, 2])


def test_agrees_with_a_literal_suffix_trie():
    """Random small-vocabulary requests (many ties and partial matches), evictions included: the
    proposer's draft equals arctic-inference's rule run on depth-D tries of the request and of the
    cached outputs."""
    rng = random.Random(0)
    nonempty = from_global = 0
    for trial in range(150):
        vocab, depth = rng.choice([2, 3, 4, 6]), rng.choice([3, 5, 8, 24])
        factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3])
        keep = rng.choice([1, 2, 1000])
        p = SuffixProposer(
            max_tree_depth=depth, max_cached_requests=keep, max_spec_factor=factor, min_token_prob=min_prob
        )
        outputs = []
        for r in range(rng.randint(0, 4)):
            out = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            finish_with_output(p, f"g{r}", out, [rng.randrange(vocab) for _ in range(rng.randint(1, 5))])
            if out:
                outputs.append(out)
        glob = SuffixTrie(depth)
        glob.offset = p.global_cache.lo
        for out in outputs[-keep:]:
            glob.insert(out)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        cut = max(1, len(tokens) // 2)
        k = rng.randint(1, 10)
        got = p.propose([seq("x", tokens[:cut], tokens[cut:])], [k])[0]
        own = SuffixTrie(depth)
        own.insert(tokens)
        d_own, s_own = own.speculate(tokens[-depth:], k, factor, min_prob)
        d_glob, s_glob = glob.speculate(tokens[-depth:], k, factor, min_prob)
        assert got == (d_glob if s_glob > s_own else d_own), trial
        nonempty += bool(got)
        from_global += s_glob > s_own
    assert nonempty > 100 and from_global > 30  # the comparison exercised both sides


def test_a_32k_token_request_costs_well_under_a_millisecond_per_step():
    rng = np.random.default_rng(0)
    p = SuffixProposer()
    for r in range(200):
        finish_with_output(p, f"g{r}", rng.integers(0, 1000, 300).tolist())
    base = rng.integers(0, 1000, 2000).tolist()
    s = seq("long", [base[i % 2000] for i in range(32_768)])
    assert len(p.propose([s], [8])[0]) == 8  # periodic text: the full draft
    steps = 30
    start = time.process_time()
    for _ in range(steps):
        s.append_token(base[s.num_tokens % 2000])
        assert len(p.propose([s], [8])[0]) == 8
    per_step = (time.process_time() - start) / steps
    assert per_step < 5e-3, f"{per_step * 1e6:.0f} us per step"  # a few hundred us when the machine is idle


def test_the_numpy_walk_and_the_python_walk_agree():
    """Many occurrences take the numpy walk, few the Python one; same rule (ties: most recent)."""
    from kimitui.engine.spec_decode.suffix import _walk_array, _walk_rows

    rng = np.random.default_rng(1)
    for _ in range(300):
        n, width = int(rng.integers(1, 120)), int(rng.integers(1, 6))
        cont = rng.integers(-1, int(rng.integers(1, 4)), (n, width)).astype(np.int32)  # -1: the sentinel
        shared = rng.random(n) < 0.7  # rows sharing the first row's continuation: long walks
        cont[shared, 1:] = cont[0, 1:]
        min_prob = float(rng.choice([0.0, 0.1, 0.4]))
        assert _walk_array(cont, min_prob) == _walk_rows(cont.tolist(), min_prob)
