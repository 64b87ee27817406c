"""Speculative decoding as the engine sees it: one object that, after each step, counts what was
accepted, adapts draft lengths (back-off) and asks the proposer for the next step's drafts. With
speculation off it does nothing, so ``LLMEngine.step()`` calls it unconditionally."""

from __future__ import annotations

from kimitui.engine.sequence import Sequence
from kimitui.engine.spec_decode.backoff import DraftBackoff
from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.engine.spec_decode.proposer import Proposer
from kimitui.engine.spec_decode.stats import SpecDecodeStats


class Speculation:
    def __init__(self, config: SpeculativeConfig | None, proposer: Proposer | None, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.num_spec_tokens = config.num_speculative_tokens if config is not None else 0
        self.stats = SpecDecodeStats()
        self.backoff = DraftBackoff.from_config(config) if config is not None else None

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    def after_step(self, sched, result, finished: list[str], running: list[Sequence]) -> None:
        """Count the step's verified drafts, forget the ``finished`` requests, then draft for every
        running sequence that decodes next step (verified by that step)."""
        if self.proposer is None:
            return
        self.stats.observe_step(sched.scheduled, result.sampled)
        self.backoff.observe_step(sched.scheduled, result.sampled)
        for rid in finished:
            self.finish(rid)
        self._propose(running, result.hidden)
        if sched.block_copies and hasattr(self.proposer, "copy_blocks"):
            self.proposer.copy_blocks(sched.block_copies)  # a drafter's KV on the same block ids

    def _propose(self, running: list[Sequence], hidden) -> None:
        seqs, caps = [], []
        for seq in running:
            if seq.num_uncomputed_tokens == 1:
                seqs.append(seq)
                caps.append(min(self.num_spec_tokens, seq.spec_budget(self.max_model_len)))
        if not seqs and hidden is None:
            return
        budgets = self.backoff.budgets(seqs, caps)  # engine.spec_decode.backoff: recent acceptance, batch size
        drafts = self.proposer.propose(seqs, budgets, hidden)
        probs = getattr(self.proposer, "draft_probs", None)  # sampled drafts' q, for the verification
        for seq, d, k in zip(seqs, drafts, budgets):
            seq.spec_token_ids = list(d[:k])
            seq.spec_draft_probs = probs.pop(seq.seq_id, None) if probs else None

    def finish(self, request_id: str) -> None:
        """``request_id`` finished or was aborted: drop what was kept for it."""
        if self.proposer is not None:
            self.proposer.finish(request_id)
            self.backoff.finish(request_id)
