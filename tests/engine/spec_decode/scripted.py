"""A test proposer that knows the answer: it drafts a reference continuation with deliberate
mistakes, so verification sees full acceptances, partial ones and rejections at every position."""

from __future__ import annotations

import random


class ScriptedProposer:
    needs_hidden = False

    def __init__(self, answers: dict[tuple[int, ...], list[int]], error_rate: float = 0.3, seed: int = 0):
        """``answers``: prompt token ids -> the reference output tokens."""
        self.answers = answers
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.finished: list[str] = []
        self.calls = 0

    def propose(self, seqs, max_drafts, hidden=None):
        self.calls += 1
        out = []
        for seq, k in zip(seqs, max_drafts):
            ref = self.answers.get(tuple(seq.prompt_token_ids), [])
            n = seq.num_output_tokens
            draft = list(ref[n : n + k])
            for j in range(len(draft)):
                if self.rng.random() < self.error_rate:
                    draft[j] = (draft[j] + 1 + self.rng.randrange(7)) % 200 + 3
            out.append(draft[: self.rng.randrange(0, k + 1)] if self.rng.random() < 0.2 else draft)
        return out

    def finish(self, seq_id):
        self.finished.append(seq_id)
