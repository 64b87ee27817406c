"""The proposer interface: what the engine asks of a drafter after every step.

After a step's tokens are applied, the engine calls ``propose`` once with every running sequence
that will decode next (exactly one uncomputed token: the last sampled one). A proposer returns, per
sequence, up to ``max_drafts[i]`` token ids that it guesses follow ``seq.token_ids``; an empty list
means "no guess" and that sequence decodes one token as usual. The next step verifies every draft
of every sequence together (engine/runner/model_runner.py), accepts a prefix of each (engine/spec_decode/rejection.py)
and rolls back what the rejected positions touched.

Draft tokens are deterministic guesses (one-hot draft distributions), which is what the n-gram and
suffix proposers are and how EAGLE-3 drafts (greedy) here: the verification rule is then exact for
every sampling setting without the drafter's probabilities.

Plugging in another drafter:
- chain drafters (EAGLE-like, a draft model): implement ``propose``; set ``needs_hidden`` to receive
  the target's auxiliary hidden states (``StepHidden``) of the step that was just verified.
- block drafters (DSpark, dspark_proposer.py: a whole block of drafts from one drafter pass) fit the
  same call: return the block as the list.
- tree drafts need a tree attention mask in the verification step; the interface leaves room (a
  proposer could return a tree), but today's verification step takes one chain per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kimitui.engine.sequence import Sequence


@dataclass
class StepHidden:
    """The target's auxiliary hidden states of one step, for model drafters.

    ``aux``: [R, n_aux * hidden] on the device, one row per computed row of the step (the
    concatenated outputs plus residuals of the target's aux layers, EAGLE-3's input).
    ``spans[seq_id] = (first_row, num_rows, first_position)``: the rows of that sequence whose tokens
    are now part of it (a prefill chunk's rows; a verified decode's last token plus its accepted
    drafts), at consecutive positions from ``first_position``.
    ``next_tokens[seq_id]``: for each of those rows, the token that follows it (the next prompt
    token, an accepted draft, or the token sampled this step).
    ``seqs[seq_id]``: the sequence itself, also for rows of sequences that do not decode next (a
    prefill chunk short of the prompt's end): a drafter with a KV cache on the target's block ids
    writes those rows too, through ``seq.block_table``.
    """

    aux: torch.Tensor
    spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    next_tokens: dict[str, list[int]] = field(default_factory=dict)
    seqs: dict[str, Sequence] = field(default_factory=dict)


class Proposer(Protocol):
    needs_hidden: bool  # True: ``propose`` gets the step's StepHidden (the target then keeps aux rows)

    def propose(self, seqs: list[Sequence], max_drafts: list[int], hidden: StepHidden | None = None) -> list[list[int]]:
        """Draft tokens for each of ``seqs`` (at most ``max_drafts[i]``, possibly none)."""

    def finish(self, seq_id: str) -> None:
        """``seq_id`` finished or was aborted: drop (or archive) what was kept for it."""
