"""Suffix decoding (arXiv:2411.04975; vLLM's ``suffix`` method, built on arctic-inference's
``SuffixDecodingCache``): draft the most frequent continuation of the longest recent match, from
the request's own prompt + output and from the outputs of recently finished requests.

The reference keeps suffix trees of depth ``max_tree_depth`` (D). A node of such a tree for a
string s (|s| <= D) counts the occurrences of s; a draft is a greedy walk down from the node that
matches the last m tokens of the context, always into the most frequent child, with the estimated
probability ``prod count(child) / count(parent)``, stopping below ``min_token_prob``, at the tree's
depth (m + draft <= D), or at ``min(max_drafts, floor(m * max_spec_factor))`` tokens. Every match
length m = 1 .. min(D, T) - 1 is tried and the draft with the highest score (the sum of its
tokens' probabilities) wins, the longer match on a tie; the global cache's draft replaces the
request's own only with a strictly higher score.

Here the counts come straight from the token arrays instead of a tree: the occurrences of the last
m tokens are the positions where the last token occurs filtered m - 1 times (vectorised), and
count(s + t) is how many of them are followed by t. That gives the trees' exact counts (tested
against a literal depth-D trie) without building anything per token, so a 32k-token prompt costs
nothing to add. The request's own tokens are the per-``seq_id`` history (``history.py``: only new
tokens are appended each step); the global side is ``suffix_global.py``.

Cost per sequence and step (T = its tokens, D = depth): one vectorised comparison over T, at most
D - 1 filters of the candidate positions, and per tried match length at most D numpy steps over
its occurrences; match lengths that cannot beat the best score so far are skipped. Measured (CPU
time, a busy 2-core x86 machine, 500k tokens in the global cache): about 0.3 ms per step for a
32k-token request of random text, 0.7 ms for periodic text drafting 8 tokens; about 0.5 ms to move
a finished 500-token output into the global cache. Memory: the histories of live requests (4 bytes
a token) and the bounded global cache.

Where this differs from the reference: a request's output joins the global cache when it
finishes (arctic-inference adds it token by token, so running requests see each other's outputs);
``finish`` sees only the tokens of the last ``propose``, so the final sampled token(s) are not
cached; equally frequent continuations go to the most recent occurrence (the reference's order is
its hash map's); and the global side reads at most the 4096 most recent occurrences of the
context's last token (``suffix_global.py``).
"""

from __future__ import annotations

import numpy as np

from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.history import SENTINEL, HistoryTable
from kimitui.engine.spec_decode.proposer import StepHidden
from kimitui.engine.spec_decode.suffix_global import GlobalSuffixCache


def _walk_rows(rows: list[list[int]], min_prob: float) -> tuple[list[int], float]:
    """The greedy walk over the continuations ``rows`` (one per occurrence, ascending positions,
    SENTINEL where an occurrence's continuation ends), in Python: cheaper than numpy while small."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    for j in range(len(rows[0]) if rows else 0):
        counts: dict[int, int] = {}
        for r in reversed(rows):  # most recent first: max() keeps the first of equal counts
            t = r[j]
            if t != SENTINEL:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)
        prob *= counts[tok] / len(rows)  # occurrences that end here stay in the denominator, as in the tree
        if prob < min_prob:
            break
        draft.append(tok)
        score += prob
        rows = [r for r in rows if r[j] == tok]
    return draft, score


def _walk_array(cont: np.ndarray, min_prob: float) -> tuple[list[int], float]:
    """``_walk_rows`` over a continuation matrix [n, max_tokens] with numpy, for many occurrences."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    for j in range(cont.shape[1]):
        col = cont[:, j]
        live = col[col != SENTINEL]
        if live.size == 0:
            break
        srt = np.sort(live)
        starts = np.flatnonzero(np.r_[True, srt[1:] != srt[:-1]])
        counts = np.diff(np.r_[starts, srt.size])
        count = int(counts.max())
        prob *= count / col.size
        if prob < min_prob:
            break
        tied = srt[starts[counts == count]]
        if tied.size == 1:
            tok = int(tied[0])
        else:  # the most recent occurrence among the equally frequent
            recent = live[::-1]
            tok = int(recent[np.argmax(np.isin(recent, tied))])
        draft.append(tok)
        score += prob
        cont = cont[col == tok]
    return draft, score


