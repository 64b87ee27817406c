"""Acceptance counters of speculative decoding, named as vLLM's ``spec_decode_*`` metrics.

A *draft* is one sequence's guesses verified in one step; ``num_draft_tokens`` counts the guessed
tokens, ``num_accepted_tokens`` those accepted, ``accepted_per_pos[j]`` how many drafts had their
j-th token accepted. Acceptance rate = accepted / draft tokens; mean acceptance length (vLLM's
``spec_decode_acceptance_length``) = 1 + accepted / drafts, the tokens a verifying step yields.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def observe_step(self, scheduled, sampled) -> None:
        """Count a step's verified decodes (``sampled[i]`` a list for those, see ``StepResult``)."""
        for item, out in zip(scheduled, sampled):
            if item.spec_token_ids and isinstance(out, list):
                self.observe(len(item.spec_token_ids), len(out) - 1)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def per_position_rates(self) -> list[float]:
        """Per draft position: the fraction of drafts whose token there was accepted."""
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )

    def as_json(self) -> dict:
        """vLLM bench's keys (``spec_decode_acceptance_rate`` as a percentage, as vLLM prints it)."""
        rate = self.acceptance_rate
        return {
            "spec_decode_acceptance_rate": None if rate is None else 100.0 * rate,
            "spec_decode_acceptance_length": self.acceptance_length,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_draft_tokens": self.num_draft_tokens,
            "spec_decode_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_per_position_acceptance_rates": self.per_position_rates(),
        }

    def since(self, before: SpecDecodeStats) -> SpecDecodeStats:
        """The counts between ``before`` and now (a benchmark's window)."""
        per = [
            a - (before.accepted_per_pos[j] if j < len(before.accepted_per_pos) else 0)
            for j, a in enumerate(self.accepted_per_pos)
        ]
        return SpecDecodeStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            per,
        )
