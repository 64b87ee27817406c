"""Presence, frequency and repetition penalties on a step's logits, as vLLM and the OpenAI API
define them (vLLM's ``model_executor/layers/utils.py`` ``apply_penalties``):

- repetition (CTRL, Keskar et al. 2019): every token seen in the prompt or the output has its
  logit divided by the penalty when positive, multiplied by it when negative (1.0: off);
- frequency: the logit drops by the penalty times the token's count in the output so far;
- presence: the logit drops by the penalty once if the token is in the output so far.

They apply to the raw logits before temperature, top-k and top-p, so greedy decoding with a penalty
takes the argmax of the penalised logits. Reported log-probs stay the model's own (vLLM's default
``raw_logprobs``).

A step's penalised rows may be verify rows of speculative decoding: row ``j`` of a sequence that
drafted ``d`` counts ``output + d[:j]`` as its output, so that every verified position sees the
history it would have had without speculation (vLLM's rejection sampler does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def has_penalties(params) -> bool:
    return (
        getattr(params, "presence_penalty", 0.0) != 0.0
        or getattr(params, "frequency_penalty", 0.0) != 0.0
        or getattr(params, "repetition_penalty", 1.0) != 1.0
    )


@dataclass
class PenaltyBatch:
    """The penalised rows of a step's logits. ``rows`` [P]: their indices; ``seen`` [P, V] bool:
    tokens of the prompt or output (repetition); ``counts`` [P, V] fp32: output counts (frequency,
    presence); the three penalties [P] fp32."""

    rows: torch.Tensor
    seen: torch.Tensor
    counts: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    @classmethod
    def build(
        cls,
        rows: list[int],
        params: list,
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> "PenaltyBatch | None":
        """``rows[r]`` is penalised with ``params[r]``'s penalties, given its prompt and output
        tokens so far. None when no row has a penalty. Token ids outside the vocabulary are
        ignored (a padded LM head may be wider than the tokenizer, never narrower)."""
        keep = [r for r, p in enumerate(params) if has_penalties(p)]
        if not keep:
            return None
        counts = _counts([outputs[r] for r in keep], vocab_size, device)
        seen = _counts([prompts[r] for r in keep], vocab_size, device) > 0
        seen |= counts > 0
        vals = torch.tensor(
            [[params[r].presence_penalty, params[r].frequency_penalty, params[r].repetition_penalty] for r in keep],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        return cls(
            rows=torch.tensor([rows[r] for r in keep], dtype=torch.int64).to(device, non_blocking=True),
            seen=seen,
            counts=counts,
            presence=vals[:, 0],
            frequency=vals[:, 1],
            repetition=vals[:, 2],
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A penalised copy of ``logits`` [R, V] (the input is left as it was, for raw log-probs)."""
        out = logits.clone()
        sub = out.index_select(0, self.rows)
        rep = self.repetition[:, None]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(self.seen, penalised, sub)
        sub = sub - self.frequency[:, None] * self.counts - self.presence[:, None] * (self.counts > 0).float()
        return out.index_copy_(0, self.rows, sub)


def _counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[P, V] fp32 occurrence counts of each list's token ids, built on ``device`` from one copy."""
    width = max((len(t) for t in token_lists), default=0)
    pad = vocab_size  # an extra column that is dropped
    flat = [t + [pad] * (width - len(t)) for t in token_lists]
    ids = torch.tensor(flat, dtype=torch.int64).reshape(len(token_lists), width).to(device, non_blocking=True)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, pad)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]
