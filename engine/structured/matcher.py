"""One request's grammar state: which tokens may come next, given what it generated so far.

The state follows the sequence's output lazily: before each mask it consumes the output tokens
it has not seen (one per plain decode, several after a verified speculative step, none while a
preempted request recomputes), so it never depends on how the engine batched or cut the steps.
Tokens before the end of the reasoning section go to the ``ReasoningGate`` instead.

Stop tokens: llguidance knows one end token (``GrammarCompiler.eos_id``); a request ends on its
own stop ids (the chat format's ``<|im_end|>`` / ``<|end_of_msg|>``, the model's EOS). So where
the grammar allows its end token the mask allows the request's stop ids instead, and a stop id
the request emits is consumed as the end token.
"""

from __future__ import annotations

import logging

import numpy as np

from kimitui.engine.structured.reasoning import ReasoningGate

log = logging.getLogger(__name__)


def _has(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _set(row: np.ndarray, token: int, on: bool) -> None:
    bit = np.uint32(1 << (token & 31))
    if on:
        row[token >> 5] |= bit
    else:
        row[token >> 5] &= ~bit


class RequestGrammar:
    """``matcher``: a fresh llguidance ``LLMatcher``; ``stop_ids``: the ids that end the request;
    ``eos_id``: the grammar's end token; ``gate``: None when the constraint applies from the first
    generated token."""

    def __init__(self, request_id: str, matcher, stop_ids, eos_id: int, gate: ReasoningGate | None = None):
        self.request_id = request_id
        self.matcher = matcher
        self.stop_ids = tuple(t for t in dict.fromkeys(stop_ids))
        self.eos_id = eos_id
        self.gate = gate
        self.num_seen = 0  # output tokens consumed (by the gate or the matcher)
        self.failed = False  # the matcher refused a token: the request goes on unconstrained

    @property
    def active(self) -> bool:
        """The next token is constrained."""
        return not self.failed and (self.gate is None or self.gate.open)

    def advance(self, output_ids: list[int]) -> None:
        """Consume the output tokens not seen yet."""
        for t in output_ids[self.num_seen :]:
            if self.gate is not None and not self.gate.open:
                self.gate.feed(t)
            elif not self.failed and not self.matcher.consume_token(self._as_grammar_token(t)):
                self.failed = True
                log.warning(
                    "request %s: token %d does not match its grammar (%s); the rest is unconstrained",
                    self.request_id,
                    t,
                    self.matcher.get_error(),
                )
        self.num_seen = len(output_ids)

    def _as_grammar_token(self, t: int) -> int:
        return self.eos_id if t in self.stop_ids else t

    def fixup(self, row: np.ndarray) -> None:
        """Swap the grammar's end token for the request's stop ids in a filled mask row (uint32)."""
        if not self.stop_ids or not _has(row, self.eos_id):
            return  # no stop ids (ignore_eos): the end token stays, so a row is never empty
        if self.eos_id not in self.stop_ids:
            _set(row, self.eos_id, False)
        for t in self.stop_ids:
            if (t >> 5) < row.shape[0]:
                _set(row, t, True)

    def fill(self, row: np.ndarray) -> None:
        """The mask of the next token into ``row`` (uint32 [W]); the matcher must be active."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.fixup(row)

    def fill_drafts(self, rows: np.ndarray, drafts: list[int]) -> list[bool]:
        """Masks for a speculative step: row ``j`` (uint32 [len(drafts) + 1, W]) is the mask after
        ``drafts[:j]``. Stops at the first draft the grammar refuses (verification rejects it, so
        the rows after it are never read). The matcher is left as it was. Returns which rows
        were filled (a row inside the reasoning section is not)."""
        filled = [False] * (len(drafts) + 1)
        if self.failed:
            return filled
        gate = self.gate.copy() if self.gate is not None else None
        consumed = 0
        try:
            for j in range(len(drafts) + 1):
                open_ = gate is None or gate.open
                if open_:
                    self.fill(rows[j])
                    filled[j] = True
                if j == len(drafts):
                    break
                d = drafts[j]
                if not open_:
                    gate.feed(d)
                    continue
                if not _has(rows[j], d):
                    break  # refused: verification rejects this draft
                if d in self.stop_ids:
                    break  # the request ends there; (llguidance cannot roll back its end token)
                if not self.matcher.consume_token(self._as_grammar_token(d)):
                    self.failed = True  # allowed by its own mask yet refused: the matcher is broken
                    log.warning(
                        "request %s: draft %d allowed by the mask but refused (%s)",
                        self.request_id,
                        d,
                        self.matcher.get_error(),
                    )
                    break
                consumed += 1
        finally:
            if consumed and not self.failed:
                self.matcher.rollback(consumed)
        return filled
