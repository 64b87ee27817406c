"""Per-sequence token history as a growing numpy array, kept in step with a ``Sequence``.

The draft-model-free proposers search a sequence's whole prompt + output every step. Rebuilding
``seq.token_ids`` (a fresh Python list) and converting it to numpy costs about a millisecond per
32k tokens, so each proposer keeps one int32 array per sequence and appends only the tokens added
since its last call. A sentinel ``-1`` always follows the last token, so "the token after
position e" can be gathered for every match end ``e`` without a bounds check.
"""

from __future__ import annotations

import numpy as np

from kimitui.engine.sequence import Sequence

SENTINEL = -1  # never a token id: ends every walk and never matches


class TokenHistory:
    """The tokens of one sequence: ``tokens`` is a view of the first ``num_tokens`` of them."""

    __slots__ = ("buf", "num_tokens", "num_prompt_tokens")

    def __init__(self, num_prompt_tokens: int) -> None:
        self.buf = np.full(256, SENTINEL, dtype=np.int32)
        self.num_tokens = 0
        self.num_prompt_tokens = num_prompt_tokens

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.num_tokens]

    def extend(self, new: list[int]) -> None:
        end = self.num_tokens + len(new)
        if end + 1 > self.buf.size:  # +1 keeps room for the sentinel
            # sizes stay powers of two, so ``buf[pos & (size - 1)]`` indexes it like a ring
            grown = np.full(1 << end.bit_length(), SENTINEL, dtype=np.int32)
            grown[: self.num_tokens] = self.buf[: self.num_tokens]
            self.buf = grown
        self.buf[self.num_tokens : end] = new
        self.buf[end] = SENTINEL
        self.num_tokens = end


class HistoryTable:
    """``TokenHistory`` per ``seq_id``, synced incrementally from the engine's sequences."""

    def __init__(self) -> None:
        self._by_id: dict[str, TokenHistory] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._by_id

    def sync(self, seq: Sequence) -> TokenHistory:
        """The history of ``seq`` with every token it has now. Tokens are only ever appended to a
        sequence; if the cached copy no longer agrees (shorter sequence, another prompt
        length or a different last token: a reused id), it is rebuilt from scratch."""
        h = self._by_id.get(seq.seq_id)
        n = seq.num_tokens
        if (
            h is not None
            and h.num_tokens
            and (
                h.num_tokens > n
                or h.num_prompt_tokens != seq.num_prompt_tokens
                or seq.token_id(h.num_tokens - 1) != h.buf[h.num_tokens - 1]
            )
        ):
            h = None
        if h is None:
            h = self._by_id[seq.seq_id] = TokenHistory(seq.num_prompt_tokens)
        if h.num_tokens < n:
            h.extend(seq.tokens_in_range(h.num_tokens, n))
        return h

    def pop(self, seq_id: str) -> TokenHistory | None:
        return self._by_id.pop(seq_id, None)
