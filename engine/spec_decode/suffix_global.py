"""The global side of suffix decoding: the outputs of recently finished requests, searchable.

Outputs are appended, each followed by a sentinel, to one ring buffer of int32 tokens addressed by
ABSOLUTE positions (``buf[pos & mask]``); the live region is ``[lo, head)``. Requests leave in
first-in first-out order of their arrival here (as arctic-inference's ``SuffixDecodingCache``
evicts), once there are more than ``max_cached_requests`` of them or more than ``max_cached_tokens``
tokens; eviction only moves ``lo``. An index maps each token id to the ascending absolute positions
where it occurs, so a query starts from the occurrences of the context's last token instead of
scanning the cache; positions that fell below ``lo`` are skipped by a binary search and dropped
when the index holds as many dead entries as live ones.

Memory: 4 bytes per cached token in the ring (at most twice the live size) plus 8 per index entry.
Time: adding an output of L tokens is L appends to the index's arrays; a query reads at
most ``max_candidates`` (the most recent occurrences of the last token), so it is bounded however
large the cache grows. The bound is the only approximation: for a token that occurs more often
than that, counts are taken over its most recent occurrences.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import numpy as np

from kimitui.engine.spec_decode.history import SENTINEL


class GlobalSuffixCache:
    def __init__(self, max_cached_requests: int, max_cached_tokens: int = 1 << 24, max_candidates: int = 4096) -> None:
        if max_cached_requests < 0 or max_cached_tokens < 1 or max_candidates < 1:
            raise ValueError(
                "GlobalSuffixCache: need max_cached_requests >= 0, max_cached_tokens >= 1 and max_candidates >= 1"
            )
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_candidates = max_candidates
        self.buf = np.full(min(1024, 1 << (max_cached_tokens - 1).bit_length()), SENTINEL, dtype=np.int32)
        self.lo = 0  # absolute position of the oldest live token
        self.head = 0  # next absolute position to write
        self._spans: OrderedDict[int, tuple[int, int]] = OrderedDict()  # serial -> (start, end incl. sentinel)
        self._serial = 0
        self._index: dict[int, array] = {}  # token -> its absolute positions, ascending (int64)
        self._index_entries = 0

    @property
    def mask(self) -> int:
        return self.buf.size - 1

    @property
    def num_requests(self) -> int:
        return len(self._spans)

    @property
    def num_tokens(self) -> int:
        """Live cached tokens, sentinels included."""
        return self.head - self.lo

    def add(self, tokens: np.ndarray) -> None:
        """Cache one finished request's output tokens [L] (evicting the oldest as needed)."""
        n = int(tokens.shape[0])
        if self.max_cached_requests == 0 or n == 0:
            return
        if n + 1 > self.max_cached_tokens:  # keep the most recent part of an output too long to hold
            tokens, n = tokens[n + 1 - self.max_cached_tokens :], self.max_cached_tokens - 1
        self._spans[self._serial] = (self.head, self.head + n + 1)
        self._serial += 1
        while len(self._spans) > self.max_cached_requests or self.head + n + 1 - self.lo > self.max_cached_tokens:
            self._evict_oldest()
        self._reserve(self.head + n + 1 - self.lo)
        pos = self.head + np.arange(n + 1, dtype=np.int64)
        self.buf[pos & self.mask] = np.append(tokens.astype(np.int32, copy=False), SENTINEL)
        self._index_positions(tokens, pos[:n])
        self.head += n + 1

    def candidates(self, token: int) -> np.ndarray:
        """Absolute end positions where ``token`` occurs in the live cache, ascending, at most
        ``max_candidates`` (the most recent)."""
        positions = self._index.get(token)
        if positions is None:
            return np.empty(0, dtype=np.int64)
        arr = np.frombuffer(positions, dtype=np.int64)
        first = max(int(np.searchsorted(arr, self.lo)), arr.size - self.max_candidates)
        return arr[first:].copy()  # a copy: a live view would block the next append to the array

    def _evict_oldest(self) -> None:
        _, (start, end) = self._spans.popitem(last=False)
        self.lo = end if self._spans else self.head
        if self._index_entries > 2 * (self.head - self.lo) + 4096:
            self._compact_index()

    def _reserve(self, live: int) -> None:
        """Grow the ring (power-of-two sizes) until ``live`` tokens fit; live positions keep their
        absolute addresses."""
        if live <= self.buf.size:
            return
        size = 1 << (live - 1).bit_length()
        grown = np.full(size, SENTINEL, dtype=np.int32)
        pos = np.arange(self.lo, self.head, dtype=np.int64)
        grown[pos & (size - 1)] = self.buf[pos & self.mask]
        self.buf = grown

    def _index_positions(self, tokens: np.ndarray, pos: np.ndarray) -> None:
        index = self._index
        for tok, p in zip(tokens.tolist(), pos.tolist()):  # array.append: ~0.1 us a token
            positions = index.get(tok)
            if positions is None:
                positions = index[tok] = array("q")
            positions.append(p)
        self._index_entries += len(pos)

    def _compact_index(self) -> None:
        total = 0
        for tok in list(self._index):
            arr = np.frombuffer(self._index[tok], dtype=np.int64)
            live = arr[arr >= self.lo]
            del arr
            if live.size == 0:
                del self._index[tok]
                continue
            self._index[tok] = array("q", live.tobytes())
            total += live.size
        self._index_entries = total