def _match_lengths(buf: np.ndarray, mask: int, lo: int, ends: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """For each occurrence ``ends`` of ``pattern[-1]``, how many of the pattern's last tokens (at
    most ``pattern.size - 1``) end there: [n] int. Large candidate sets are narrowed one token at a
    time (each step keeps few); once small, the rest is one [n, p] comparison."""
    p = pattern.size
    mlen = np.ones(ends.size, dtype=np.int64)
    idx = np.arange(ends.size)
    m = 1
    while m < p - 1 and idx.size > 32:
        e = ends[idx] - m
        idx = idx[(e >= lo) & (buf[e & mask] == pattern[-1 - m])]
        mlen[idx] += 1
        m += 1
    if m < p - 1 and idx.size:
        back = ends[idx][:, None] - np.arange(m, p - 1)  # [n, p - 1 - m]
        same = (buf[back & mask] == pattern[p - 1 - m :: -1][: p - 1 - m]) & (back >= lo)
        mlen[idx] += np.cumprod(same, axis=1).sum(axis=1)
    return mlen


def best_draft(
    buf: np.ndarray,
    mask: int,
    lo: int,
    ends: np.ndarray,
    pattern: np.ndarray,
    depth: int,
    max_spec: int,
    spec_factor: float,
    min_prob: float,
    to_beat: float = 0.0,
) -> tuple[list[int], float]:
    """The best-scoring draft over every match length of ``pattern`` (the context's last tokens)
    in the corpus ``buf[pos & mask]`` with live positions from ``lo``; ``ends``: the positions of
    ``pattern[-1]``. Only a draft scoring strictly more than ``to_beat`` is returned."""
    p = pattern.size
    if p < 2 or ends.size == 0:
        return [], to_beat
    mlen = _match_lengths(buf, mask, lo, ends, pattern)
    # Longer matches than the longest one some token follows give no draft (the request's own
    # context always matches itself in full but nothing follows it yet).
    followed = buf[(ends + 1) & mask] != SENTINEL
    if not followed.any():
        return [], to_beat
    longest = int(mlen[followed].max())
    # Try the match lengths with the largest possible score first (the longer on equal bounds): the
    # winner is the highest (score, m) and a score never exceeds its token budget, so once a draft
    # scores its whole budget every length with a smaller (budget, m) is skipped without a walk.
    budgets = sorted(
        ((min(max_spec, int(m * spec_factor + 1e-6), depth - m), m) for m in range(1, longest + 1)), reverse=True
    )
    best, best_key = [], (to_beat, longest + 1)  # to_beat must be beaten strictly
    for max_tokens, m in budgets:
        if (max_tokens, m) <= best_key:
            break
        occ = ends[mlen >= m]
        cont = buf[(occ[:, None] + 1 + np.arange(max_tokens)) & mask]  # [n, max_tokens]
        draft, score = _walk_rows(cont.tolist(), min_prob) if occ.size <= 48 else _walk_array(cont, min_prob)
        if (score, m) > best_key:
            best, best_key = draft, (score, m)
    return best, best_key[0]


class SuffixProposer:
    """Suffix-decoding proposer (``speculative_config`` method ``suffix``)."""

    needs_hidden = False

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 1 or max_cached_requests < 0 or max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError(
                f"SuffixProposer: need max_tree_depth >= 1 ({max_tree_depth}), max_cached_requests "
                f">= 0 ({max_cached_requests}), max_spec_factor >= 0 ({max_spec_factor}) and "
                f"0 <= min_token_prob <= 1 ({min_token_prob})"
            )
        self.depth = max_tree_depth
        self.spec_factor = max_spec_factor
        self.min_prob = min_token_prob
        self._history = HistoryTable()
        self.global_cache = GlobalSuffixCache(max_cached_requests)

    def propose(self, seqs: list[Sequence], max_drafts: list[int], hidden: StepHidden | None = None) -> list[list[int]]:
        if len(seqs) != len(max_drafts):
            raise ValueError(f"SuffixProposer.propose: {len(seqs)} sequences but {len(max_drafts)} max_drafts")
        out = []
        for seq, k in zip(seqs, max_drafts):
            h = self._history.sync(seq)
            out.append(self._propose_one(h.buf, h.num_tokens, k) if k > 0 else [])
        return out

    def _propose_one(self, buf: np.ndarray, t: int, k: int) -> list[int]:
        pattern = buf[max(0, t - self.depth) : t]
        last = int(pattern[-1])
        mask = buf.size - 1
        own_ends = np.flatnonzero(buf[:t] == last)
        draft, score = best_draft(buf, mask, 0, own_ends, pattern, self.depth, k, self.spec_factor, self.min_prob)
        g = self.global_cache
        if g.num_requests:
            g_draft, g_score = best_draft(
                g.buf,
                g.mask,
                g.lo,
                g.candidates(last),
                pattern,
                self.depth,
                k,
                self.spec_factor,
                self.min_prob,
                to_beat=score,
            )
            if g_score > score:
                draft = g_draft
        return draft

    def finish(self, seq_id: str) -> None:
        """The request's output (as of the last ``propose``) joins the global cache."""
        h = self._history.pop(seq_id)
        if h is not None:
            self.global_cache.add(h.tokens[h.num_prompt_tokens :])
